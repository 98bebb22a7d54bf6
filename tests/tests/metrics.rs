//! Metrics: after real sessions, `/metrics` on `dexa serve`'s router and on
//! a `dexa worker --metrics-listen` process parses as Prometheus text, and
//! its Step counters equal what the Step history recorded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dexa::api::{router, ApiState};
use dexa::config::{Deployment, DexaConfig};
use dexa::flow::{history, StepHistoryEntry};
use dexa::telemetry;
use dexa_tests::api_server::{helpdesk_config, TEST_TOKEN};
use dexa_tests::kit::{wait_for_turns, AgentTestStack, KitAgent};
use futures_util::StreamExt;
use serde_json::json;

/// One sample of the exposition: its name, labels and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format, refusing any line it does not know:
/// `# HELP`/`# TYPE` comments and `name{label="value",...} number` samples.
fn parse(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if line.starts_with("# TYPE ") || line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("not a sample: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|err| panic!("{value:?} is not a number ({err}) in {line:?}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let inner = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels in {line:?}"));
                let labels = inner
                    .split(',')
                    .filter(|pair| !pair.is_empty())
                    .map(|pair| {
                        let (key, quoted) = pair
                            .split_once('=')
                            .unwrap_or_else(|| panic!("bad label {pair:?} in {line:?}"));
                        let unquoted = quoted
                            .strip_prefix('"')
                            .and_then(|q| q.strip_suffix('"'))
                            .unwrap_or_else(|| panic!("unquoted label {pair:?} in {line:?}"));
                        (key.to_string(), unquoted.to_string())
                    })
                    .collect();
                (name.to_string(), labels)
            }
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line:?}"
        );
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    samples
}

/// The value of `name` with exactly these labels among its own.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// Committed Steps by type, from the Step history.
fn completed_by_step(history: &[StepHistoryEntry]) -> BTreeMap<String, f64> {
    let mut counts = BTreeMap::new();
    for entry in history
        .iter()
        .filter(|e| e.event_type == history::EXECUTE_COMPLETED)
    {
        *counts.entry(entry.step_type.clone()).or_insert(0.0) += 1.0;
    }
    counts
}

/// Whether every committed count of the history shows in the metrics (the
/// counters are bumped right after each commit, so a scrape may trail the
/// last one by a moment).
fn caught_up(samples: &[Sample], flow_type: &str, history: &[StepHistoryEntry]) -> bool {
    completed_by_step(history).iter().all(|(step, count)| {
        value(
            samples,
            telemetry::STEPS_COMPLETED,
            &[("flow_type", flow_type), ("step", step.as_str())],
        ) == Some(*count)
    })
}

