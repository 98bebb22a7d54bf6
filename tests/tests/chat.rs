//! `dexa chat` as a person uses it: the real binary with a terminal's stdin
//! and stdout. Live text, tool calls, a y/n approval, and reattaching after
//! the process is restarted. Also `dexa session` for scripts.

use std::process::Stdio;
use std::time::Duration;

use dexa_tests::api_server::helpdesk_config;
use dexa_tests::kit::{dexa_binary, dexa_session};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

struct Terminal {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
    seen: String,
}

impl Terminal {
    /// `stderr` receives what dexa chat prints there (load progress).
    fn start(config: &std::path::Path, stderr: std::fs::File) -> Self {
        Self::start_with(config, stderr, &[])
    }

    /// [`Self::start`] with more arguments.
    fn start_with(config: &std::path::Path, stderr: std::fs::File, more: &[&str]) -> Self {
        let mut child = Command::new(dexa_binary())
            .args(["chat", "Helpdesk", "--config"])
            .arg(config)
            .args(more)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        Self {
            child,
            stdin,
            stdout,
            seen: String::new(),
        }
    }

    /// Reads until the output (since the last call) contains `needle`.
    async fn expect(&mut self, needle: &str) -> String {
        let mut buffer = [0u8; 4096];
        let result = tokio::time::timeout(Duration::from_secs(30), async {
            while !self.seen.contains(needle) {
                let n = self.stdout.read(&mut buffer).await.unwrap();
                assert!(
                    n > 0,
                    "dexa chat ended before {needle:?}; it printed:\n{}",
                    self.seen
                );
                self.seen.push_str(&String::from_utf8_lossy(&buffer[..n]));
            }
        })
        .await;
        assert!(
            result.is_ok(),
            "no {needle:?} within 30 s; dexa chat printed:\n{}",
            self.seen
        );
        let at = self.seen.find(needle).unwrap_or(0) + needle.len();
        let shown = self.seen[..at].to_string();
        self.seen = self.seen[at..].to_string();
        shown
    }

    async fn type_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
    }

    /// Closes stdin (Ctrl-D) and waits for a clean exit.
    async fn close(mut self) {
        drop(self.stdin.take());
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "dexa chat exited with {status}");
    }
}

async fn session(config: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = dexa_session(config, args).await;
    (code == Some(0), out, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_asks_for_approval_and_reattaches_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [
            {"steps": [
                {"text": "Let me pay that.", "deltas": ["Let me ", "pay that."],
                 "tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
                {"text": "Paid.", "deltas": ["Pa", "id."]}
            ]},
            {"steps": [{"text": "Hello again."}]}
        ]}),
    );
    let progress = dir.path().join("chat-stderr.txt");
    let mut terminal = Terminal::start(&config, std::fs::File::create(&progress).unwrap());
    let opened = terminal.expect("you> ").await;
    let shown = std::fs::read_to_string(&progress).unwrap();
    for line in ["[1/2] loading gates...", "[2/2] loading runner..."] {
        assert!(shown.contains(line), "progress {line:?} in:\n{shown}");
    }
    assert!(opened.contains("new session chat-helpdesk-"), "{opened}");
    terminal.type_line("pay invoice 7").await;
    terminal.expect("agent> Let me pay that.").await;
    terminal
        .expect("approve log {\"name\":\"pay\"}? [y/n] ")
        .await;
    terminal.type_line("maybe").await;
    // Anything but y or n asks again.
    terminal
        .expect("approve log {\"name\":\"pay\"}? [y/n] ")
        .await;
    terminal.type_line("y").await;
    terminal.expect("[tool log started]").await;
    terminal.expect("[tool log succeeded]").await;
    terminal.expect("agent> Paid.").await;
    terminal.expect("you> ").await;
    terminal.close().await;

    // A new process reattaches to the same session.
    let mut terminal = Terminal::start(&config, std::fs::File::create(&progress).unwrap());
    let resumed = terminal.expect("you> ").await;
    assert!(
        resumed.contains("resuming session chat-helpdesk-"),
        "{resumed}"
    );
    assert!(resumed.contains("assistant: Paid."), "{resumed}");
    terminal.type_line("hi").await;
    terminal.expect("agent> Hello again.").await;
    terminal.type_line("/quit").await;
    terminal.close().await;

    // The same session, seen by `dexa session` for scripts.
    let (ok, listed, err) = session(&config, &["list", "--json"]).await;
    assert!(ok, "{err}");
    let listed: Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    let id = listed[0]["flow_id"].as_str().unwrap().to_string();
    let (ok, shown, err) = session(&config, &["show", &id]).await;
    assert!(ok, "{err}");
    assert!(shown.contains("turns: 2"), "{shown}");
    assert!(shown.contains("assistant Hello again."), "{shown}");
}

