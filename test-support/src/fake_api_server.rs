//! [`FakeApiServer`]: a small fake of the Kubernetes API server over HTTP, for the operator
//! and node agent programs: objects in memory by path, resource versions,
//! merge patches with a `resourceVersion` precondition, JSON patches (with `test`),
//! server-side apply of `status`, updates
//! (409 on a stale `resourceVersion`), deletion held by finalizers, and watches.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use http::{Method, StatusCode, Uri};
use serde_json::{Value, json};
use tokio::sync::watch;

#[derive(Default)]
struct Objects {
    rv: u64,
    /// By collection path (`/apis/g/v/namespaces/ns/plural`), then name.
    by_collection: BTreeMap<String, BTreeMap<String, Value>>,
    /// Every change: (rv, collection, watch event).
    log: Vec<(u64, String, Value)>,
}

/// The fake API server (see the module doc); [`FakeApiServer::start`] serves one.
#[derive(Clone)]
pub struct FakeApiServer {
    objects: Arc<Mutex<Objects>>,
    changed: watch::Sender<u64>,
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code});
    respond(code, &body)
}

fn respond(code: u16, body: &Value) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

/// RFC 7386.
fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// Splits `/apis/g/v/namespaces/ns/plural[/name[/sub]]` (or `/api/v1/...`, or a
/// cluster-scoped path) into (collection, name, subresource).
fn split(path: &str) -> (String, Option<String>, Option<String>) {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let base = if segs.first() == Some(&"api") { 2 } else { 3 };
    let start = if segs.get(base) == Some(&"namespaces") && segs.len() > base + 2 {
        base + 2
    } else {
        base
    };
    let collection = format!("/{}", segs[..=start.min(segs.len() - 1)].join("/"));
    (
        collection,
        segs.get(start + 1).map(|s| s.to_string()),
        segs.get(start + 2).map(|s| s.to_string()),
    )
}

impl Objects {
    fn record(&mut self, collection: &str, kind: &str, object: &Value) {
        self.log.push((
            self.rv,
            collection.to_string(),
            json!({"type": kind, "object": object}),
        ));
    }

    fn bump(&mut self, object: &mut Value) {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = self.rv.to_string().into();
    }

    /// Stores `object` (modified), or removes it when it is being deleted and has no
    /// finalizer left.
    fn store(&mut self, collection: &str, name: &str, mut object: Value) -> Value {
        self.bump(&mut object);
        let finalizers_left = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if object["metadata"]["deletionTimestamp"].is_string() && !finalizers_left {
            self.by_collection
                .entry(collection.to_string())
                .or_default()
                .remove(name);
            self.record(collection, "DELETED", &object);
        } else {
            self.by_collection
                .entry(collection.to_string())
                .or_default()
                .insert(name.to_string(), object.clone());
            self.record(collection, "MODIFIED", &object);
        }
        object
    }
}

impl FakeApiServer {
    /// Serves on a loopback port; answers its address.
    pub async fn start() -> SocketAddr {
        let fake = FakeApiServer {
            objects: Arc::default(),
            changed: watch::channel(0).0,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().fallback(handle).with_state(fake);
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        addr
    }

    fn changed(&self, rv: u64) {
        self.changed.send_replace(rv);
    }
}

fn query(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.replace("%2F", "/").replace("%3D", "=")))
        .collect()
}

