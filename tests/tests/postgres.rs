//! What only the PostgreSQL backend has: a schema version that `dexa store
//! migrate` applies and that an older dexa refuses, and addresses whose
//! password never sits in them. The engine's and the sessions' behaviour on
//! PostgreSQL is checked by the same suites as SQLite's (`backends!` in
//! `flow_conformance`, `catalog_conformance`, `session` and `crash`).

use std::process::Command;
use std::time::{Duration, Instant};

use dexa::config::{Deployment, DexaConfig};
use dexa::session::{ResolveInterruptRequest, ToolEffect};
use dexa::store::postgres::schema::SCHEMA_VERSION;
use dexa::store::postgres::{PostgresStore, PostgresUrl};
use dexa_tests::kit::{
    dexa_binary, wait_for_agent_snapshot, wait_for_turns, AgentTestStack, KitAgent,
};
use dexa_tests::session::last_text;
use dexa_tests::toy::{postgres_address, test_postgres_url};
use serde_json::json;

/// A plain client on the test server, for what the store never does itself.
async fn raw_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&test_postgres_url(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|err| panic!("connect: {err}"));
    tokio::spawn(connection);
    client
}

fn schema_of(address: &str) -> String {
    address
        .rsplit_once("schema=")
        .map(|(_, schema)| schema.to_string())
        .unwrap_or_else(|| panic!("{address} names no schema"))
}

fn migrate(address: &str) -> (bool, String) {
    dexa(&["store", "migrate", address])
}

