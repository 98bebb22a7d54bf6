//! PostgreSQL restarted under a running deployment: `dexa serve` answers
//! `503 store_unavailable` while it is down, the worker and the server
//! reconnect by themselves when it is back, and the session loses nothing.
//! The test runs its own cluster (`scripts/test-postgres.sh`), since
//! stopping the shared one would stop every other test's store.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dexa::session::{MessageRole, ToolEffect};
use dexa_tests::api_server::TEST_TOKEN;
use dexa_tests::kit::{
    dexa_binary, render_config, wait_for_turns, AgentTestStack, KitAgent, KitSettings,
};
use dexa_tests::pg_cluster::Cluster;
use dexa_tests::serve_process::{request, until_ok};
use dexa_tests::session::{last_text, texts_of};
use serde_json::json;

/// `dexa serve --no-worker` on the stack's config; killed when dropped.
struct Serve {
    child: std::process::Child,
    address: SocketAddr,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn serve(stack: &AgentTestStack) -> Serve {
    let log: PathBuf = stack.dir.path().join("serve.log");
    let out = std::fs::File::create(&log).unwrap_or_else(|err| panic!("{err}"));
    let child = Command::new(dexa_binary())
        .args([
            "serve",
            "--no-worker",
            "--listen",
            "127.0.0.1:0",
            "--config",
        ])
        .arg(&stack.config_path)
        .env("DEXA_API_TOKEN", TEST_TOKEN)
        .env("RUST_LOG", "warn,dexa::cli::serve=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|err| panic!("dexa serve: {err}"));
    // Owned at once, so that a panic below still kills and reaps it.
    let mut server = Serve {
        child,
        address: SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let started = Instant::now();
    loop {
        let printed = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(address) = printed
            .split("dexa serve: http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|address| address.parse().ok())
        {
            server.address = address;
            return server;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "dexa serve did not listen: {printed}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_turn_answers_503_meanwhile_and_loses_nothing() {
    let cluster = Cluster::start();
    let address = format!("{}?schema=restart", cluster.url);
    let agent = KitAgent::scripted(
        "Outage",
        json!({"turns": [
            {"steps": [
                {"tool_calls": [{"id": "g", "name": "gate", "arguments": {"name": "g"}}]},
                {"text": "one"}
            ]},
            {"steps": [{"text": "two"}]}
        ]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::Read, None);
    // A lease longer than the outage: the Step that waits at the gate keeps
    // it, and nothing has to run again.
    let settings = KitSettings {
        lease: Duration::from_secs(30),
        ..KitSettings::default()
    };
    let mut stack = AgentTestStack::with_config(|_| {
        render_config(&[agent], &settings).replace(
            "store = \"sqlite:store.sqlite\"",
            &format!("store = {address:?}"),
        )
    });
    stack.start_worker();
    let server = serve(&stack).await;
    let sessions = stack.sessions("Outage");
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("g").wait_until_reached().await;
    let path = "/v1/sessions/s1";
    let before = request(
        server.address,
        path,
        Some(TEST_TOKEN),
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(before.status, 200, "{}", before.body);

    cluster.pause();
    let down = request(
        server.address,
        path,
        Some(TEST_TOKEN),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(down.status, 503, "{}", down.body);
    assert!(down.body.contains("store_unavailable"), "{}", down.body);

    cluster.resume();
    until_ok(
        server.address,
        path,
        Some(TEST_TOKEN),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|err| panic!("dexa serve did not come back: {err}"));
    stack.gate("g").release();
    wait_for_turns(&sessions, "s1", 1).await;
    assert!(sessions.send_user_message("s1", "again").await.unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(
        texts_of(&snapshot, MessageRole::User),
        vec!["go".to_string(), "again".to_string()],
        "no message lost or repeated"
    );
    assert_eq!(last_text(&snapshot).as_deref(), Some("two"));
    assert_eq!(
        texts_of(&snapshot, MessageRole::Assistant)
            .iter()
            .filter(|t| *t == "one")
            .count(),
        1
    );
    assert_eq!(
        stack.invocations().count("g"),
        1,
        "the tool ran once through the outage"
    );
}
