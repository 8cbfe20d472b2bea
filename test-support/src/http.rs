//! A small HTTP client for the tests' listeners: JSON in and out, the management API's token.
//! (A connection refused or cut is a test's failure: these panic, the `try_` ones return it.)
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// POSTs `body` to `http://addr/path`; the status and the JSON answer.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    try_post_json(addr, path, body).await.unwrap()
}

/// `POST http://addr/path` with a JSON body: the status and the JSON answer (a string when it
/// is not JSON).
pub async fn try_post_json(
    addr: SocketAddr,
    path: &str,
    body: serde_json::Value,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    try_post_json_as(addr, path, None, body).await
}

/// [`try_post_json`] with `Authorization: Bearer <key>` when `key` is given (a tenant's key on
/// the inference listener).
pub async fn try_post_json_as(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: serde_json::Value,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let mut req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    try_request(req).await
}

/// `GET http://addr/path`: the status and the JSON answer (a string when it is not JSON).
pub async fn try_get_json(
    addr: SocketAddr,
    path: &str,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    try_request(req).await
}

async fn try_request(
    req: http::Request<Full<Bytes>>,
) -> Result<(u16, serde_json::Value), hyper_util::client::legacy::Error> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
    Ok((status, json))
}

/// A management request: `method` on `http://addr/path` with the admin token and an optional
/// JSON body; the status and the JSON answer.
pub async fn management(
    method: &str,
    addr: SocketAddr,
    path: &str,
    token: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {token}"));
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, json)
}