impl Terminal {
    /// Ctrl-C: SIGINT to the process, as a terminal sends it.
    fn interrupt(&self) {
        let pid = self.child.id().expect("dexa chat runs") as i32;
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(pid, libc::SIGINT);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_in_chat_cancels_the_running_turn_and_at_the_prompt_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [
            {"steps": [{"text": "too late", "sleep_ms": 30000}]},
            {"steps": [{"text": "Back again."}]}
        ]}),
    );
    let progress = dir.path().join("chat-stderr.txt");
    let mut terminal = Terminal::start(&config, std::fs::File::create(&progress).unwrap());
    let opened = terminal.expect("you> ").await;
    let id = opened
        .split_whitespace()
        .find(|word| word.starts_with("chat-helpdesk-"))
        .expect("the session's id")
        .to_string();
    terminal.type_line("think for a long time").await;
    // Once the turn runs (its model call sleeps 30 s; chat follows it),
    // Ctrl-C cancels it.
    let mut running = false;
    for _ in 0..600 {
        let (_, shown, _) = dexa_session(&config, &["show", &id, "--json"]).await;
        let shown: Value = serde_json::from_str(&shown).unwrap_or(Value::Null);
        if shown["state"]["active_turn_id"].is_string() {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(running, "the turn started");
    terminal.interrupt();
    terminal.expect("[cancelling the turn]").await;
    terminal.expect("[the turn was cancelled]").await;
    terminal.expect("you> ").await;
    terminal.type_line("hello").await;
    terminal.expect("agent> Back again.").await;
    terminal.expect("you> ").await;
    // At the prompt, Ctrl-C leaves, as it would without the handler.
    terminal.interrupt();
    let status = tokio::time::timeout(Duration::from_secs(30), terminal.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "dexa chat exited with {status}");
}

/// Ctrl-C at an approval question cancels the turn, as it does while the
/// turn runs: the tool never runs, and the next turn goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_at_an_approval_question_cancels_the_turn() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [
            {"steps": [
                {"text": "Let me pay that.",
                 "tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
                {"text": "Paid."}
            ]},
            {"steps": [{"text": "Back again."}]}
        ]}),
    );
    let progress = dir.path().join("chat-stderr.txt");
    let mut terminal = Terminal::start(&config, std::fs::File::create(&progress).unwrap());
    let opened = terminal.expect("you> ").await;
    let id = opened
        .split_whitespace()
        .find(|word| word.starts_with("chat-helpdesk-"))
        .expect("the session's id")
        .to_string();
    terminal.type_line("pay invoice 7").await;
    terminal
        .expect("approve log {\"name\":\"pay\"}? [y/n] ")
        .await;
    terminal.interrupt();
    terminal.expect("[cancelling the turn]").await;
    terminal.expect("[the turn was cancelled]").await;
    terminal.expect("you> ").await;
    terminal.type_line("hello").await;
    terminal.expect("agent> Back again.").await;
    terminal.expect("you> ").await;
    assert!(
        !terminal.seen.contains("[tool log started]"),
        "{}",
        terminal.seen
    );
    let (_, shown, _) = dexa_session(&config, &["show", &id, "--json"]).await;
    let shown: Value = serde_json::from_str(&shown).unwrap_or(Value::Null);
    assert_eq!(shown["pending_interrupts"], json!([]), "{shown}");
    terminal.type_line("/quit").await;
    terminal.close().await;
}

