//! Fuzz target of the custom resources' specs as the operator reads them (see `fuzz/` and
//! `fuzz-targets/`): arbitrary bytes as a `Deployment` or `Host` object in JSON (what the API
//! server sends) and as a `Deployment` manifest in YAML. Panics only when an invariant fails.
//! Not part of the crate's API.

use capyctl_spec::settings::{
    ADMISSION_WINDOW_BOUNDS, MAX_BUFFERED_BYTES_TOTAL_BOUNDS, MAX_PENDING_PER_DEPLOYMENT_BOUNDS,
    MAX_PENDING_TOTAL_BOUNDS, QueueSettings, REQUEST_DEADLINE_BOUNDS, STREAM_IDLE_TIMEOUT_BOUNDS,
};
use capyctl_spec::units::ByteSize;

use crate::{Deployment, Host, parse_deployment_manifest_str};

/// A `Deployment` object: its spec validates as a deployment document or is refused with an
/// error that prints; a document it gives makes an object whose spec gives the same document.
/// A `Host` object: the queue policy the operator takes from it is within the settings' ranges.
/// A `Deployment` manifest (YAML): read, or refused with an error that prints.
pub fn specs(data: &[u8]) {
    if let Ok(object) = serde_json::from_slice::<Deployment>(data) {
        match object.to_document() {
            Ok(doc) => {
                let again = Deployment::from_document(&doc)
                    .to_document()
                    .unwrap_or_else(|e| panic!("the object of {doc:?} is refused: {e}"));
                assert_eq!(again, doc);
            }
            Err(e) => drop(e.to_string()),
        }
    }
    if let Ok(host) = serde_json::from_slice::<Host>(data) {
        let queue = QueueSettings::from(&host.spec.resource_policy.queue);
        assert!(ADMISSION_WINDOW_BOUNDS.contains(queue.admission_window));
        assert!(queue.admission_window <= queue.request_deadline);
        assert!(REQUEST_DEADLINE_BOUNDS.contains(queue.request_deadline));
        assert!(STREAM_IDLE_TIMEOUT_BOUNDS.contains(queue.stream_idle_timeout));
        assert!(MAX_PENDING_PER_DEPLOYMENT_BOUNDS.contains(queue.max_pending_per_deployment));
        assert!(MAX_PENDING_TOTAL_BOUNDS.contains(queue.max_pending_total));
        assert!(
            MAX_BUFFERED_BYTES_TOTAL_BOUNDS
                .contains(ByteSize::bytes(queue.max_buffered_bytes_total))
        );
    }
    if let Ok(text) = std::str::from_utf8(data) {
        match parse_deployment_manifest_str("fuzz.yaml", text) {
            Ok(object) => {
                object
                    .to_document()
                    .unwrap_or_else(|e| panic!("a manifest read is refused: {e}"));
            }
            Err(e) => drop(e.to_string()),
        }
    }
}
