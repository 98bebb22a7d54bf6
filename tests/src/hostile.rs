//! The hostile-guest stack of `tests/hostile*.rs`: a `dexa.toml` with
//! `guests/hostile/` beside a healthy agent, loopback peers that count
//! connections, and helpers that read what the host recorded.
//!
//! - `Attacks` runs hostile-runner and hostile-tool (granted `/data`, one
//!   environment variable, one HTTP and one TCP peer) with deadlines far
//!   above what any bounded attack needs (60 s), so that each proves its own
//!   limit even on a loaded machine; `Spinner` is the same with 1 s
//!   deadlines, for the attacks only a deadline stops;
//! - `Healthy` runs scripted-runner and echo-tool on the same workers;
//!   `HealthySlow` is the same turn with 40 ms of model latency per step
//!   (its calls wait past the inline budget, so they run on the guest pool).

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dexa::flow::{history, FlowStatus, StepHistoryEntry};
use dexa::session::{step, AgentSessionClient};
use serde_json::json;

use crate::kit::AgentTestStack;
use crate::session::last_text;
use crate::session::wait_for_turns_within;
use crate::wat::wat_component;
use crate::{guest_wasm, repo_root};

/// How long a hostile test waits for a turn to end: a bound on a hang, not a
/// measure. A turn whose Steps retry three bounded attacks on a machine
/// under a parallel build (load 5 on 2 cores) needs far more than the kit's
/// usual 20 s, and no assertion depends on how long it took.
pub const TURN_WAIT: Duration = Duration::from_secs(180);

pub const SECRET_VAR: &str = "DEXA_HOSTILE_SECRET";
pub const SECRET_VALUE: &str = "hunter2-never-seen";
pub const GRANTED_VAR: &str = "DEXA_HOSTILE_GRANTED";
pub const MODEL_KEY_VAR: &str = "DEXA_HOSTILE_MODEL_KEY";
pub const MODEL_KEY: &str = "sk-test-held-by-the-host";
pub const SECRET_FILE_TEXT: &str = "TOP-SECRET outside the grant";