/// Runs `dexa ARGS`: (success, stdout and stderr).
fn dexa(args: &[&str]) -> (bool, String) {
    let output = Command::new(dexa_binary())
        .args(args)
        .output()
        .unwrap_or_else(|err| panic!("run dexa: {err}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_store_migrate_creates_the_schema_once_and_then_finds_it_current() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let address = postgres_address(dir.path());
    let (ok, first) = migrate(&address);
    assert!(ok, "{first}");
    assert!(
        first.contains(&format!("created schema {SCHEMA_VERSION}")),
        "{first}"
    );
    let (ok, again) = migrate(&address);
    assert!(ok, "{again}");
    assert!(again.contains("up to date"), "{again}");
    let version: i64 = raw_client()
        .await
        .query_one(
            &format!("SELECT version FROM {}.dexa_schema", schema_of(&address)),
            &[],
        )
        .await
        .unwrap_or_else(|err| panic!("{err}"))
        .get(0);
    assert_eq!(version, SCHEMA_VERSION);
    let url = PostgresUrl::parse(&address).unwrap_or_else(|err| panic!("{err}"));
    PostgresStore::connect(url)
        .await
        .unwrap_or_else(|err| panic!("a migrated store opens: {err}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_newer_than_this_dexa_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let address = postgres_address(dir.path());
    let url = PostgresUrl::parse(&address).unwrap_or_else(|err| panic!("{err}"));
    drop(
        PostgresStore::connect(url.clone())
            .await
            .unwrap_or_else(|err| panic!("{err}")),
    );
    raw_client()
        .await
        .execute(
            &format!(
                "UPDATE {}.dexa_schema SET version = 99",
                schema_of(&address)
            ),
            &[],
        )
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let refused = PostgresStore::connect(url)
        .await
        .map(|_| ())
        .map_err(|err| err.to_string());
    let expected = format!("schema 99, this one knows {SCHEMA_VERSION}");
    assert!(
        refused.as_ref().is_err_and(|err| err.contains(&expected)),
        "{refused:?}"
    );
    let (ok, text) = migrate(&address);
    assert!(
        !ok && text.contains(&expected),
        "migrate must refuse too: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_address_with_a_password_is_refused_and_the_password_comes_from_the_environment() {
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let address = postgres_address(dir.path());
    let with_password = address.replacen("://dexa@", "://dexa:hunter2@", 1);
    let (ok, text) = migrate(&with_password);
    assert!(!ok, "{text}");
    assert!(
        text.contains("does not belong in the store address"),
        "{text}"
    );
    assert!(
        !text.contains("hunter2"),
        "the refusal must not echo the password: {text}"
    );
    // The test server trusts loopback, so any password works: what counts
    // is that a named variable that is not set is an error, not a silent
    // connection without one.
    let (ok, text) = migrate(&format!("{address}&password_env=DEXA_TEST_UNSET_PASSWORD"));
    assert!(!ok, "{text}");
    assert!(
        text.contains("DEXA_TEST_UNSET_PASSWORD (password_env) is not set"),
        "{text}"
    );
}

/// A stopped SQLite deployment, copied with `dexa store copy`, carries on
/// on PostgreSQL: a session waiting for an approval and a session whose
/// tool was running when its worker died both finish there, the write
/// once. A second copy into the now non-empty target is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_deployment_copied_to_postgres_carries_on_its_open_sessions() {
    let approve = KitAgent::scripted(
        "Approve",
        json!({"turns": [{"steps": [
            {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
            {"text": "paid"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("log", ToolEffect::NonIdempotentWrite, None);
    let gated = KitAgent::scripted(
        "Gated",
        json!({"turns": [{"steps": [
            {"tool_calls": [{"id": "r", "name": "gate", "arguments": {"name": "r"}}]},
            {"text": "read it"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::Read, None);
    let mut stack = AgentTestStack::new(vec![approve, gated]);
    let worker = stack.start_worker();
    let on_sqlite = stack.sessions("Approve");
    on_sqlite.start_session("a", "pay it").await.unwrap();
    let interrupt = wait_for_agent_snapshot(&on_sqlite, "a", "the approval", |s| {
        s.pending_interrupts.first().cloned()
    })
    .await;
    stack
        .sessions("Gated")
        .start_session("b", "read")
        .await
        .unwrap();
    stack.gate("r").wait_until_reached().await;
    // The deployment stops, hard, mid-tool.
    stack.kill_worker(worker);

    let address = postgres_address(stack.dir.path());
    let sqlite = format!("sqlite:{}", stack.dir.path().join("store.sqlite").display());
    let (ok, text) = dexa(&["store", "copy", &sqlite, &address]);
    assert!(ok, "{text}");
    assert!(text.contains("every table's count matches"), "{text}");
    let (ok, again) = dexa(&["store", "copy", &sqlite, &address]);
    assert!(!ok, "a second copy must be refused: {again}");
    assert!(
        again.contains("not empty") && again.contains("--replace"),
        "{again}"
    );

    // The same deployment, now on PostgreSQL.
    let config = std::fs::read_to_string(&stack.config_path).unwrap();
    let moved = config.replace(
        "store = \"sqlite:store.sqlite\"",
        &format!("store = {address:?}"),
    );
    assert_ne!(config, moved, "the kit's config names its SQLite store");
    std::fs::write(&stack.config_path, moved).unwrap();
    let deployment = Deployment::for_clients(DexaConfig::load(&stack.config_path).unwrap())
        .await
        .unwrap_or_else(|err| panic!("{err:#}"));
    let approving = deployment.sessions("Approve").unwrap();
    let reading = deployment.sessions("Gated").unwrap();
    let waiting = approving.get_agent_snapshot("a").await.unwrap();
    assert_eq!(
        waiting.pending_interrupts.len(),
        1,
        "the approval moved with the session"
    );
    stack.gate("r").release();
    stack.start_worker();
    assert!(approving
        .resolve_interrupt(
            "a",
            ResolveInterruptRequest {
                interrupt_id: interrupt.interrupt_id.clone(),
                approved: true,
                rejection_message: None,
            },
        )
        .await
        .unwrap());
    let paid = wait_for_turns(&approving, "a", 1).await;
    assert_eq!(last_text(&paid).as_deref(), Some("paid"));
    let read = wait_for_turns(&reading, "b", 1).await;
    assert_eq!(last_text(&read).as_deref(), Some("read it"));
    assert_eq!(
        stack.invocations().keys("pay"),
        vec!["a/turn-1/pay"],
        "the approved write ran once, on PostgreSQL"
    );
    assert_eq!(
        stack.invocations().count("r"),
        2,
        "the read that died ran again"
    );
}

/// Two store handles stand for two machines. An append made through one
/// wakes a stream reader waiting on the other, through `LISTEN`/`NOTIFY`:
/// nothing on the reader's side reads the store in between, so no poll can
/// be what woke it. Likewise a commit that makes work ready wakes the other
/// side's workers, and a stop the other side's readers of the flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_one_machine_wakes_waiters_on_another_without_polling() {
    use dexa::flow::{FlowStore, NewTask, RetryPolicy};
    let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let address = postgres_address(dir.path());
    let open = || async {
        let url = PostgresUrl::parse(&address).unwrap_or_else(|err| panic!("{err}"));
        PostgresStore::connect(url)
            .await
            .unwrap_or_else(|err| panic!("{err}"))
    };
    let (machine_a, machine_b) = (open().await, open().await);
    // A store takes live appends only for a running flow; created before the
    // waits are armed, so that only the commits below can wake them.
    dexa_tests::toy::create_running_flow(&machine_a, "s").await;

    let signal = machine_b
        .stream_signal("s")
        .expect("PostgreSQL pushes stream appends");
    let appended = signal.notified();
    tokio::pin!(appended);
    appended.as_mut().enable();
    let work = machine_b.work_signal();
    let ready = work.notified();
    tokio::pin!(ready);
    ready.as_mut().enable();

    let started = Instant::now();
    machine_a
        .append_stream("s", "events", vec![json!({"n": 1})])
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    tokio::time::timeout(Duration::from_secs(5), appended)
        .await
        .expect("the reader on the other machine was woken");
    let stream_wake = started.elapsed();

    let started = Instant::now();
    machine_a
        .create_flow(
            "f",
            "Toy",
            NewTask {
                step_type: "Start".into(),
                input: json!({}),
                wait: None,
                policy: RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            },
        )
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    tokio::time::timeout(Duration::from_secs(5), ready)
        .await
        .expect("the workers on the other machine were woken");
    let work_wake = started.elapsed();

    // A stop appends nothing; the other machine's readers of the flow are
    // woken all the same (their streams and waits then end).
    let stopped = signal.notified();
    tokio::pin!(stopped);
    stopped.as_mut().enable();
    let started = Instant::now();
    assert!(machine_a
        .stop_flow("s")
        .await
        .unwrap_or_else(|err| panic!("{err}")));
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("the reader on the other machine was woken by the stop");
    let stop_wake = started.elapsed();
    eprintln!(
        "woken across machines: stream {stream_wake:?}, work {work_wake:?}, stop {stop_wake:?}"
    );
}

/// The benchmarks that compare backends and scale workers run end to end
/// (tiny sizes: the figures come from real runs, reported in the notes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_benchmarks_run_on_both_stores_and_with_worker_processes() {
    let server = test_postgres_url();
    let client = raw_client().await;
    let bench_schemas = || async {
        client
            .query_one(
                "SELECT COUNT(*) FROM pg_namespace WHERE nspname LIKE 'dexa_bench_%'",
                &[],
            )
            .await
            .unwrap_or_else(|err| panic!("{err}"))
            .get::<_, i64>(0)
    };
    let before = bench_schemas().await;
    let (ok, engine) = dexa(&[
        "bench", "engine", "--store", "sqlite", "--store", &server, "--flows", "4", "--steps", "3",
        "--wakes", "5",
    ]);
    assert!(ok, "{engine}");
    for backend in ["sqlite", "postgres"] {
        assert!(
            engine
                .lines()
                .any(|l| l.starts_with(&format!("engine/side-by-side: {backend}"))),
            "{engine}"
        );
    }
    let (ok, scale) = dexa(&[
        "bench",
        "scale",
        "--store",
        &server,
        "--workers",
        "1,2",
        "--flows",
        "8",
        "--steps",
        "2",
        "--step-ms",
        "5",
    ]);
    assert!(ok, "{scale}");
    assert!(
        scale.contains("scale[postgres]/workers=1x16 slots: 16 Steps"),
        "{scale}"
    );
    assert!(
        scale.contains("scale[postgres]/workers=2x16 slots: 16 Steps"),
        "{scale}"
    );
    // The runs drop the schemas they made.
    assert_eq!(
        bench_schemas().await,
        before,
        "benchmark schemas left behind"
    );
}

/// The operator's commands read and drive a PostgreSQL deployment from
/// any machine: `dexa session`, `dexa agent versions`, `dexa component
/// list`, all through `--config` (here `$DEXA_CONFIG`), with a worker
/// elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_commands_work_against_postgres() {
    use dexa_tests::session::{Backend, BACKEND};
    use dexa_tests::versions::dexa_cli;
    BACKEND
        .scope(Backend::Postgres, async {
            let mut stack = AgentTestStack::new(vec![KitAgent::scripted(
                "Ops",
                json!({"turns": [{"steps": [{"text": "hello from postgres"}]}]}),
            )]);
            let config = std::fs::read_to_string(&stack.config_path).unwrap();
            assert!(config.contains("postgres://"), "{config}");
            stack.start_worker();
            let started = dexa_cli(
                &stack,
                &["session", "start", "Ops", "hi", "--id", "s1"],
                &[],
            );
            assert!(started.success, "{started:?}");
            let waited = dexa_cli(&stack, &["session", "wait", "s1"], &[]);
            assert!(waited.success, "{waited:?}");
            let shown = dexa_cli(&stack, &["session", "show", "s1", "--json"], &[]).json();
            let texts: Vec<&str> = shown["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["text"].as_str())
                .collect();
            assert_eq!(texts, vec!["hi", "hello from postgres"]);
            let listed = dexa_cli(&stack, &["session", "list"], &[]);
            assert!(listed.success && listed.stdout.contains("s1"), "{listed:?}");
            let history = dexa_cli(&stack, &["session", "history", "s1"], &[]);
            assert!(
                history.success && history.stdout.contains("RunModel"),
                "{history:?}"
            );
            let versions = dexa_cli(&stack, &["agent", "versions", "Ops"], &[]);
            assert!(versions.success, "{versions:?}");
            assert!(versions.stdout.contains("config"), "{versions:?}");
            let components = dexa_cli(&stack, &["component", "list"], &[]);
            assert!(
                components.success && components.stdout.contains("runner"),
                "{components:?}"
            );
        })
        .await;
}
