//! [`CrsApi`]: a small stateful mock of the Kubernetes API server, on the scripted
//! [`MockApi`] (no socket), holding `Deployment` CRs of namespace `capyctl`: finalizer patches
//! (JSON patches, with `test`) and status applies change them and bump their
//! `resourceVersion`, Events are echoed, anything else is 404; every call is kept, for a test
//! to read the status writes and the Events' reasons.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use capyctl_crds::Deployment;
use http::Method;
use kube::Client;

use crate::{Answer, MockApi};

/// The path of the CRs.
const NS_PATH: &str = "/apis/capyctl.io/v1alpha1/namespaces/capyctl/deployments/";

/// One call the mock API server answered.
#[derive(Debug, Clone)]
struct Call {
    method: Method,
    path: String,
    body: serde_json::Value,
}

/// A mock API server holding `Deployment` CRs of namespace `capyctl` (see the module doc).
#[derive(Clone, Default)]
pub struct CrsApi {
    /// The CRs, by name, as JSON (a test puts them in and reads them).
    pub crs: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl CrsApi {
    /// CR `name`.
    pub fn cr(&self, name: &str) -> Deployment {
        serde_json::from_value(self.crs.lock().unwrap()[name].clone()).unwrap()
    }

    fn answer(
        &self,
        method: &Method,
        path: &str,
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let mut crs = self.crs.lock().unwrap();
        if let Some(rest) = path.strip_prefix(NS_PATH) {
            let (name, status) = match rest.strip_suffix("/status") {
                Some(n) => (n, true),
                None => (rest, false),
            };
            let Some(cr) = crs.get_mut(name) else {
                return (
                    404,
                    serde_json::json!({"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"}),
                );
            };
            if *method == Method::PATCH {
                if status {
                    cr["status"] = body["status"].clone();
                } else {
                    // The finalizer helper's JSON patch; the API server's `test` takes an
                    // absent member as `null`, json-patch needs it spelled.
                    let patch: json_patch::Patch = serde_json::from_value(body.clone()).unwrap();
                    let mut patched = cr.clone();
                    patched["metadata"]
                        .as_object_mut()
                        .unwrap()
                        .entry("finalizers")
                        .or_insert(serde_json::Value::Null);
                    if let Err(e) = json_patch::patch(&mut patched, &patch) {
                        return (
                            422,
                            serde_json::json!({"kind": "Status", "code": 422, "reason": "Invalid", "message": e.to_string()}),
                        );
                    }
                    *cr = patched;
                }
                let rv: u64 = cr["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                cr["metadata"]["resourceVersion"] = (rv + 1).to_string().into();
            }
            return (200, cr.clone());
        }
        if path.starts_with("/apis/events.k8s.io/v1/namespaces/capyctl/events") {
            return (200, body.clone());
        }
        (
            404,
            serde_json::json!({"kind": "Status", "code": 404, "reason": "NotFound", "message": path}),
        )
    }

    /// A client of this server (default namespace `capyctl`).
    pub fn client(&self) -> Client {
        let (client, api) = MockApi::client("capyctl");
        let me = self.clone();
        api.serve_with(move |call| {
            let (status, body) = me.answer(&call.method, &call.path, &call.body);
            me.calls.lock().unwrap().push(Call {
                method: call.method.clone(),
                path: call.path.clone(),
                body: call.body.clone(),
            });
            Answer::Json { status, body }
        });
        client
    }

    /// The reasons of the Events about `name`, in order.
    pub fn events(&self, name: &str) -> Vec<String> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.path.contains("/events") && c.body["regarding"]["name"] == name)
            .map(|c| c.body["reason"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// The `status` of every status patch of `name`, in order.
    pub fn status_writes(&self, name: &str) -> Vec<serde_json::Value> {
        let path = format!("{NS_PATH}{name}/status");
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.method == Method::PATCH && c.path == path)
            .map(|c| c.body["status"].clone())
            .collect()
    }
}
