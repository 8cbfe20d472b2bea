//! The deployments list as the management listener sends it (`ManagementApi::list_parts`): a
//! part at a time, each written into one buffer the parts reuse, so that no answer of every
//! deployment is held at once (100,000 deployments' list is some 75 MB).

use std::ops::Range;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use capyctl_spec::api::DeploymentList;
use capyctl_spec::errors::ApiError;

use crate::api::JsonParts;
use crate::reads::cannot_encode;
use crate::state::Hosts;
use crate::{Core, LifecycleConfig, views};

/// About how many bytes a part of a list holds: views are written into it until it holds at
/// least this many (a view is some 750 bytes; the last one may take it past).
pub(crate) const PART_BYTES: usize = 64 * 1024;

impl Core {
    /// `GET /deployments` as the management listener sends it, a part at a time: the
    /// deployments are copied now ([`Core::listed`]: in the order the list shows them), each
    /// view built and encoded when its part is asked for, then dropped.
    pub(crate) fn do_list_parts(&self) -> Result<JsonParts, ApiError> {
        let (shots, order, hosts) = self.listed();
        let (head, tail) = array_ends(&DeploymentList {
            deployments: Vec::new(),
        })?;
        Ok(JsonParts::new(ListParts {
            config: self.config.clone(),
            any_explicit: views::any_host_explicit(&hosts),
            hosts,
            sets: self.adapter_sets(),
            shots,
            order: order.into_iter(),
            buf: BytesMut::new(),
            head: Some(head),
            tail,
            written: 0,
            done: false,
        }))
    }

    /// [`Core::do_list_parts`] joined: the whole answer.
    pub(crate) fn do_list_json(&self) -> Result<Vec<u8>, ApiError> {
        self.do_list_parts()?.join()
    }
}

/// The parts of the deployments list ([`Core::do_list_parts`]).
struct ListParts {
    config: LifecycleConfig,
    hosts: Hosts,
    any_explicit: bool,
    sets: Arc<views::AdapterSets>,
    /// Every deployment's snapshots, and the ranges of each one's in the list's order: those
    /// not written yet.
    shots: Vec<views::DepShot>,
    order: std::vec::IntoIter<Range<usize>>,
    /// Each part is written here, then split off: once the listener has sent and dropped a
    /// part, the next reuses its memory (`BytesMut::reserve` takes it back).
    buf: BytesMut,
    /// The answer's bytes before the first view (`{"deployments":[`), until written.
    head: Option<Vec<u8>>,
    /// Its bytes after the last view (`]}`).
    tail: Vec<u8>,
    written: usize,
    done: bool,
}

impl Iterator for ListParts {
    type Item = Result<Bytes, ApiError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        self.buf.reserve(PART_BYTES + PART_BYTES / 4);
        if let Some(head) = self.head.take() {
            self.buf.put_slice(&head);
        }
        let cx = views::Ctx::with_explicit(&self.config, &self.hosts, self.any_explicit)
            .with_adapters(Arc::clone(&self.sets));
        while self.buf.len() < PART_BYTES {
            let Some(r) = self.order.next() else {
                self.buf.put_slice(&self.tail);
                self.done = true;
                break;
            };
            if self.written > 0 {
                self.buf.put_u8(b',');
            }
            if let Err(e) = views::write_deployment_view(&mut self.buf, &self.shots[r], &cx) {
                self.done = true;
                return Some(Err(cannot_encode(e)));
            }
            self.written += 1;
        }
        Some(Ok(self.buf.split().freeze()))
    }
}

/// The JSON of `empty`, a body whose last field is an empty array, split around the array's
/// elements: `(…[`, `]}`).
pub(crate) fn array_ends<T: serde::Serialize>(empty: &T) -> Result<(Vec<u8>, Vec<u8>), ApiError> {
    let mut head = serde_json::to_vec(empty).map_err(cannot_encode)?;
    if !head.ends_with(b"[]}") {
        return Err(ApiError::Internal {
            detail: "cannot encode the answer: its last field is not an empty array".to_string(),
        });
    }
    let tail = head.split_off(head.len() - 2);
    Ok((head, tail))
}