/// A loopback TCP server that counts connections; plain HTTP 200 when
/// `http` is set. It stops when dropped.
pub struct CountingServer {
    pub port: u16,
    connections: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl CountingServer {
    fn start(http: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let port = listener.local_addr().expect("local addr").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (count, stopped) = (connections.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        count.fetch_add(1, Ordering::SeqCst);
                        if http {
                            let _ = stream.set_nonblocking(false);
                            read_request_head(&mut stream);
                            let _ = stream.write_all(
                                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
                            );
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Self {
            port,
            connections,
            stop,
        }
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// Reads until the end of a request head (or 30 s, or the peer closing), so
/// that the answer never races a request still arriving on a loaded machine.
fn read_request_head(stream: &mut std::net::TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut head = Vec::new();
    let mut chunk = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 << 10 {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
    }
}

impl Drop for CountingServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Loopback servers: one granted and one not, for HTTP and for raw TCP.
pub struct Peers {
    pub http_granted: CountingServer,
    pub http_refused: CountingServer,
    pub tcp_granted: CountingServer,
    pub tcp_refused: CountingServer,
}

impl Peers {
    pub fn start() -> Self {
        Self {
            http_granted: CountingServer::start(true),
            http_refused: CountingServer::start(true),
            tcp_granted: CountingServer::start(false),
            tcp_refused: CountingServer::start(false),
        }
    }
}

/// `Attacks` runs hostile-runner and hostile-tool; `Healthy` runs
/// scripted-runner and echo-tool, on the same workers. `extra_tool_limits`
/// goes into hostile-tool's limits table.
pub fn render(dir: &Path, peers: &Peers, extra_tool_limits: &str) -> String {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    std::fs::write(data.join("visible.txt"), "granted text").expect("visible file");
    std::fs::write(dir.join("secret.txt"), SECRET_FILE_TEXT).expect("secret file");
    let link = data.join("link");
    if !link.exists() {
        std::os::unix::fs::symlink("../secret.txt", &link).expect("symlink");
    }
    let healthy_script = json!({"turns": [{"steps": [
        {"tool_calls": [{"id": "e1", "name": "echo", "arguments": {"n": 1}, "effect": "read"}]},
        {"text": "fine"},
    ]}]});
    let slow_script = json!({"turns": [{"steps": [
        {"sleep_ms": 40, "tool_calls": [{"id": "e1", "name": "echo", "arguments": {"n": 1}, "effect": "read"}]},
        {"sleep_ms": 40, "text": "fine"},
    ]}]});
    format!(
        r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"

[worker]
slots = 24
lease = "3s"
poll_interval = "50ms"
reap_interval = "100ms"

[components.hostile-runner]
path = "{hostile_runner}"
limits = {{ memory = "32MiB", output = "1MiB", run_state = "1MiB", events_per_call = "64KiB" }}

[components.hostile-tool]
path = "{hostile_tool}"
dirs = [{{ host = "data", guest = "/data", access = "read_only" }}]
env = ["{GRANTED_VAR}"]
http = ["127.0.0.1:{http_ok}"]
tcp_connect = ["127.0.0.1:{tcp_ok}"]
limits = {{ output = "1MiB", events_per_call = "64KiB"{extra_tool_limits} }}

[components.scripted-runner]
path = "{scripted_runner}"
config = {{ script = '{healthy_script}' }}

[components.slow-runner]
path = "{scripted_runner}"
config = {{ script = '{slow_script}' }}

[components.echo-tool]
path = "{echo_tool}"

[models.guarded]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "never-called"
api_key_env = "{MODEL_KEY_VAR}"

[agents.Attacks]
runner = "hostile-runner"
tools = ["hostile-tool"]
model = "guarded"
tool_attempt_timeout = "60s"
model_step_timeout = "60s"

[agents.Spinner]
runner = "hostile-runner"
tools = ["hostile-tool"]
model = "guarded"
tool_attempt_timeout = "1s"
model_step_timeout = "1s"

[agents.Healthy]
runner = "scripted-runner"
tools = ["echo-tool"]

[agents.HealthySlow]
runner = "slow-runner"
tools = ["echo-tool"]
"#,
        cache = repo_root().join("target/test-component-cache").display(),
        hostile_runner = guest_wasm("hostile-runner").display(),
        hostile_tool = guest_wasm("hostile-tool").display(),
        scripted_runner = guest_wasm("scripted-runner").display(),
        echo_tool = guest_wasm("echo-tool").display(),
        http_ok = peers.http_granted.port,
        tcp_ok = peers.tcp_granted.port,
    )
}

/// The stack of the containment attacks (issue 15), on one worker:
/// - `Wat` runs hostile-runner with the WebAssembly-text tools
///   `multi-memory` and `table-bomb` (`guests/hostile/wat/`);
/// - `Events` runs hostile-runner and hostile-tool with a 64 MiB event
///   budget, so that only the per-event checks stand between a huge payload
///   and the parser;
/// - `Writer` runs hostile-tool granted `shared/` read-write, and `Reader`
///   hostile-tool (as `reader-tool`) granted `shared/sub` read-only: grants
///   that overlap, marked `shared = true` when `shared` is set. `outside/`
///   beside them holds a secret neither is granted.
pub fn render_containment(dir: &Path, shared: bool) -> String {
    std::fs::create_dir_all(dir.join("shared/sub")).expect("shared dir");
    std::fs::write(dir.join("shared/sub/note.txt"), "shared note").expect("note");
    std::fs::create_dir_all(dir.join("outside")).expect("outside dir");
    std::fs::write(dir.join("outside/secret.txt"), SECRET_FILE_TEXT).expect("secret");
    let shared = if shared { ", shared = true" } else { "" };
    format!(
        r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"

[worker]
slots = 8
poll_interval = "50ms"

[components.hostile-runner]
path = "{hostile_runner}"

[components.multi-memory]
path = "{multi_memory}"

[components.table-bomb]
path = "{table_bomb}"

[components.hostile-tool]
path = "{hostile_tool}"
limits = {{ events_per_call = "64MiB" }}

[components.writer-tool]
path = "{hostile_tool}"
dirs = [{{ host = "shared", guest = "/shared", access = "read_write"{shared} }}]

[components.reader-tool]
path = "{hostile_tool}"
dirs = [{{ host = "shared/sub", guest = "/sub", access = "read_only"{shared} }}]

[agents.Wat]
runner = "hostile-runner"
tools = ["multi-memory", "table-bomb"]
tool_attempt_timeout = "60s"

[agents.Events]
runner = "hostile-runner"
tools = ["hostile-tool"]
tool_attempt_timeout = "60s"

[agents.Writer]
runner = "hostile-runner"
tools = ["writer-tool"]

[agents.Reader]
runner = "hostile-runner"
tools = ["reader-tool"]
"#,
        cache = repo_root().join("target/test-component-cache").display(),
        hostile_runner = guest_wasm("hostile-runner").display(),
        hostile_tool = guest_wasm("hostile-tool").display(),
        multi_memory = wat_component("multi-memory").display(),
        table_bomb = wat_component("table-bomb").display(),
    )
}

/// Waits for worker `index` to exit (it must, within a minute) and returns
/// its log.
pub async fn refused_start_log(stack: &mut AgentTestStack, index: usize) -> String {
    let status = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(status) = stack.worker(index).exit_status() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the worker should refuse to start");
    assert!(!status.success());
    stack.worker_log(index)
}

pub const WORKER_ENV: [(&str, &str); 3] = [
    (GRANTED_VAR, "granted-value"),
    (SECRET_VAR, SECRET_VALUE),
    (MODEL_KEY_VAR, MODEL_KEY),
];

pub fn stack(peers: &Peers, extra_tool_limits: &str) -> AgentTestStack {
    let mut stack = AgentTestStack::with_config(|dir| render(dir, peers, extra_tool_limits));
    stack.start_worker_with_env(&[], &WORKER_ENV);
    stack
}

/// Starts session `id` with `message` and returns the text that ended its
/// first turn, or the turn's recorded error.
pub async fn first_turn(sessions: &AgentSessionClient, id: &str, message: &str) -> TurnEnd {
    sessions
        .start_session(id, message)
        .await
        .unwrap_or_else(|err| panic!("start {id}: {err}"));
    let snapshot = wait_for_turns_within(sessions, id, 1, TURN_WAIT).await;
    let state = snapshot.state.clone().expect("state");
    TurnEnd {
        text: last_text(&snapshot).unwrap_or_default(),
        error: state.last_turn_error,
    }
}

#[derive(Debug)]
pub struct TurnEnd {
    pub text: String,
    pub error: Option<String>,
}

/// A hostile-tool call's report line, from hostile-runner's answer.
pub fn tool_report(end: &TurnEnd, tool: &str) -> String {
    assert!(
        end.error.is_none(),
        "{tool}: the turn should complete, it failed: {:?}",
        end.error
    );
    let prefix = "after tools: ";
    assert!(
        end.text.starts_with(prefix),
        "{tool}: unexpected answer {:?}",
        end.text
    );
    end.text[prefix.len()..].to_string()
}

/// What the model reads of a tool call whose guest trapped.
pub const CRASHED_NOTE: &str = "the tool crashed (its error is in the session's Step history)";

/// A trapped tool call: the model read one line, not `trap_text`, which
/// the session's Step history keeps.
pub fn assert_tool_crashed(
    end: &TurnEnd,
    tool: &str,
    history: &[StepHistoryEntry],
    trap_text: &str,
) {
    assert_tool_failed(end, tool, CRASHED_NOTE);
    assert!(
        !end.text.contains(trap_text),
        "{tool}: the trap's text reached the model: {:?}",
        end.text
    );
    assert!(
        history
            .iter()
            .any(|e| e.detail.as_deref().is_some_and(|d| d.contains(trap_text))),
        "{tool}: the Step history should keep {trap_text:?}: {history:?}"
    );
}

pub fn assert_tool_failed(end: &TurnEnd, tool: &str, expected: &str) {
    let report = tool_report(end, tool);
    assert!(
        report.starts_with(&format!("{tool} Failed ")),
        "{tool}: expected a failed record, got {report:?}"
    );
    assert!(
        report.contains(expected),
        "{tool}: the recorded error should mention {expected:?}: {report:?}"
    );
}

/// Sends `message` as the next turn and waits for it to end.
pub async fn next_turn(
    sessions: &AgentSessionClient,
    id: &str,
    turn: u64,
    message: &str,
) -> TurnEnd {
    assert!(sessions
        .send_user_message(id, message)
        .await
        .unwrap_or_else(|err| panic!("send to {id}: {err}")));
    let snapshot = wait_for_turns_within(sessions, id, turn, TURN_WAIT).await;
    TurnEnd {
        text: last_text(&snapshot).unwrap_or_default(),
        error: snapshot.state.and_then(|s| s.last_turn_error),
    }
}

/// Plays each runner attack as the first turn of its own session (named
/// after it), all at once: each turn must fail with its expected error, and
/// each session must then answer `hello` with `ok: hello`.
pub async fn assert_runner_attacks_fail_their_turns(
    sessions: &AgentSessionClient,
    failing: &[(&str, &str)],
) {
    let runs = failing.iter().map(|(attack, _)| {
        let sessions = sessions.clone();
        async move {
            let first = first_turn(&sessions, attack, attack).await;
            // The session waits for the next message and answers it.
            let second = next_turn(&sessions, attack, 2, "hello").await;
            (first, second)
        }
    });
    let results = futures_util::future::join_all(runs).await;
    for ((attack, expected), (first, second)) in failing.iter().zip(&results) {
        let error = first
            .error
            .as_deref()
            .unwrap_or_else(|| panic!("{attack}: the turn should fail, it ended with {first:?}"));
        assert!(
            error.contains(expected),
            "{attack}: last_turn_error should mention {expected:?}: {error}"
        );
        assert_eq!(second.text, "ok: hello", "{attack}: the next turn works");
        assert_eq!(second.error, None);
    }
}

/// The spec's route for a Step that keeps failing: `step_type`'s first
/// three history entries are two failed attempts and a final failure, each
/// with a recorded error, and the failure route `route` ran.
pub fn assert_three_failed_attempts_then(
    history: &[StepHistoryEntry],
    step_type: &str,
    route: &str,
) {
    let attempts: Vec<&StepHistoryEntry> = history
        .iter()
        .filter(|e| e.step_type == step_type)
        .take(3)
        .collect();
    assert_eq!(
        attempts
            .iter()
            .map(|e| e.event_type.as_str())
            .collect::<Vec<_>>(),
        [
            history::ATTEMPT_FAILED,
            history::ATTEMPT_FAILED,
            history::EXECUTE_FAILED
        ],
        "{history:?}"
    );
    assert!(
        attempts
            .iter()
            .all(|e| e.detail.as_deref().is_some_and(|d| !d.is_empty())),
        "each attempt's error is recorded: {history:?}"
    );
    assert!(
        history.iter().any(|e| e.step_type == route),
        "{route} ran: {history:?}"
    );
}

/// A runner whose `build-user-message` traps on the message `trap-build`:
/// AwaitUserMessage tries its three attempts, then gives the message up with
/// the reason recorded as the turn's error (`expected` in it), and the
/// session goes on: the next message runs its turn.
pub async fn assert_a_trap_in_build_user_message_fails_only_that_message(
    stack: &AgentTestStack,
    sessions: &AgentSessionClient,
    expected: &str,
) {
    sessions
        .start_session("trap-build", "")
        .await
        .expect("start");
    wait_for_turns_within(sessions, "trap-build", 0, TURN_WAIT).await;
    assert!(sessions
        .send_user_message("trap-build", "trap-build")
        .await
        .expect("send"));
    let snapshot = wait_for_turns_within(sessions, "trap-build", 1, TURN_WAIT).await;
    assert_eq!(snapshot.flow_status, FlowStatus::Running);
    let error = snapshot
        .state
        .and_then(|s| s.last_turn_error)
        .unwrap_or_default();
    assert!(
        error.contains("the user message could not be used") && error.contains(expected),
        "{error}"
    );
    let history = stack.read_step_history("trap-build").await;
    let attempts: Vec<(&str, u32)> = history
        .iter()
        .filter(|e| e.step_type == step::AWAIT_USER_MESSAGE)
        .map(|e| (e.event_type.as_str(), e.final_attempt))
        .collect();
    assert_eq!(
        attempts,
        vec![
            (history::ATTEMPT_FAILED, 1),
            (history::ATTEMPT_FAILED, 2),
            (history::EXECUTE_COMPLETED, 3),
        ],
        "{history:?}"
    );
    assert!(sessions
        .send_user_message("trap-build", "hello")
        .await
        .expect("send"));
    let after = wait_for_turns_within(sessions, "trap-build", 2, TURN_WAIT).await;
    assert_eq!(after.state.and_then(|s| s.last_turn_error), None);
}
