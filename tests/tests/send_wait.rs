//! Send and wait: `POST /v1/sessions/{id}/messages?wait=SECONDS` and `dexa
//! session send --wait` answer with the turn the message starts, over real
//! HTTP on loopback and from a CLI process whose worker is another process.

use std::process::Stdio;
use std::time::Duration;

use dexa_tests::api_server::{helpdesk_config, ApiServer, TEST_TOKEN};
use dexa_tests::kit::{dexa_binary, dexa_session};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::process::Command;

struct Served {
    http: reqwest::Client,
    server: ApiServer,
}

impl Served {
    async fn new(script: Value) -> Self {
        Self {
            http: reqwest::Client::new(),
            server: ApiServer::helpdesk(script).await,
        }
    }

    async fn start(&self, id: &str) {
        let response = self
            .http
            .post(format!("{}/v1/agents/Helpdesk/sessions", self.server.base))
            .bearer_auth(TEST_TOKEN)
            .json(&json!({ "session_id": id }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
    }

    fn send_request(&self, id: &str, text: &str, query: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!(
                "{}/v1/sessions/{id}/messages{query}",
                self.server.base
            ))
            .bearer_auth(TEST_TOKEN)
            .json(&json!({ "text": text }))
    }

    async fn send(&self, id: &str, text: &str, query: &str) -> (StatusCode, Value) {
        let response = self.send_request(id, text, query).send().await.unwrap();
        let status = response.status();
        (status, response.json().await.unwrap())
    }

    async fn snapshot(&self, id: &str) -> Value {
        self.http
            .get(format!("{}/v1/sessions/{id}", self.server.base))
            .bearer_auth(TEST_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn idle_after(&self, id: &str, turns: u64) -> Value {
        for _ in 0..2000 {
            let snapshot = self.snapshot(id).await;
            if snapshot["state"]["turn_count"].as_u64() >= Some(turns)
                && snapshot["state"]["active_turn_id"].is_null()
                && snapshot["queued_message_count"] == 0
            {
                return snapshot;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("session {id} never ran {turns} turns");
    }
}

fn texts(messages: &Value) -> Vec<(String, String)> {
    messages
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap_or_default().to_string(),
                m["text"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_waits_gets_its_own_turns_new_messages_and_usage() {
    let served = Served::new(json!({"turns": [
        {"steps": [{"text": "first", "usage": {"input": 10, "output": 5}}]},
        {"steps": [{"text": "second", "sleep_ms": 400}]},
        {"steps": [{"text": "third", "usage": {"input": 3, "output": 4}}]}
    ]}))
    .await;
    served.start("s1").await;
    let (status, answer) = served.send("s1", "hi", "?wait=30").await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["status"], "completed", "{answer}");
    assert_eq!(answer["turn_id"], "turn-1");
    assert!(answer["message_id"]
        .as_str()
        .is_some_and(|id| !id.is_empty()));
    assert_eq!(
        texts(&answer["messages"]),
        vec![("assistant".to_string(), "first".to_string())]
    );
    assert_eq!(answer["usage"]["input_tokens"], 10, "{answer}");
    assert_eq!(answer["usage"]["output_tokens"], 5, "{answer}");

    // A message queued behind a running turn waits for its own turn, not
    // for the one running when it was sent.
    let (status, queued) = served.send("s1", "slow one", "").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{queued}");
    let (status, answer) = served.send("s1", "after it", "?wait=30").await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["turn_id"], "turn-3", "{answer}");
    assert_eq!(
        texts(&answer["messages"]),
        vec![("assistant".to_string(), "third".to_string())]
    );
    assert_eq!(answer["usage"]["total_tokens"], 7, "{answer}");
    assert_ne!(answer["message_id"], queued["message_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_waits_answers_202_when_its_turn_needs_an_approval_or_the_wait_runs_out() {
    let served = Served::new(json!({"turns": [
        {"steps": [
            {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
            {"text": "paid"}
        ]},
        {"steps": [{"text": "slowly", "sleep_ms": 1500}]}
    ]}))
    .await;
    served.start("s1").await;
    let (status, answer) = served.send("s1", "pay", "?wait=30").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer["status"], "waiting_for_approval", "{answer}");
    assert_eq!(answer["turn_id"], "turn-1");
    assert_eq!(answer["interrupts"][0]["interrupt_id"], "turn-1/pay");
    let response = served
        .http
        .post(format!("{}/v1/sessions/s1/interrupts", served.server.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"interrupt_id": "turn-1/pay", "approved": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    served.idle_after("s1", 1).await;

    // The wait runs out while the model is still thinking.
    let (status, answer) = served.send("s1", "think", "?wait=0.3").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_eq!(answer["status"], "running", "{answer}");
    assert_eq!(answer["turn_id"], "turn-2", "{answer}");
    let snapshot = served.idle_after("s1", 2).await;
    assert_eq!(snapshot["state"]["last_turn_error"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_waiting_leaves_the_turn_running_and_a_retry_gets_its_answer() {
    let served = Served::new(json!({"turns": [
        {"steps": [{"text": "done at last", "sleep_ms": 1500}]}
    ]}))
    .await;
    served.start("s1").await;
    // The client gives up (a timeout, a closed tab) while the turn runs.
    let gave_up = served
        .send_request("s1", "take your time", "?wait=60")
        .header("Idempotency-Key", "k1")
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        gave_up.as_ref().is_err_and(|err| err.is_timeout()),
        "{gave_up:?}"
    );
    // Its retry, with the same key, queues nothing and waits for the first
    // send's turn, which went on without the client.
    let response = served
        .send_request("s1", "take your time", "?wait=30")
        .header("Idempotency-Key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["replayed"], true, "{answer}");
    assert_eq!(answer["status"], "completed", "{answer}");
    assert_eq!(
        texts(&answer["messages"]),
        vec![("assistant".to_string(), "done at last".to_string())]
    );
    let snapshot = served.idle_after("s1", 1).await;
    assert_eq!(
        snapshot["state"]["turn_count"], 1,
        "one turn ran: {snapshot}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_wait_is_a_typed_400_and_queues_nothing() {
    let served = Served::new(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    served.start("s1").await;
    for query in [
        "?wait=abc",
        "?wait=-1",
        "?wait=301",
        "?wait=NaN",
        "?wait=inf",
    ] {
        let (status, answer) = served.send("s1", "hi", query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {answer}");
        assert_eq!(answer["error"]["code"], "bad_request", "{query}: {answer}");
    }
    let snapshot = served.idle_after("s1", 0).await;
    assert_eq!(snapshot["queued_message_count"], 0, "{snapshot}");
    assert_eq!(snapshot["state"]["turn_count"], 0, "{snapshot}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_session_send_wait_prints_the_turn_a_worker_in_another_process_ran() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [
            {"steps": [{"text": "hello from the worker"}]},
            {"steps": [
                {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
                {"text": "paid"}
            ]}
        ]}),
    );
    let mut worker = Command::new(dexa_binary())
        .args(["worker", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (code, _, err) = dexa_session(&config, &["start", "Helpdesk", "--id", "s1"]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = dexa_session(&config, &["send", "s1", "hi", "--wait", "60"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), "assistant: hello from the worker");
    let (code, out, err) =
        dexa_session(&config, &["send", "s1", "pay", "--wait", "60", "--json"]).await;
    assert_eq!(
        code,
        Some(2),
        "an approval is not the turn's end: {out} {err}"
    );
    let answer: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(answer["status"], "waiting_for_approval", "{answer}");
    assert_eq!(answer["interrupts"][0]["interrupt_id"], "turn-2/pay");
    let (code, out, err) = dexa_session(&config, &["cancel", "s1"]).await;
    assert_eq!((code, out.trim()), (Some(0), "cancelled turn-2"), "{err}");
    let mut idle = false;
    for _ in 0..500 {
        let (_, out, _) = dexa_session(&config, &["cancel", "s1"]).await;
        if out.trim() == "no turn is running" {
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(idle, "the cancelled turn ended");
    let _ = worker.kill().await;
}

/// A stop appends nothing: the waiter learns of it from the session's
/// status once the stop wakes it, and answers then, not when its wait runs
/// out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_ends_when_its_session_is_stopped_before_the_turn_ends() {
    let served = Served::new(json!({"turns": [
        {"steps": [{"text": "late", "sleep_ms": 30000}]}
    ]}))
    .await;
    served.start("s1").await;
    let waiting = tokio::spawn(
        served
            .send_request("s1", "think", "?wait=25")
            .header("Idempotency-Key", "k1")
            .send(),
    );
    let mut running = false;
    for _ in 0..500 {
        if served.snapshot("s1").await["state"]["active_turn_id"] == "turn-1" {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(running, "the turn started");
    let stopped: Value = served
        .http
        .post(format!("{}/v1/sessions/s1/stop", served.server.base))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stopped, json!({"stopped": true}));
    let waited = waiting.await.unwrap().unwrap();
    assert_eq!(waited.status(), StatusCode::OK);
    let waited: Value = waited.json().await.unwrap();
    assert_eq!(waited["status"], "session_ended", "{waited}");
    assert_eq!(waited["session_status"], "stopped", "{waited}");
    assert_eq!(waited["turn_id"], "turn-1", "{waited}");
    // A retry after the stop finds the turn's events, not nothing, and no
    // stop's wake during its wait: it looks at the status all the same.
    let retry = served
        .send_request("s1", "think", "?wait=1")
        .header("Idempotency-Key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    let retry: Value = retry.json().await.unwrap();
    assert_eq!(retry["replayed"], true, "{retry}");
    assert_eq!(retry["status"], "session_ended", "{retry}");
}

/// A stopped session keeps its pending approvals, but nobody can answer
/// them: a wait (here a retry's, which reads the turn's `interrupt_raised`
/// after the stop) answers session_ended, not waiting_for_approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_on_an_approval_of_a_stopped_session_answers_session_ended() {
    let served = Served::new(json!({"turns": [{"steps": [
        {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
        {"text": "paid"}
    ]}]}))
    .await;
    served.start("s1").await;
    let send = || {
        served
            .send_request("s1", "pay", "?wait=20")
            .header("Idempotency-Key", "k1")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["status"], "waiting_for_approval", "{first}");
    let stopped: Value = served
        .http
        .post(format!("{}/v1/sessions/s1/stop", served.server.base))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stopped, json!({"stopped": true}));
    let retry = send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    let retry: Value = retry.json().await.unwrap();
    assert_eq!(retry["replayed"], true, "{retry}");
    assert_eq!(retry["status"], "session_ended", "{retry}");
    assert_eq!(retry["session_status"], "stopped", "{retry}");
    assert_eq!(retry["turn_id"], "turn-1", "{retry}");
}

/// The same with the stop made by another process (`dexa session stop`),
/// the wait by a third (`dexa session send --wait`) and the turn on a
/// worker of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_session_send_wait_ends_when_another_process_stops_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [{"steps": [{"text": "late", "sleep_ms": 30000}]}]}),
    );
    let mut worker = Command::new(dexa_binary())
        .args(["worker", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (code, _, err) = dexa_session(&config, &["start", "Helpdesk", "--id", "s1"]).await;
    assert_eq!(code, Some(0), "{err}");
    let waiting = {
        let config = config.clone();
        tokio::spawn(async move {
            dexa_session(&config, &["send", "s1", "think", "--wait", "60", "--json"]).await
        })
    };
    let mut running = false;
    for _ in 0..600 {
        let (_, shown, _) = dexa_session(&config, &["show", "s1", "--json"]).await;
        let shown: Value = serde_json::from_str(&shown).unwrap_or(Value::Null);
        if shown["state"]["active_turn_id"] == "turn-1" {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(running, "the turn started");
    let (code, _, err) = dexa_session(&config, &["stop", "s1"]).await;
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = waiting.await.unwrap();
    assert_eq!(code, Some(1), "{out} {err}");
    let answer: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(answer["status"], "session_ended", "{answer}");
    assert_eq!(answer["session_status"], "stopped", "{answer}");
    let _ = worker.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_cancelled_and_steered_over_http() {
    let served = Served::new(json!({"turns": [
        {"steps": [{"text": "late", "sleep_ms": 30000}]},
        {"steps": [{"text": "late again", "sleep_ms": 30000}]},
        {"steps": [{"text": "steered"}]}
    ]}))
    .await;
    served.start("s1").await;
    // A sender waiting on its turn learns that it was cancelled.
    let waiting = tokio::spawn(served.send_request("s1", "think", "?wait=30").send());
    let cancel = |served: &Served| {
        served
            .http
            .post(format!("{}/v1/sessions/s1/turn/cancel", served.server.base))
            .bearer_auth(TEST_TOKEN)
            .send()
    };
    let mut cancelled = Value::Null;
    for _ in 0..500 {
        cancelled = cancel(&served).await.unwrap().json().await.unwrap();
        if cancelled["cancelled"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cancelled, json!({"cancelled": true, "turn_id": "turn-1"}));
    let waited = waiting.await.unwrap().unwrap();
    assert_eq!(waited.status(), StatusCode::OK);
    let waited: Value = waited.json().await.unwrap();
    assert_eq!(waited["status"], "cancelled", "{waited}");
    assert_eq!(waited["turn_id"], "turn-1");
    let snapshot = served.idle_after("s1", 1).await;
    assert_eq!(snapshot["state"]["last_turn_error"], Value::Null);
    let nothing: Value = cancel(&served).await.unwrap().json().await.unwrap();
    assert_eq!(nothing, json!({"cancelled": false}));

    // Steer: a slow turn runs; "instead" stops it and starts the next.
    let (status, _) = served.send("s1", "slow", "").await;
    assert_eq!(status, StatusCode::ACCEPTED);
    for _ in 0..500 {
        if served.snapshot("s1").await["state"]["active_turn_id"] == "turn-2" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A cancel that names the turn it meant, sent late, leaves this one.
    let late: Value = served
        .http
        .post(format!(
            "{}/v1/sessions/s1/turn/cancel?turn_id=turn-1",
            served.server.base
        ))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        late,
        json!({"cancelled": false, "running_turn_id": "turn-2"})
    );
    // An empty turn_id names no turn: a typed 400, nothing cancelled.
    let empty = served
        .http
        .post(format!(
            "{}/v1/sessions/s1/turn/cancel?turn_id=",
            served.server.base
        ))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
    let empty: Value = empty.json().await.unwrap();
    assert_eq!(empty["error"]["code"], "bad_request", "{empty}");
    assert_eq!(
        served.snapshot("s1").await["state"]["active_turn_id"],
        "turn-2"
    );
    let response = served
        .http
        .post(format!(
            "{}/v1/sessions/s1/messages?wait=30",
            served.server.base
        ))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"text": "instead", "interrupt": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["interrupted"], "turn-2", "{answer}");
    assert_eq!(answer["turn_id"], "turn-3", "{answer}");
    assert_eq!(
        texts(&answer["messages"]),
        vec![("assistant".to_string(), "steered".to_string())]
    );
}