fn watch_stream(fake: FakeApiServer, collection: String, from: u64) -> Response {
    let rx = fake.changed.subscribe();
    let stream =
        futures_util::stream::unfold((fake, rx, from), move |(fake, mut rx, mut cursor)| {
            let collection = collection.clone();
            async move {
                loop {
                    let lines: Vec<(u64, Value)> = {
                        let o = fake.objects.lock().unwrap();
                        o.log
                            .iter()
                            .filter(|(rv, c, _)| *rv > cursor && *c == collection)
                            .map(|(rv, _, e)| (*rv, e.clone()))
                            .collect()
                    };
                    if !lines.is_empty() {
                        let mut out = Vec::new();
                        for (rv, e) in lines {
                            cursor = cursor.max(rv);
                            out.extend(serde_json::to_vec(&e).unwrap());
                            out.push(b'\n');
                        }
                        return Some((Ok::<_, Infallible>(Bytes::from(out)), (fake, rx, cursor)));
                    }
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            }
        });
    Response::builder()
        .status(200)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn handle(
    State(fake): State<FakeApiServer>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return status(400, "BadRequest", &e.to_string()),
        }
    };
    let q = query(&uri);
    let (collection, name, sub) = split(uri.path());
    let mut o = fake.objects.lock().unwrap();
    let answer = match (&method, name.as_deref(), sub.as_deref()) {
        (&Method::GET, None, _) if q.get("watch").map(String::as_str) == Some("true") => {
            let from = q
                .get("resourceVersion")
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            drop(o);
            return watch_stream(fake.clone(), collection, from);
        }
        (&Method::GET, None, _) => {
            let selector = q.get("labelSelector").cloned();
            let items: Vec<Value> = o
                .by_collection
                .get(&collection)
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default();
            let items: Vec<Value> = items
                .into_iter()
                .filter(
                    |i| match selector.as_deref().and_then(|s| s.split_once('=')) {
                        Some((k, v)) => i["metadata"]["labels"][k] == v,
                        None => true,
                    },
                )
                .collect();
            respond(
                200,
                &json!({"apiVersion": "v1", "kind": "List",
                "metadata": {"resourceVersion": o.rv.to_string()}, "items": items}),
            )
        }
        (&Method::GET, Some(n), _) => {
            match o.by_collection.get(&collection).and_then(|m| m.get(n)) {
                Some(obj) => respond(200, obj),
                None => status(404, "NotFound", &format!("{n} not found")),
            }
        }
        (&Method::POST, None, _) => {
            let mut obj = body.clone();
            let Some(n) = obj["metadata"]["name"].as_str().map(str::to_string) else {
                return status(422, "Invalid", "metadata.name is required");
            };
            if o.by_collection
                .get(&collection)
                .is_some_and(|m| m.contains_key(&n))
            {
                return status(409, "AlreadyExists", &format!("{n} already exists"));
            }
            obj["metadata"]["uid"] = format!("uid-{}-{}", n, o.rv + 1).into();
            obj["metadata"]["generation"] = 1.into();
            obj["metadata"]["creationTimestamp"] = "2026-12-03T08:00:00Z".into();
            o.bump(&mut obj);
            o.by_collection
                .entry(collection.clone())
                .or_default()
                .insert(n, obj.clone());
            o.record(&collection, "ADDED", &obj);
            respond(201, &obj)
        }
        (&Method::PUT, Some(n), _) => {
            let Some(cur) = o
                .by_collection
                .get(&collection)
                .and_then(|m| m.get(n))
                .cloned()
            else {
                return status(404, "NotFound", &format!("{n} not found"));
            };
            if body["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return status(409, "Conflict", "the object has been modified");
            }
            let mut obj = body.clone();
            obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
            let obj = o.store(&collection, n, obj);
            respond(200, &obj)
        }
        (&Method::PATCH, Some(n), sub) => {
            let Some(mut cur) = o
                .by_collection
                .get(&collection)
                .and_then(|m| m.get(n))
                .cloned()
            else {
                if collection.ends_with("/events") {
                    return respond(200, &body);
                }
                return status(404, "NotFound", &format!("{n} not found"));
            };
            if sub == Some("status") {
                // Server-side apply of the status: the applied status replaces ours.
                cur["status"] = body["status"].clone();
            } else if body.is_array() {
                // A JSON patch (the finalizer helper's): all or nothing, 422 on a failed
                // `test`. NB: the API server's `test` takes an absent member as `null`;
                // json-patch needs it spelled.
                let patch: json_patch::Patch = match serde_json::from_value(body.clone()) {
                    Ok(p) => p,
                    Err(e) => return status(400, "BadRequest", &e.to_string()),
                };
                let mut patched = cur.clone();
                if let Some(m) = patched["metadata"].as_object_mut() {
                    m.entry("finalizers").or_insert(Value::Null);
                }
                if let Err(e) = json_patch::patch(&mut patched, &patch) {
                    return status(422, "Invalid", &e.to_string());
                }
                if patched["spec"] != cur["spec"] {
                    let g = patched["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                    patched["metadata"]["generation"] = g.into();
                }
                if let Some(m) = patched["metadata"].as_object_mut()
                    && m.get("finalizers").is_some_and(Value::is_null)
                {
                    m.remove("finalizers");
                }
                cur = patched;
            } else {
                let want = &body["metadata"]["resourceVersion"];
                if want.is_string() && *want != cur["metadata"]["resourceVersion"] {
                    return status(409, "Conflict", "the object has been modified");
                }
                let mut patch = body.clone();
                // `get_mut`, not `patch["metadata"]`: indexing a patch without metadata would
                // add `"metadata": null` to it, which merges as "remove the metadata".
                if let Some(m) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                }
                let spec_before = cur["spec"].clone();
                merge(&mut cur, &patch);
                if cur["spec"] != spec_before {
                    let g = cur["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                    cur["metadata"]["generation"] = g.into();
                }
            }
            let obj = o.store(&collection, n, cur);
            respond(200, &obj)
        }
        (&Method::DELETE, Some(n), _) => {
            let Some(mut cur) = o
                .by_collection
                .get(&collection)
                .and_then(|m| m.get(n))
                .cloned()
            else {
                return status(404, "NotFound", &format!("{n} not found"));
            };
            cur["metadata"]["deletionTimestamp"] = "2026-12-03T08:00:01Z".into();
            let obj = o.store(&collection, n, cur);
            respond(200, &obj)
        }
        _ => status(405, "MethodNotAllowed", &format!("{method} {uri}")),
    };
    let rv = o.rv;
    drop(o);
    fake.changed(rv);
    answer
}
