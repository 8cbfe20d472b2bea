//! The observer hears of every request exactly once, when it ends, with what happened.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use capyctl_router::observe::{self, RequestEvent, RequestObserver};
use capyctl_router::proxy::ProxyConfig;
use http::StatusCode;
use http_body_util::BodyExt;
use proxy_support::*;
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<RequestEvent>>,
    changed: Notify,
}

impl RequestObserver for Recorder {
    fn finished(&self, event: &RequestEvent) {
        self.events.lock().unwrap().push(event.clone());
        self.changed.notify_waiters();
    }
}

impl Recorder {
    async fn wait_for(&self, n: usize) -> Vec<RequestEvent> {
        let end = Instant::now() + PATIENCE;
        loop {
            let changed = self.changed.notified();
            {
                let events = self.events.lock().unwrap();
                if events.len() >= n {
                    return events.clone();
                }
            }
            if tokio::time::timeout_at(end, changed).await.is_err() {
                panic!("timed out waiting for {n} events: {:?}", self.events.lock());
            }
        }
    }
}

fn chat(stream: bool, max_tokens: u64) -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":{max_tokens},"stream":{stream}}}"#
    )
}

#[tokio::test]
async fn every_request_is_reported_once_with_its_outcome() {
    let sim = start_sim(&[]).await;
    let recorder = Arc::new(Recorder::default());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let (proxy, server) = start_observed_proxy_until(
        TestAdmission::new(sim),
        ProxyConfig::default(),
        recorder.clone(),
        stopped,
    )
    .await;

    let (status, _, _) = post(proxy, "/v1/chat/completions", &chat(false, 4)).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = post(proxy, "/v1/chat/completions", &chat(true, 4)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    let (status, _, _) = post(proxy, "/v1/chat/completions", r#"{"model":"chat-z"}"#).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = post(proxy, "/v1/completions", "not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = get(proxy, "/v1/models").await;
    assert_eq!(status, StatusCode::OK);

    let events = recorder.wait_for(5).await;
    let deployment = Some(DEPLOYMENT.to_string());
    let model = Some(MODEL.to_string());
    assert_eq!(
        (&events[0].deployment_id, &events[0].model, events[0].status),
        (&deployment, &model, 200)
    );
    assert_eq!((events[0].code, events[0].streamed), (None, false));
    assert_eq!((events[1].status, events[1].code), (200, None));
    assert!(events[1].streamed);
    assert_eq!(events[2].deployment_id, None);
    assert_eq!(events[2].model.as_deref(), Some("chat-z"));
    assert_eq!(
        (events[2].status, events[2].code),
        (404, Some("model_not_found"))
    );
    assert_eq!(
        (events[3].status, events[3].code, &events[3].model),
        (400, Some("invalid_request"), &None)
    );
    assert_eq!((events[4].status, events[4].code), (200, None));
    // Nothing more comes: once the listener has stopped, every connection (and everything a
    // request held) is gone, and there were still five reports.
    stop.send(()).unwrap();
    until_stopped(server).await;
    assert_eq!(recorder.events.lock().unwrap().len(), 5);
}

#[tokio::test]
async fn a_wait_past_the_deadline_reports_how_long_it_waited() {
    let sim = start_sim(&[]).await;
    let recorder = Arc::new(Recorder::default());
    let config = ProxyConfig {
        request_deadline: Duration::from_millis(150),
        ..ProxyConfig::default()
    };
    let proxy = start_observed_proxy(
        TestAdmission::new(sim).with_mode(Mode::Hold),
        config,
        recorder.clone(),
    )
    .await;
    let (status, _, _) = post(proxy, "/v1/chat/completions", &chat(true, 4)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let events = recorder.wait_for(1).await;
    assert_eq!(
        (events[0].status, events[0].code),
        (503, Some("unavailable"))
    );
    assert!(events[0].waited >= Duration::from_millis(140), "{events:?}");
}

#[tokio::test]
async fn hang_ups_are_reported_as_client_gone() {
    let sim = start_sim(&["--sim-token-rate", "50"]).await;
    let recorder = Arc::new(Recorder::default());
    let proxy = start_observed_proxy(
        TestAdmission::new(sim),
        ProxyConfig::default(),
        recorder.clone(),
    )
    .await;

    // Mid-stream.
    let mut conn = Conn::open(proxy).await;
    let response = conn.post("/v1/chat/completions", &chat(true, 5000)).await;
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    drop(conn);
    let events = recorder.wait_for(1).await;
    assert_eq!(
        (events[0].status, events[0].code, events[0].streamed),
        (200, Some(observe::CLIENT_GONE), true)
    );

    // While waiting for admission.
    let holding = TestAdmission::new(sim).with_mode(Mode::Hold);
    let record = Arc::clone(&holding.record);
    let held = start_observed_proxy(holding, ProxyConfig::default(), recorder.clone()).await;
    let mut conn = Conn::open(held).await;
    let request = http::Request::post("/v1/chat/completions")
        .header("host", "test")
        .body(http_body_util::Full::new(bytes::Bytes::from(chat(
            false, 4,
        ))))
        .unwrap();
    let sent = tokio::spawn(async move {
        let _ = conn.send(request).await;
    });
    record
        .wait("the request to wait", |r| {
            r.entered.load(std::sync::atomic::Ordering::SeqCst) == 1
        })
        .await;
    sent.abort();
    let events = recorder.wait_for(2).await;
    assert_eq!(
        (events[1].status, events[1].code),
        (observe::STATUS_CLIENT_GONE, Some(observe::CLIENT_GONE))
    );
    assert_eq!(events[1].deployment_id.as_deref(), Some(DEPLOYMENT));
    assert!(events[1].waited > Duration::ZERO);
}

#[tokio::test]
async fn a_request_dropped_while_its_body_arrives_is_reported_too() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = start_sim(&[]).await;
    let recorder = Arc::new(Recorder::default());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let config = ProxyConfig {
        shutdown_grace: Duration::from_millis(100),
        ..ProxyConfig::default()
    };
    let (proxy, server) =
        start_observed_proxy_until(TestAdmission::new(sim), config, recorder.clone(), stopped)
            .await;
    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\nexpect: 100-continue\r\n\r\n")
        .await
        .unwrap();
    // The `100 Continue` says that the listener waits for the body.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 100 Continue"));
    stream.write_all(b"{\"model\":").await.unwrap();
    // The listener stops; its grace runs out with the body still not there.
    stop.send(()).unwrap();
    until_stopped(server).await;
    let events = recorder.events.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (events[0].status, events[0].code),
        (observe::STATUS_CLIENT_GONE, Some(observe::CLIENT_GONE))
    );
}