/// Each Step type's committed count in the metrics equals the history's.
fn assert_counts_match(samples: &[Sample], flow_type: &str, history: &[StepHistoryEntry]) {
    let expected = completed_by_step(history);
    assert!(!expected.is_empty(), "no Step committed: {history:?}");
    for (step, count) in &expected {
        let labels = [("flow_type", flow_type), ("step", step.as_str())];
        assert_eq!(
            value(samples, telemetry::STEPS_COMPLETED, &labels),
            Some(*count),
            "{step} committed"
        );
        let started = value(samples, telemetry::STEPS_STARTED, &labels).unwrap_or_default();
        assert!(started >= *count, "{step}: started {started} < {count}");
        assert_eq!(value(samples, telemetry::STEPS_FAILED, &labels), None);
        let timed = value(
            samples,
            &format!("{}_count", telemetry::STEP_CLAIM_TO_COMMIT),
            &[("step", step.as_str())],
        );
        assert_eq!(timed, Some(*count), "{step}'s claim-to-commit samples");
        let attempts = value(
            samples,
            &format!("{}_count", telemetry::STEP_ATTEMPT),
            &[("step", step.as_str()), ("outcome", "committed")],
        );
        assert_eq!(attempts, Some(*count), "{step}'s committed attempts");
    }
    assert_eq!(value(samples, telemetry::STORE_AVAILABLE, &[]), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_metrics_need_the_token_and_count_what_the_step_history_records() {
    let handle = telemetry::install_prometheus().unwrap_or_else(|err| panic!("{err:#}"));
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"turns": [
        {"steps": [{"text": "one"}]},
        {"steps": [{"text": "two"}]}
    ]});
    let config = DexaConfig::load(helpdesk_config(dir.path(), &script)).unwrap();
    let deployment = Arc::new(Deployment::for_workers(config, &|_| {}).await.unwrap());
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let app = router(
        ApiState::new(deployment.clone(), Some(Arc::new(TEST_TOKEN.to_string())))
            .with_metrics(handle),
    );
    let base = dexa_tests::api_server::serve_on_loopback(app).await;
    let sessions = deployment.sessions("Helpdesk").unwrap();
    sessions.start_session("m1", "hello").await.unwrap();
    wait_for_turns(&sessions, "m1", 1).await;
    sessions.send_user_message("m1", "again").await.unwrap();
    wait_for_turns(&sessions, "m1", 2).await;

    let http = reqwest::Client::new();
    let anonymous = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let history = deployment.store.step_history("m1").await.unwrap();
    let samples = dexa_tests::kit::wait_until("the metrics", Duration::from_secs(10), || {
        let (http, base, history) = (http.clone(), base.clone(), history.clone());
        async move {
            let response = http
                .get(format!("{base}/metrics"))
                .bearer_auth(TEST_TOKEN)
                .send()
                .await
                .ok()?;
            assert_eq!(response.status(), 200);
            assert!(response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|t| t.starts_with("text/plain; version=0.0.4")));
            let samples = parse(&response.text().await.ok()?);
            caught_up(&samples, "Helpdesk", &history).then_some(samples)
        }
    })
    .await;
    assert_counts_match(&samples, "Helpdesk", &history);

    // The queue: the idle session's one task waits for its next message.
    let queue = |samples: &[Sample], state: &str| {
        value(samples, telemetry::QUEUE_TASKS, &[("state", state)])
    };
    assert_eq!(queue(&samples, "waiting"), Some(1.0));
    assert_eq!(queue(&samples, "ready"), Some(0.0));
    assert_eq!(queue(&samples, "leased"), Some(0.0));
    // SQLite's group commits: every committed Step wrote in one.
    let commits = value(
        &samples,
        &format!("{}_count", telemetry::SQLITE_BATCH_COMMIT),
        &[],
    )
    .unwrap_or_default();
    let writes = value(
        &samples,
        &format!("{}_sum", telemetry::SQLITE_BATCH_WRITES),
        &[],
    )
    .unwrap_or_default();
    let committed: f64 = completed_by_step(&history).values().sum();
    assert!(
        commits >= 1.0 && writes >= committed,
        "{commits} commits of {writes} writes"
    );
    // Guest calls by the runner's digest, the sha256 of its file.
    let runner = std::fs::read(dexa_tests::guest_wasm("scripted-runner")).unwrap();
    let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&runner));
    let timed = value(
        &samples,
        &format!("{}_count", telemetry::GUEST_CALL_DURATION),
        &[
            ("component", "runner"),
            ("digest", digest.as_str()),
            ("export", "run-model-step"),
        ],
    );
    assert_eq!(timed, completed_by_step(&history).get("RunModel").copied());

    // The event stream: the bytes of what a client was sent.
    let before = value(&samples, telemetry::EVENT_STREAM_BYTES, &[]).unwrap_or_default();
    let response = http
        .get(format!("{base}/v1/sessions/m1/events"))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    let mut sent = String::new();
    // Both turns' events are stored: read until the second turn's end.
    while sent.matches("event: turn_completed").count() < 2 {
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("events within 10 s")
            .expect("the stream stays open")
            .unwrap();
        sent.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(stream);
    let data: usize = sent
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(str::len)
        .sum();
    let text = http
        .get(format!("{base}/metrics"))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let after = value(&parse(&text), telemetry::EVENT_STREAM_BYTES, &[]).unwrap_or_default();
    assert!(
        after - before >= data as f64 && data > 0,
        "{before} -> {after} after {data} bytes of data"
    );
    worker.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_serves_its_metrics_at_metrics_listen() {
    let agent = KitAgent::scripted(
        "Counted",
        json!({"turns": [{"steps": [
            {"tool_calls": [{"id": "l", "name": "log", "arguments": {"name": "counted"}}]},
            {"text": "logged"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("log", dexa::session::ToolEffect::Read, None);
    let mut stack = AgentTestStack::new(vec![agent]);
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let address = format!("127.0.0.1:{port}");
    stack.start_worker_with(&["--metrics-listen", &address]);
    let sessions = stack.sessions("Counted");
    sessions.start_session("w1", "go").await.unwrap();
    wait_for_turns(&sessions, "w1", 1).await;
    let history = stack.read_step_history("w1").await;
    let http = reqwest::Client::new();
    let samples =
        dexa_tests::kit::wait_until("the worker's metrics", Duration::from_secs(10), || {
            let (http, address, history) = (http.clone(), address.clone(), history.clone());
            async move {
                let text = http
                    .get(format!("http://{address}/metrics"))
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                let samples = parse(&text);
                caught_up(&samples, "Counted", &history).then_some(samples)
            }
        })
        .await;
    assert_counts_match(&samples, "Counted", &history);
    // Loaded, and the store takes its claims.
    let ready = http
        .get(format!("http://{address}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(
        value(&samples, telemetry::QUEUE_TASKS, &[("state", "waiting")]),
        Some(1.0)
    );
    // The tool's one call (besides its list-tools at load), and the
    // runner's calls (one per RunModel).
    let calls = |component: &str, export: &str| -> f64 {
        samples
            .iter()
            .filter(|s| s.name == telemetry::GUEST_CALLS)
            .filter(|s| s.labels.get("component").map(String::as_str) == Some(component))
            .filter(|s| s.labels.get("export").map(String::as_str) == Some(export))
            .map(|s| {
                assert_eq!(s.labels["outcome"], "ok", "{s:?}");
                s.value
            })
            .sum()
    };
    assert_eq!(calls("gate-tool", "call"), 1.0);
    let run_models = completed_by_step(&history)
        .get("RunModel")
        .copied()
        .unwrap_or_default();
    assert_eq!(calls("Counted-runner", "run-model-step"), run_models);
    assert!(samples
        .iter()
        .any(|s| s.name == format!("{}_count", telemetry::GUEST_CALL_DURATION)));
    assert_eq!(
        value(
            &samples,
            telemetry::STEPS_COMPLETED,
            &[("flow_type", "Counted"), ("step", "CallTool")]
        ),
        Some(1.0)
    );
}
