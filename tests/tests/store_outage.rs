//! A store that stops taking writes (a full disk) costs the worker little:
//! it backs off, logs the outage once when it begins and once when it ends,
//! and finishes every acknowledged session by itself when the store is back.
//!
//! The stand-in for the full disk is the SQLite handle's test fault, which
//! fails every write of the worker's handle with SQLite's own "database or
//! disk is full" while reads keep working, as they do on a full disk. The
//! sessions' client writes through another handle, so a message is
//! acknowledged during the outage, as `dexa serve` on a healthy API
//! connection would.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dexa::api::{router, ApiState};
use dexa::config::{Deployment, DexaConfig};
use dexa::flow::{FlowClient, StoreHealth, Worker, WorkerOptions};
use dexa::session::AgentSessionClient;
use dexa::store::sqlite::SqliteStore;
use dexa_tests::api_server::helpdesk_config;
use dexa_tests::session::{wait_for_turns_within, AgentSpec, SessionStack};
use serde_json::json;
use tracing_subscriber::fmt::MakeWriter;

/// Every log line of this test binary; a test reads the lines of its own
/// worker (each line names its worker).
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Lines {
    fn text(&self) -> String {
        let bytes = self.0.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The WARN lines of `worker` so far.
    fn warnings(&self, worker: &str) -> Vec<String> {
        self.of(worker)
            .into_iter()
            .filter(|l| l.contains("WARN"))
            .collect()
    }

    /// The lines of `worker` so far.
    fn of(&self, worker: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(worker))
            .map(str::to_string)
            .collect()
    }
}

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut all) = self.0.lock() {
            all.extend_from_slice(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Lines {
    type Writer = Lines;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// The worker of the first test, named in its log lines.
const WORKER: &str = "outage-worker";

/// The log of this test binary, from the first call on.
fn logged() -> Lines {
    static LINES: std::sync::OnceLock<Lines> = std::sync::OnceLock::new();
    LINES
        .get_or_init(|| {
            let lines = Lines::default();
            tracing_subscriber::fmt()
                .with_writer(lines.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .init();
            lines
        })
        .clone()
}

/// How long the store refuses writes.
const OUTAGE: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_logged_once_backed_off_and_survived_with_nothing_lost() {
    let lines = logged();

    let stack = SessionStack::new(vec![AgentSpec::scripted("Outage")]).await;
    // The worker's own handle on the stack's store, which the disk "fills"
    // under.
    let worker_store = SqliteStore::open(stack.dir.path().join("store.sqlite"), Default::default())
        .unwrap_or_else(|err| panic!("open the worker's handle: {err}"));
    worker_store.refuse_writes_for_test(true);
    let health = StoreHealth::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::new(
        Arc::new(worker_store.clone()),
        stack.registry.clone(),
        WorkerOptions {
            worker_id: WORKER.to_string(),
            poll_interval: Duration::from_millis(50),
            store_health: health.clone(),
            ..WorkerOptions::default()
        },
    );
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));

    // Acknowledged while the worker's store refuses every write: it must be
    // answered once the store is back.
    let sessions = stack.sessions("Outage");
    let script = json!({"steps": [{"text": "answered after the outage"}]}).to_string();
    sessions
        .start_session("during", &script)
        .await
        .unwrap_or_else(|err| panic!("start a session: {err}"));
    tokio::time::sleep(OUTAGE).await;

    let refused = worker_store.refused_writes_for_test();
    let warnings = lines.warnings(WORKER);
    // With a back-off doubling from 50 ms to 2 s (each spread over its upper
    // half), 4 s of outage take at most a dozen tries; retrying at each
    // wake-up took 1,797.
    assert!(
        (1..=15).contains(&refused),
        "{refused} writes were tried in a {OUTAGE:?} outage"
    );
    assert_eq!(
        warnings.len(),
        1,
        "the outage is logged once when it begins: {warnings:#?}"
    );
    assert!(
        warnings[0].contains("store unavailable") && warnings[0].contains("disk is full"),
        "{warnings:#?}"
    );
    assert!(!health.available(), "the worker's health shows the outage");
    assert!(health.unavailable_since_ms().is_some());

    worker_store.refuse_writes_for_test(false);
    let snapshot = wait_for_turns_within(&sessions, "during", 1, Duration::from_secs(30)).await;
    assert_eq!(
        dexa_tests::session::last_text(&snapshot).as_deref(),
        Some("answered after the outage")
    );
    assert!(
        health.available(),
        "the worker's health shows the store back"
    );
    assert_eq!(health.outages(), 1);
    let text = lines.of(WORKER).join("\n");
    assert_eq!(
        text.matches("store back after").count(),
        1,
        "the end of the outage is logged once: {text}"
    );
    assert_eq!(lines.warnings(WORKER).len(), 1, "{text}");

    let _ = stop.send(());
    let _ = running.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_with_retry_after_while_the_store_refuses_the_worker_and_200_after() {
    let _ = logged();
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
    let script = json!({"turns": [{"steps": [{"text": "ready again"}]}]});
    let path = helpdesk_config(dir.path(), &script);
    let config = DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}"));
    let mut deployment = Deployment::for_workers(config, &|_| {})
        .await
        .unwrap_or_else(|err| panic!("deployment: {err:#}"));
    // The deployment's (and so its worker's) handle is the one whose disk
    // fills; the client below writes through another.
    let full = SqliteStore::open(dir.path().join("store.sqlite"), Default::default())
        .unwrap_or_else(|err| panic!("open: {err}"));
    deployment.store = Arc::new(full.clone());
    let deployment = Arc::new(deployment);
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let app = router(ApiState::new(deployment.clone(), None));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|err| panic!("bind: {err}"));
    let base = format!(
        "http://{}",
        listener
            .local_addr()
            .unwrap_or_else(|err| panic!("address: {err}"))
    );
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let http = reqwest::Client::new();
    let ready = || async {
        let response = http
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap_or_else(|err| panic!("GET /readyz: {err}"));
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        (status, retry_after, body)
    };
    assert_eq!(ready().await.0, 200, "a fresh deployment is ready");

    full.refuse_writes_for_test(true);
    let other = SqliteStore::open(dir.path().join("store.sqlite"), Default::default())
        .unwrap_or_else(|err| panic!("open: {err}"));
    let sessions = AgentSessionClient::new(
        FlowClient::new(Arc::new(other), deployment.registry.clone()),
        "Helpdesk",
    );
    sessions
        .start_session("waits", "hello")
        .await
        .unwrap_or_else(|err| panic!("start a session: {err}"));
    let (status, retry_after, body) = dexa_tests::toy::wait_until(
        "readyz to say the store is unavailable",
        Duration::from_secs(10),
        || async {
            let answer = ready().await;
            (answer.0 == 503).then_some(answer)
        },
    )
    .await;
    assert_eq!(status, 503);
    assert_eq!(retry_after.as_deref(), Some("2"));
    assert_eq!(body["error"]["code"], json!("store_unavailable"), "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("since")),
        "{body}"
    );

    full.refuse_writes_for_test(false);
    let snapshot = wait_for_turns_within(&sessions, "waits", 1, Duration::from_secs(30)).await;
    assert_eq!(
        dexa_tests::session::last_text(&snapshot).as_deref(),
        Some("ready again")
    );
    assert_eq!(
        ready().await.0,
        200,
        "ready once the store takes the claims"
    );
    server.abort();
    worker.abort();
}