/// Ctrl-C after the message was queued but before its turn started (no
/// worker yet: a busy one, or a runner still building the turn) cancels the
/// turn when it starts, rather than returning to the prompt while the turn
/// runs unseen. Another client's message queued ahead of it runs its turn
/// first: that turn is shown, neither cancelled nor taken for the end of
/// this chat's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_in_chat_before_the_turn_starts_cancels_it_when_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [
            {"steps": [{"text": "For the other client."}]},
            {"steps": [{"text": "too late", "sleep_ms": 30000}]},
            {"steps": [{"text": "Back again."}]}
        ]}),
    );
    let progress = dir.path().join("chat-stderr.txt");
    let mut terminal = Terminal::start_with(
        &config,
        std::fs::File::create(&progress).unwrap(),
        &["--no-worker"],
    );
    let opened = terminal.expect("you> ").await;
    let id = opened
        .split_whitespace()
        .find(|word| word.starts_with("chat-helpdesk-"))
        .expect("the session's id")
        .to_string();
    let queued = |n: u64| {
        let (config, id) = (config.clone(), id.clone());
        async move {
            for _ in 0..600 {
                let (_, shown, _) = dexa_session(&config, &["show", &id, "--json"]).await;
                let shown: Value = serde_json::from_str(&shown).unwrap_or(Value::Null);
                if shown["queued_message_count"] == n {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        }
    };
    // Another client's message, ahead of this chat's.
    let (code, _, err) = dexa_session(&config, &["send", &id, "from elsewhere"]).await;
    assert_eq!(code, Some(0), "{err}");
    assert!(queued(1).await, "the other client's message was queued");
    terminal.type_line("think for a long time").await;
    // Queued: chat follows a turn that no worker has started.
    assert!(queued(2).await, "the message was queued");
    terminal.interrupt();
    terminal
        .expect("[cancelling the turn when it starts]")
        .await;
    let mut worker = Command::new(dexa_binary())
        .args(["worker", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    terminal.expect("agent> For the other client.").await;
    terminal.expect("[cancelling the turn]").await;
    terminal.expect("[the turn was cancelled]").await;
    terminal.expect("you> ").await;
    assert!(
        !terminal.seen.contains("too late"),
        "the model call was stopped: {}",
        terminal.seen
    );
    let (_, shown, _) = dexa_session(&config, &["show", &id, "--json"]).await;
    let shown: Value = serde_json::from_str(&shown).unwrap_or(Value::Null);
    assert_eq!(shown["state"]["turn_count"], 2, "{shown}");
    terminal.type_line("hello").await;
    terminal.expect("agent> Back again.").await;
    terminal.expect("you> ").await;
    terminal.interrupt();
    let status = tokio::time::timeout(Duration::from_secs(30), terminal.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "dexa chat exited with {status}");
    let _ = worker.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_session_drives_a_session_for_scripts() {
    let dir = tempfile::tempdir().unwrap();
    let config = helpdesk_config(
        dir.path(),
        &json!({"turns": [{"steps": [
            {"tool_calls": [
                {"id": "a", "name": "log", "arguments": {"name": "a"}},
                {"id": "b", "name": "log", "arguments": {"name": "b"}}
            ]},
            {"text": "done"}
        ]}]}),
    );
    // A worker of its own: `dexa session` only talks to the store.
    let mut worker = Command::new(dexa_binary())
        .args(["worker", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (ok, started, err) = session(&config, &["start", "Helpdesk", "go", "--id", "s1"]).await;
    assert!(ok, "{err}");
    assert_eq!(started.trim(), "s1");
    let (ok, waited, err) = session(&config, &["wait", "s1"]).await;
    assert!(ok, "{err}");
    assert_eq!(waited.trim(), "waiting for approval");
    // Two approvals pending: approve needs an id.
    let (ok, _, err) = session(&config, &["approve", "s1"]).await;
    assert!(!ok);
    assert!(err.contains("several approvals are pending"), "{err}");
    let (ok, out, err) = session(&config, &["approve", "s1", "turn-1/a"]).await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "approved turn-1/a");
    let (ok, out, err) = session(&config, &["reject", "s1", "--message", "not b"]).await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "rejected turn-1/b");
    let (ok, _, err) = session(&config, &["wait", "s1"]).await;
    assert!(ok, "{err}");
    let (ok, shown, err) = session(&config, &["show", "s1", "--json"]).await;
    assert!(ok, "{err}");
    let shown: Value = serde_json::from_str(&shown).unwrap();
    let tools: Vec<&str> = shown["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["text"].as_str())
        .collect();
    assert_eq!(tools, vec!["s1/turn-1/a", "Tool call was rejected: not b"]);
    let (ok, out, err) = session(&config, &["send", "s1", "  "]).await;
    assert!(!ok, "{out}");
    assert!(err.contains("blank"), "{err}");
    let (ok, history, err) = session(&config, &["history", "s1"]).await;
    assert!(ok, "{err}");
    assert!(history.contains("AwaitToolApproval"), "{history}");
    let (ok, out, _) = session(&config, &["stop", "s1"]).await;
    assert!(ok);
    assert_eq!(out.trim(), "stopped");
    let (ok, _, err) = session(&config, &["show", "nope"]).await;
    assert!(!ok);
    assert!(err.contains("there is no session \"nope\""), "{err}");
    let _ = worker.kill().await;
}
