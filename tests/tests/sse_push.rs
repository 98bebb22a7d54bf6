//! An HTTP client of a session's event stream sees a commit at once, not at
//! the next poll: each event is appended the moment the client received the
//! previous one (when a polling stream has just looked and gone to sleep),
//! so a stream that polled every 50 ms would show a gap near 50 ms every
//! time. The median gap must stay well under that, for appends made by this
//! process and by another writer on the same store file (another process's
//! worker, as far as SQLite can tell).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dexa::flow::FlowStore;
use dexa::store::sqlite::SqliteStore;
use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::json;

/// Appends per run; the median of their gaps is judged.
const SAMPLES: usize = 21;

/// A median gap this long would mean a poll, not a push (a 50 ms poll gives
/// about 50 ms here).
const PUSHED_MEDIAN: Duration = Duration::from_millis(40);

fn event(n: usize) -> serde_json::Value {
    json!({
        "type": "custom_probe",
        "turn_id": "turn-0",
        "step_execution_id": "probe",
        "attempt": 1,
        "data": {"n": n},
    })
}

/// The gaps from each append to the client receiving it, appending through
/// `writer`, each as soon as the previous event arrived.
async fn gaps(server: &ApiServer, writer: Arc<dyn FlowStore>) -> Vec<Duration> {
    let http = reqwest::Client::new();
    let started = http
        .post(format!("{}/v1/agents/Helpdesk/sessions", server.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"session_id": "s1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), StatusCode::CREATED);
    let response = http
        .get(format!("{}/v1/sessions/s1/events", server.base))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.bytes_stream().eventsource();
    let mut gaps = Vec::new();
    for n in 0..=SAMPLES {
        let appended = Instant::now();
        writer
            .append_stream("s1", dexa::session::AGENT_EVENTS, vec![event(n)])
            .await
            .unwrap();
        loop {
            let received = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .expect("an event within 10 s")
                .expect("the stream stays open")
                .expect("a well-formed event");
            if received.event == "custom_probe" {
                let data: serde_json::Value = serde_json::from_str(&received.data).unwrap();
                assert_eq!(data["data"]["n"], n);
                break;
            }
        }
        // The first append also opens the stream's first wait.
        if n > 0 {
            gaps.push(appended.elapsed());
        }
    }
    gaps.sort();
    gaps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_client_sees_this_process_commits_without_a_poll() {
    let server = ApiServer::helpdesk(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    let gaps = gaps(&server, server.deployment.store.clone()).await;
    let median = gaps[gaps.len() / 2];
    eprintln!("in-process: median {median:?}, max {:?}", gaps.last());
    assert!(median < PUSHED_MEDIAN, "{gaps:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_client_sees_another_writers_commits_without_a_poll() {
    let server = ApiServer::helpdesk(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    // Its own writer connection and watch: what another process has.
    let other: Arc<dyn FlowStore> = Arc::new(
        SqliteStore::open(server.dir.path().join("store.sqlite"), Default::default()).unwrap(),
    );
    let gaps = gaps(&server, other).await;
    let median = gaps[gaps.len() / 2];
    eprintln!("another writer: median {median:?}, max {:?}", gaps.last());
    assert!(median < PUSHED_MEDIAN, "{gaps:?}");
}
