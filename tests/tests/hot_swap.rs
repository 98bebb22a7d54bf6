//! Hot swap: versions of a runner or a tool component activated under live
//! sessions run by real `dexa worker` processes, with every turn pinned to
//! its runner version and every tool call to the version it was deferred
//! with. See `dexa::catalog` and `dexa::config::versions`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dexa::catalog::{ActivateIf, ActivationMode, ComponentRecord, NewActivation};
use dexa::plugin::WIT_PACKAGE;
use dexa::session::{
    event_type, step, AgentState, ResolveInterruptRequest, ToolEffect, AGENT_STATE,
};
use dexa_tests::guest_bytes;
use dexa_tests::kit::{render_config, wait_until, AgentTestStack, KitAgent, KitSettings};
use dexa_tests::session::all_events;
use dexa_tests::session::{wait_for_agent_snapshot_within, wait_for_turns_within};
use dexa_tests::versions::{self, dexa_cli, digest_of, versions_by_turn, write_variant};
use serde_json::{json, Value};

fn call(id: &str, tool: &str, args: Value) -> Value {
    json!({"id": id, "name": tool, "arguments": args})
}

/// An agent whose one turn calls the `gate` tool (a read, held at `gate`
/// until the test releases it) and then answers "done"; `requires_approval`
/// is the tool's approval policy.
fn gated_agent(name: &str, gate: &str, requires_approval: Option<bool>) -> KitAgent {
    KitAgent::scripted(
        name,
        json!({"turns": [{"steps": [
            {"tool_calls": [call("g", "gate", json!({"name": gate, "timeout_ms": 60000}))]},
            {"text": "done"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::Read, requires_approval)
}

/// The digest of a guest as built.
fn built(guest: &str) -> String {
    digest_of(&guest_bytes(guest))
}

/// The runner-run Steps (they record the runner's version).
fn runs_runner(step_type: &str) -> bool {
    [
        step::START_AGENT_SESSION,
        step::AWAIT_USER_MESSAGE,
        step::RUN_MODEL,
        step::RECORD_TURN_FAILURE,
    ]
    .contains(&step_type)
}

/// The versions that ran `session`'s runner Steps, by turn.
async fn runner_versions(
    stack: &AgentTestStack,
    agent: &str,
    session: &str,
) -> BTreeMap<String, BTreeSet<String>> {
    let history = stack.read_step_history(session).await;
    let events = all_events(&stack.sessions(agent), session).await;
    versions_by_turn(&history, &events)
        .into_iter()
        .map(|(turn, ran)| {
            let runners = ran
                .into_iter()
                .filter(|(step_type, _)| runs_runner(step_type))
                .map(|(_, digest)| digest)
                .collect();
            (turn, runners)
        })
        .collect()
}

/// Waits until a worker has started and recorded `dexa.toml`'s versions of
/// `agent` (an activation before that is one the config then leaves alone).
async fn wait_for_bootstrap(stack: &AgentTestStack, agent: &str) {
    let catalog = stack.deployment.catalog.clone();
    let agent = agent.to_string();
    wait_until("the worker's start", TURN_WAIT, || {
        let (catalog, agent) = (catalog.clone(), agent.clone());
        async move {
            let log = catalog.activations(Some(&agent)).await.ok()?;
            log.iter().any(|a| a.actor == "config").then_some(())
        }
    })
    .await;
}

/// How long a turn may take here: several tests with real workers (one of
/// them running 2,000 turns) share two cores.
const TURN_WAIT: Duration = Duration::from_secs(90);

fn activate(stack: &AgentTestStack, agent: &str, args: &[&str]) -> Value {
    let mut all = vec!["agent", "activate", agent];
    all.extend_from_slice(args);
    dexa_cli(stack, &all, &[]).json()
}

/// Starts `dexa ARGS` with the activation test hook and waits until it has
/// added its version and paused before the log entry; the pause ends when
/// the returned path is written.
async fn paused_cli(
    stack: &AgentTestStack,
    args: &[&str],
    name: &str,
) -> (std::process::Child, std::path::PathBuf) {
    let pause = stack.dir.path().join(name);
    let child = std::process::Command::new(dexa_tests::kit::dexa_binary())
        .args(args)
        .env("DEXA_CONFIG", &stack.config_path)
        .env("DEXA_TEST_ACTIVATION_PAUSE", &pause)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reached = pause.with_extension("reached");
    wait_until("the activation's pause", Duration::from_secs(60), || {
        let reached = reached.clone();
        async move { reached.exists().then_some(()) }
    })
    .await;
    (child, pause)
}

/// How many entries the activation log of `agent` has.
async fn log_len(stack: &AgentTestStack, agent: &str) -> usize {
    stack
        .deployment
        .catalog
        .activations(Some(agent))
        .await
        .unwrap_or_else(|err| panic!("{err}"))
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_activated_mid_conversation_fails_no_turn_and_each_turn_keeps_its_version() {
    let second = json!({"steps": [{"text": "two"}]});
    let models = KitAgent::scripted(
        "Models",
        json!({"turns": [{"steps": [{"gate": "model-hold", "text": "one"}]}, second]}),
    );
    let tools = KitAgent::scripted(
        "Tools",
        json!({"turns": [{"steps": [
            {"tool_calls": [call("t", "gate", json!({"name": "tool-hold", "timeout_ms": 60000}))]},
            {"text": "one"}
        ]}, second]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::Read, None);
    let approvals = KitAgent::scripted(
        "Approvals",
        json!({"turns": [{"steps": [
            {"tool_calls": [call("a", "log", json!({"name": "approved"}))]},
            {"text": "one"}
        ]}, second]}),
    )
    .tool("gate-tool")
    .policy("log", ToolEffect::NonIdempotentWrite, Some(true));
    let mut stack = AgentTestStack::new(vec![models, tools, approvals]);
    stack.start_worker();
    stack.start_worker();
    let plan: Vec<(&str, String)> = (0..20)
        .map(|n| match n % 3 {
            0 => ("Models", format!("m{n}")),
            1 => ("Tools", format!("t{n}")),
            _ => ("Approvals", format!("a{n}")),
        })
        .collect();
    for (agent, session) in &plan {
        stack
            .sessions(agent)
            .start_session(session, "go")
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }
    // Every session is mid-turn: inside RunModel, inside a tool, or waiting
    // for an approval.
    let log = stack.invocations();
    // Bounded like the turns: this file's other tests (one of them running
    // 2,000 turns) share the two cores with these twenty sessions.
    for (gate, agent) in [("model-hold", "Models"), ("tool-hold", "Tools")] {
        let reached =
            tokio::time::timeout(TURN_WAIT, log.wait_for_count_within(gate, 7, TURN_WAIT * 2));
        if reached.await.is_err() {
            // Where each of the agent's sessions stands, for the report.
            let mut report = String::new();
            for (_, session) in plan.iter().filter(|(a, _)| *a == agent) {
                let snapshot = stack.sessions(agent).get_agent_snapshot(session).await;
                let history = stack.read_step_history(session).await;
                report.push_str(&format!(
                    "\n{session}: {snapshot:?}\n  history: {:?}",
                    history
                        .iter()
                        .map(|e| format!(
                            "{} {} #{} {:?}",
                            e.event_type, e.step_type, e.final_attempt, e.detail
                        ))
                        .collect::<Vec<_>>()
                ));
            }
            let entries = log.entries();
            panic!(
                "only {} of 7 calls of {gate} within {TURN_WAIT:?}; invocations: {entries:?}{report}\n\
                 worker 1:\n{}\nworker 2:\n{}",
                log.count(gate),
                stack.worker_log(0),
                stack.worker_log(1),
            );
        }
    }
    let mut interrupts = Vec::new();
    for (agent, session) in plan.iter().filter(|(a, _)| *a == "Approvals") {
        let interrupt = wait_for_agent_snapshot_within(
            &stack.sessions(agent),
            session,
            "approval",
            TURN_WAIT,
            |s| s.pending_interrupts.first().cloned(),
        )
        .await;
        interrupts.push((session.clone(), interrupt));
    }
    let old = built("scripted-runner");
    let (v2, new) = write_variant(&stack, "scripted-runner", "v2");
    let v2 = v2.to_string_lossy().into_owned();
    for agent in ["Models", "Tools", "Approvals"] {
        let activation = activate(&stack, agent, &["--runner", &v2, "--reason", "v2"]);
        assert_eq!(activation["digest"], json!(new), "{activation}");
        assert_eq!(activation["actor"], json!("test"));
    }
    let activated = Instant::now();
    stack.gate("model-hold").release();
    stack.gate("tool-hold").release();
    for (session, interrupt) in &interrupts {
        stack
            .sessions("Approvals")
            .resolve_interrupt(
                session,
                ResolveInterruptRequest {
                    interrupt_id: interrupt.interrupt_id.clone(),
                    approved: true,
                    rejection_message: None,
                },
            )
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }
    for (agent, session) in &plan {
        let done = wait_for_turns_within(&stack.sessions(agent), session, 1, TURN_WAIT).await;
        let state = done.state.unwrap_or_else(|| panic!("{session}: no state"));
        assert_eq!(state.last_turn_error, None, "{session}: the turn failed");
        assert_eq!(state.runner_digest, None, "no pin between turns");
    }
    // The first turn begun after the activation (plus the promised second)
    // takes the new version, whichever worker runs it.
    let pickup = Duration::from_secs(1).saturating_sub(activated.elapsed());
    tokio::time::sleep(pickup).await;
    for (agent, session) in &plan {
        stack
            .sessions(agent)
            .send_user_message(session, "again")
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }
    for (agent, session) in &plan {
        let done = wait_for_turns_within(&stack.sessions(agent), session, 2, TURN_WAIT).await;
        let state = done.state.unwrap_or_else(|| panic!("{session}: no state"));
        assert_eq!(state.last_turn_error, None, "{session}: turn 2 failed");
        let versions = runner_versions(&stack, agent, session).await;
        assert_eq!(
            versions.get("turn-1"),
            Some(&BTreeSet::from([old.clone()])),
            "{session}: every runner Step of turn 1 ran the old version: {versions:?}"
        );
        assert_eq!(
            versions.get("turn-2"),
            Some(&BTreeSet::from([new.clone()])),
            "{session}: turn 2 ran the new version: {versions:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_call_runs_on_its_deferral_version_after_a_swap_and_a_kill() {
    let agent = gated_agent("Swap", "swap-gate", Some(true));
    let mut stack = AgentTestStack::new(vec![agent]);
    let first = stack.start_worker();
    let sessions = stack.sessions("Swap");
    sessions.start_session("s1", "go").await.unwrap();
    // Deferred (ToolCallsRequested committed), waiting for its approval.
    let interrupt =
        wait_for_agent_snapshot_within(&sessions, "s1", "the approval", TURN_WAIT, |s| {
            s.pending_interrupts.first().cloned()
        })
        .await;
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    let old = built("gate-tool");
    assert_eq!(snapshot.tool_calls[0].digest.as_deref(), Some(old.as_str()));
    assert_eq!(
        snapshot.tool_calls[0].component.as_deref(),
        Some("gate-tool")
    );
    let (v2, new) = write_variant(&stack, "gate-tool", "v2");
    let spec = format!("gate-tool={}", v2.display());
    let activation = activate(&stack, "Swap", &["--tool", &spec]);
    assert_eq!(activation["digest"], json!(new));
    tokio::time::sleep(Duration::from_millis(600)).await;
    sessions
        .resolve_interrupt(
            "s1",
            ResolveInterruptRequest {
                interrupt_id: interrupt.interrupt_id,
                approved: true,
                rejection_message: None,
            },
        )
        .await
        .unwrap();
    // The first attempt runs; the worker dies inside it; another worker
    // retries it.
    stack.gate("swap-gate").wait_until_reached().await;
    stack.kill_worker(first);
    stack.gate("swap-gate").release();
    stack.start_worker();
    let done = wait_for_turns_within(&sessions, "s1", 1, TURN_WAIT).await;
    assert_eq!(done.state.and_then(|s| s.last_turn_error), None);
    assert_eq!(stack.invocations().count("swap-gate"), 2, "it ran again");
    let history = stack.read_step_history("s1").await;
    let tool_versions: BTreeSet<&str> = history
        .iter()
        .filter(|e| e.step_type == step::CALL_TOOL)
        .filter_map(|e| e.component.as_deref())
        .collect();
    assert_eq!(tool_versions, BTreeSet::from([old.as_str()]), "{history:?}");
    // The next deferral takes the new version.
    sessions.send_user_message("s1", "again").await.unwrap();
    let pending =
        wait_for_agent_snapshot_within(&sessions, "s1", "the second approval", TURN_WAIT, |s| {
            s.tool_calls
                .first()
                .filter(|c| c.turn_id == "turn-2")
                .cloned()
        })
        .await;
    assert_eq!(pending.digest.as_deref(), Some(new.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_killed_before_its_log_entry_is_absent_and_no_step_runs_an_unknown_version() {
    let agent = KitAgent::scripted("Kill", json!({"turns": [{"steps": [{"text": "hi"}]}]}));
    let mut stack = AgentTestStack::new(vec![agent]);
    stack.start_worker();
    let sessions = stack.sessions("Kill");
    sessions.start_session("s1", "go").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 1, TURN_WAIT).await;
    let before = log_len(&stack, "Kill").await;
    let (v2, new) = write_variant(&stack, "scripted-runner", "v2");
    let (mut child, _) = paused_cli(
        &stack,
        &[
            "agent",
            "activate",
            "Kill",
            "--runner",
            &v2.to_string_lossy(),
        ],
        "activation-pause",
    )
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    // Added, verified, but not active: the log did not change.
    assert_eq!(log_len(&stack, "Kill").await, before);
    let added = stack.deployment.catalog.component(&new).await.unwrap();
    assert!(added.is_some(), "the add committed before the kill");
    sessions.send_user_message("s1", "again").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 2, TURN_WAIT).await;
    let versions = runner_versions(&stack, "Kill", "s1").await;
    assert_eq!(
        versions.get("turn-2"),
        Some(&BTreeSet::from([built("scripted-runner")]))
    );
    // Activated for real, by digest this time.
    activate(&stack, "Kill", &["--runner", &new]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    sessions.send_user_message("s1", "third").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 3, TURN_WAIT).await;
    let versions = runner_versions(&stack, "Kill", "s1").await;
    assert_eq!(versions.get("turn-3"), Some(&BTreeSet::from([new.clone()])));
    // Every version any Step ran is in the registry.
    let registry: BTreeSet<String> = stack
        .deployment
        .catalog
        .list_components()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.digest)
        .collect();
    for entry in stack.read_step_history("s1").await {
        if let Some(component) = &entry.component {
            assert!(
                registry.contains(component),
                "{entry:?} ran an unknown version"
            );
        }
    }
    // A rollback decided on the log and paused before it appends, while
    // another activation lands: refused, rather than undo the version it
    // never saw.
    let (v3, newest) = write_variant(&stack, "scripted-runner", "v3");
    let (rollback, pause) =
        paused_cli(&stack, &["agent", "rollback", "Kill"], "rollback-pause").await;
    activate(&stack, "Kill", &["--runner", &v3.to_string_lossy()]);
    let before = log_len(&stack, "Kill").await;
    std::fs::write(&pause, b"").unwrap();
    let out = rollback.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("changed meanwhile"),
        "the rollback went through: {stderr}"
    );
    let log = stack
        .deployment
        .catalog
        .activations(Some("Kill"))
        .await
        .unwrap();
    assert_eq!(log.len(), before);
    assert_eq!(log.last().map(|a| a.digest.as_str()), Some(newest.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_serves_new_turns_the_old_version_and_upgrade_in_flight_moves_open_turns() {
    // Each turn defers one gated tool call, so a test can hold it between
    // its two RunModels.
    let agent = gated_agent("Roll", "roll-gate", None);
    let mut stack = AgentTestStack::new(vec![agent]);
    stack.start_worker();
    wait_for_bootstrap(&stack, "Roll").await;
    let sessions = stack.sessions("Roll");
    let v1 = built("scripted-runner");
    let (v2, new) = write_variant(&stack, "scripted-runner", "v2");
    activate(&stack, "Roll", &["--runner", &v2.to_string_lossy()]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // A turn on v2, held inside its tool call.
    sessions.start_session("held", "go").await.unwrap();
    stack.gate("roll-gate").wait_until_reached().await;
    let pinned = sessions.get_agent_snapshot("held").await.unwrap();
    assert_eq!(
        pinned.state.and_then(|s| s.runner_digest),
        Some(new.clone())
    );
    let rolled = dexa_cli(&stack, &["agent", "rollback", "Roll"], &[]).json();
    assert_eq!(rolled["digest"], json!(v1));
    tokio::time::sleep(Duration::from_millis(600)).await;
    stack.gate("roll-gate").release();
    wait_for_turns_within(&sessions, "held", 1, TURN_WAIT).await;
    let held = runner_versions(&stack, "Roll", "held").await;
    assert_eq!(
        held.get("turn-1"),
        Some(&BTreeSet::from([new.clone()])),
        "it finished on v2"
    );
    sessions.start_session("fresh", "go").await.unwrap();
    wait_for_turns_within(&sessions, "fresh", 1, TURN_WAIT).await;
    let fresh = runner_versions(&stack, "Roll", "fresh").await;
    assert_eq!(fresh.get("turn-1"), Some(&BTreeSet::from([v1.clone()])));

    // Forward fix: v2 again, a turn held on it, then a rollback that moves
    // turns in flight.
    std::fs::remove_file(stack.gates_dir().join("roll-gate.release")).unwrap();
    std::fs::remove_file(stack.gates_dir().join("roll-gate.reached")).unwrap();
    activate(&stack, "Roll", &["--runner", &new]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    sessions.start_session("moved", "go").await.unwrap();
    stack.gate("roll-gate").wait_until_reached().await;
    let moved = dexa_cli(
        &stack,
        &[
            "agent",
            "rollback",
            "Roll",
            "--upgrade-in-flight",
            "--reason",
            "v2 is broken",
        ],
        &[],
    )
    .json();
    assert_eq!(moved["digest"], json!(v1));
    assert_eq!(moved["upgrade_in_flight"], json!(true));
    // A plain activation after the fix does not undo it: the held turn
    // still leaves v2, for the version its session takes now.
    let (v3, newest) = write_variant(&stack, "scripted-runner", "v3");
    activate(&stack, "Roll", &["--runner", &v3.to_string_lossy()]);
    let versions = dexa_cli(&stack, &["agent", "versions", "Roll"], &[]).json();
    assert!(
        versions["roles"]["runner"]["moving_off"]
            .as_array()
            .is_some_and(|m| m.contains(&json!(new)) && !m.contains(&json!(newest))),
        "{versions}"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    stack.gate("roll-gate").release();
    wait_for_turns_within(&sessions, "moved", 1, TURN_WAIT).await;
    let (run_models, history) = run_model_versions(&stack, "moved").await;
    assert_eq!(run_models, vec![new.clone(), newest.clone()], "{history:?}");
    let hops = version_hops(&sessions, "moved").await;
    assert_eq!(hops.len(), 1, "{hops:?}");
    assert_eq!(hops[0]["from"], json!(new));
    assert_eq!(hops[0]["to"], json!(newest));
    assert!(
        hops[0]["why"]
            .as_str()
            .is_some_and(|w| w.contains("v2 is broken")),
        "{hops:?}"
    );
}

/// The runner versions session `id`'s RunModel Steps ran, in order, and
/// the Step history they were read from (for messages).
async fn run_model_versions(
    stack: &AgentTestStack,
    id: &str,
) -> (Vec<String>, Vec<dexa::flow::StepHistoryEntry>) {
    let history = stack.read_step_history(id).await;
    let versions = history
        .iter()
        .filter(|e| e.step_type == step::RUN_MODEL)
        .filter_map(|e| e.component.clone())
        .collect();
    (versions, history)
}

/// The data of session `id`'s `version_changed` events.
async fn version_hops(sessions: &dexa::session::AgentSessionClient, id: &str) -> Vec<Value> {
    all_events(sessions, id)
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::VERSION_CHANGED)
        .map(|e| e.data)
        .collect()
}

/// SIGTERM to worker `index`, as an operator stops it, and its exit.
async fn stop_worker(stack: &mut AgentTestStack, index: usize) {
    stack.worker(index).terminate();
    assert!(
        stack
            .worker(index)
            .wait_for_exit(Duration::from_secs(60))
            .await
            .is_some(),
        "the worker did not stop"
    );
}

/// The approval a session's turn waits for.
async fn pending_approval(
    sessions: &dexa::session::AgentSessionClient,
    id: &str,
) -> dexa::session::AgentInterrupt {
    wait_for_agent_snapshot_within(sessions, id, "the approval", TURN_WAIT, |s| {
        s.pending_interrupts.first().cloned()
    })
    .await
}

/// Approves the one pending approval of session `id`.
async fn approve(sessions: &dexa::session::AgentSessionClient, id: &str) {
    let interrupt = pending_approval(sessions, id).await;
    sessions
        .resolve_interrupt(
            id,
            ResolveInterruptRequest {
                interrupt_id: interrupt.interrupt_id,
                approved: true,
                rejection_message: None,
            },
        )
        .await
        .unwrap();
}

/// Pins the turn in flight of session `id` to runner version `digest`, as
/// the host that started the turn would have.
async fn pin_turn(stack: &AgentTestStack, id: &str, digest: &str) {
    let digest = digest.to_string();
    stack
        .deployment
        .store
        .rpc(
            id,
            Box::new(move |tx| {
                let stored = tx.get(AGENT_STATE, "")?.expect("the session's state");
                let mut state: AgentState = serde_json::from_value(stored.value).unwrap();
                assert!(state.runner_digest.is_some(), "no turn in flight");
                state.runner_digest = Some(digest);
                tx.set(AGENT_STATE, "", serde_json::to_value(&state).unwrap())?;
                Ok(Box::new(()))
            }),
        )
        .await
        .unwrap();
}

/// The upgrade path of docs/guest-authors.md ("Upgrading a component to a
/// new WIT version"), end to end, with real workers. Turns in flight are
/// pinned to a runner built against `dex:agents@0.1.0`, which this host
/// refuses to load:
/// - skipping the activation, such a turn fails at its next RunModel, with
///   the message naming both versions and the guide;
/// - following the guide (stop the worker, activate the rebuilt runner with
///   `--upgrade-in-flight`, start a worker), the turn finishes on the
///   rebuilt runner, a `version_changed` records the move, its tool call
///   runs once, and new turns take the rebuilt runner.
///
/// One binary plays both hosts: what the older host left in the store (its
/// build in the catalog and the log, the turns pinned to it) is written
/// through the store's own interfaces while no worker runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_pinned_to_a_runner_of_the_old_wit_finishes_on_the_rebuilt_one_after_the_documented_upgrade(
) {
    let agent = gated_agent("Upgrade", "upgrade-gate", Some(true));
    let mut stack = AgentTestStack::new(vec![agent]);
    stack.gate("upgrade-gate").release();
    let first = stack.start_worker();
    wait_for_bootstrap(&stack, "Upgrade").await;
    let sessions = stack.sessions("Upgrade");
    // Each turn waits for an approval between its two RunModels.
    for id in ["skipped", "held"] {
        sessions.start_session(id, "go").await.unwrap();
        pending_approval(&sessions, id).await;
    }

    // 2. Stop the workers (nothing runs: the turns wait in the store).
    stop_worker(&mut stack, first).await;

    // What the older host left: its runner build (against 0.1.0), added and
    // activated, and the turns pinned to it.
    let old_bytes = versions::built_against(&guest_bytes("scripted-runner"), "0.1.0");
    let old = digest_of(&old_bytes);
    let old_path = stack.dir.path().join("scripted-runner-0.1.0.wasm");
    std::fs::write(&old_path, &old_bytes).unwrap();
    let refused = dexa_cli(
        &stack,
        &["component", "add", &old_path.to_string_lossy()],
        &[],
    );
    assert!(
        !refused.success,
        "this host added a 0.1.0 build: {refused:?}"
    );
    for part in [
        "dex:agents@0.1.0",
        "Upgrading a component to a new WIT version",
    ] {
        assert!(refused.stderr.contains(part), "{part:?}: {refused:?}");
    }
    let catalog = &stack.deployment.catalog;
    catalog
        .add_component(
            ComponentRecord {
                digest: old.clone(),
                world: "runner".into(),
                wit_package: "dex:agents@0.1.0".into(),
                tools: Vec::new(),
                size: old_bytes.len() as u64,
                added_at: 0,
                added_by: "the older host".into(),
            },
            old_bytes,
        )
        .await
        .unwrap();
    catalog
        .activate(
            NewActivation {
                agent: "Upgrade".into(),
                role: "runner".into(),
                digest: old.clone(),
                mode: ActivationMode::Current,
                upgrade_in_flight: false,
                actor: "the older host".into(),
                reason: String::new(),
                after_seq: None,
            },
            ActivateIf::Always,
        )
        .await
        .unwrap();
    pin_turn(&stack, "skipped", &old).await;
    pin_turn(&stack, "held", &old).await;

    // Skipping step 3: the new host cannot run the pinned build; the turn
    // fails with the way out in its error.
    let control = stack.start_worker();
    approve(&sessions, "skipped").await;
    let failed = wait_for_turns_within(&sessions, "skipped", 1, TURN_WAIT).await;
    let error = failed
        .state
        .and_then(|s| s.last_turn_error)
        .expect("the turn on the 0.1.0 build failed");
    for part in [
        "dex:agents@0.1.0",
        WIT_PACKAGE,
        "Upgrading a component to a new WIT version",
    ] {
        assert!(error.contains(part), "{part:?} missing from: {error}");
    }
    stop_worker(&mut stack, control).await;

    // 3. With the new binary, activate the rebuilt runner, moving turns in
    // flight; 4. start the workers.
    let (rebuilt_path, rebuilt) = write_variant(&stack, "scripted-runner", "rebuilt");
    let activation = activate(
        &stack,
        "Upgrade",
        &[
            "--runner",
            &rebuilt_path.to_string_lossy(),
            "--upgrade-in-flight",
            "--reason",
            "rebuilt against 0.2.0",
        ],
    );
    assert_eq!(activation["digest"], json!(rebuilt));
    stack.start_worker();
    approve(&sessions, "held").await;
    let done = wait_for_turns_within(&sessions, "held", 1, TURN_WAIT).await;
    assert_eq!(done.state.and_then(|s| s.last_turn_error), None);
    let (run_models, history) = run_model_versions(&stack, "held").await;
    assert_eq!(
        run_models,
        vec![built("scripted-runner"), rebuilt.clone()],
        "the first RunModel ran before the turn was pinned to the old build, \
         the second on the rebuilt one: {history:?}"
    );
    let hops = version_hops(&sessions, "held").await;
    assert_eq!(hops.len(), 1, "{hops:?}");
    assert_eq!(hops[0]["from"], json!(old));
    assert_eq!(hops[0]["to"], json!(rebuilt));
    // The gated tool call ran once in each session: approved, it ran before
    // the next RunModel; nothing ran twice across the restarts.
    assert_eq!(
        stack.invocations().count("upgrade-gate"),
        2,
        "one per session"
    );
    // New turns take the rebuilt runner.
    sessions.start_session("fresh", "go").await.unwrap();
    let pinned =
        wait_for_agent_snapshot_within(&sessions, "fresh", "the new turn's pin", TURN_WAIT, |s| {
            s.state.as_ref().and_then(|s| s.runner_digest.clone())
        })
        .await;
    assert_eq!(pinned, rebuilt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_activations_name_the_digest_and_the_reason_and_leave_the_active_version() {
    let agent = KitAgent::scripted("Refuse", json!({"turns": [{"steps": [{"text": "hi"}]}]}))
        .tool("gate-tool")
        .tool("echo-tool");
    // The echo-tool role's settings make the hostile tool's list-tools trap.
    let mut stack = AgentTestStack::with_config(|_| {
        render_config(&[agent], &KitSettings::default()).replace(
            "[components.echo-tool]\n",
            "[components.echo-tool]\nconfig = { trap_in_list_tools = \"true\" }\n",
        )
    });
    stack.start_worker();
    let sessions = stack.sessions("Refuse");
    sessions.start_session("s1", "go").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 1, TURN_WAIT).await;
    let before = log_len(&stack, "Refuse").await;
    let garbage = stack.dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm\x0d\0\x01\0 not a component").unwrap();
    let hostile = dexa_tests::guest_wasm("hostile-tool");
    let gate_tool = dexa_tests::guest_wasm("gate-tool");
    let cases = [
        (
            vec!["--runner".to_string(), garbage.display().to_string()],
            digest_of(&std::fs::read(&garbage).unwrap()),
            "is not a valid WebAssembly component",
        ),
        (
            vec!["--runner".to_string(), gate_tool.display().to_string()],
            built("gate-tool"),
            "does not implement world `dex:agents/runner@0.2.0`",
        ),
        (
            vec![
                "--tool".to_string(),
                format!("echo-tool={}", hostile.display()),
            ],
            built("hostile-tool"),
            "hostile list-tools traps on purpose",
        ),
        (
            vec![
                "--tool".to_string(),
                format!("echo-tool={}", gate_tool.display()),
            ],
            built("gate-tool"),
            "is also served by tool component \"gate-tool\"",
        ),
    ];
    for (args, digest, reason) in cases {
        let mut all = vec!["agent", "activate", "Refuse"];
        all.extend(args.iter().map(String::as_str));
        let out = dexa_cli(&stack, &all, &[]);
        assert!(!out.success, "{args:?} was activated: {out:?}");
        assert!(
            out.stderr.contains(&digest) && out.stderr.contains(reason),
            "{args:?}: expected {digest} and {reason:?} in {out:?}"
        );
    }
    // A tool call keeps its deferral version: there is nothing in flight to
    // move for a tool component.
    let same_tool = format!("gate-tool={}", gate_tool.display());
    let out = dexa_cli(
        &stack,
        &[
            "agent",
            "activate",
            "Refuse",
            "--tool",
            &same_tool,
            "--upgrade-in-flight",
        ],
        &[],
    );
    assert!(
        !out.success && out.stderr.contains("has no turns to move"),
        "{out:?}"
    );
    assert_eq!(
        log_len(&stack, "Refuse").await,
        before,
        "the log is unchanged"
    );
    sessions.send_user_message("s1", "again").await.unwrap();
    let done = wait_for_turns_within(&sessions, "s1", 2, TURN_WAIT).await;
    assert_eq!(done.state.and_then(|s| s.last_turn_error), None);
    let versions = runner_versions(&stack, "Refuse", "s1").await;
    assert_eq!(
        versions.get("turn-2"),
        Some(&BTreeSet::from([built("scripted-runner")]))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_percent_ramp_over_a_thousand_sessions_lands_within_three_points() {
    let agent = KitAgent::scripted("Ramp", json!({"turns": [{"steps": [{"text": "hi"}]}]}));
    let mut stack = AgentTestStack::new(vec![agent]);
    let (_, new) = write_variant(&stack, "scripted-runner", "v2");
    let old = built("scripted-runner");
    stack.start_worker();
    stack.start_worker();
    let sessions = stack.sessions("Ramp");
    // The first worker start activated the config's version; ramp v2.
    sessions.start_session("warm", "go").await.unwrap();
    wait_for_turns_within(&sessions, "warm", 1, TURN_WAIT).await;
    let v2 = stack.dir.path().join("scripted-runner-v2.wasm");
    let ramp = activate(
        &stack,
        "Ramp",
        &["--runner", &v2.to_string_lossy(), "--ramp", "10"],
    );
    assert_eq!(ramp["mode"], json!("ramp"));
    assert_eq!(ramp["percent"], json!(10));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let ids: Vec<String> = (0..1000).map(|n| format!("r{n}")).collect();
    for id in &ids {
        sessions.start_session(id, "one").await.unwrap();
    }
    for id in &ids {
        wait_for_turns_within(&sessions, id, 1, TURN_WAIT).await;
        sessions.send_user_message(id, "two").await.unwrap();
    }
    let mut on_new = 0;
    for id in &ids {
        wait_for_turns_within(&sessions, id, 2, TURN_WAIT).await;
        let history = stack.read_step_history(id).await;
        let ran: BTreeSet<&str> = history
            .iter()
            .filter(|e| runs_runner(&e.step_type))
            .filter_map(|e| e.component.as_deref())
            .collect();
        assert_eq!(
            ran.len(),
            1,
            "{id} kept one version across its turns: {ran:?}"
        );
        if ran.contains(new.as_str()) {
            on_new += 1;
        } else {
            assert!(ran.contains(old.as_str()), "{id}: {ran:?}");
        }
    }
    assert!(
        (70..=130).contains(&on_new),
        "{on_new} of 1000 sessions on a 10 % ramp"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_every_version_in_use_and_every_step_ran_its_pin() {
    let agent = gated_agent("Gc", "gc-gate", None);
    let mut stack = AgentTestStack::new(vec![agent]);
    stack.start_worker();
    stack.start_worker();
    wait_for_bootstrap(&stack, "Gc").await;
    let sessions = stack.sessions("Gc");
    // Three runner versions and two tool versions, each with sessions
    // started on it; the sessions of v2 stay held inside their tool call.
    let mut runners = vec![built("scripted-runner")];
    let mut started = Vec::new();
    for (n, tag) in ["v2", "v3"].iter().enumerate() {
        let (path, digest) = write_variant(&stack, "scripted-runner", tag);
        activate(&stack, "Gc", &["--runner", &path.to_string_lossy()]);
        if n == 0 {
            let (tool, _) = write_variant(&stack, "gate-tool", "t2");
            let spec = format!("gate-tool={}", tool.display());
            activate(&stack, "Gc", &["--tool", &spec]);
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
        for s in 0..3 {
            let id = format!("{tag}-{s}");
            sessions.start_session(&id, "go").await.unwrap();
            started.push(id);
        }
        runners.push(digest);
        if n == 0 {
            stack.invocations().wait_for_count("gc-gate", 3).await;
            // Held: v2 and the tool version t2 are in use; v3 replaces v2.
        }
    }
    let removable = write_variant(&stack, "scripted-runner", "unused").1;
    dexa_cli(
        &stack,
        &[
            "component",
            "add",
            &stack
                .dir
                .path()
                .join("scripted-runner-unused.wasm")
                .to_string_lossy(),
        ],
        &[],
    )
    .json();
    let gc = dexa_cli(&stack, &["component", "gc", "--grace-secs", "0"], &[]).json();
    let removed: Vec<String> = serde_json::from_value(gc["removed"].clone()).unwrap();
    let kept: BTreeMap<String, String> = serde_json::from_value(gc["kept"].clone()).unwrap();
    assert!(removed.contains(&removable), "{gc}");
    assert!(
        kept.get(&runners[1])
            .is_some_and(|why| why.contains("open turn")),
        "v2 is pinned by the held turns: {gc}"
    );
    assert!(kept.contains_key(&runners[2]), "v3 is active: {gc}");
    assert!(!removed.contains(&runners[1]) && !removed.contains(&runners[2]));
    stack.gate("gc-gate").release();
    for id in &started {
        let done = wait_for_turns_within(&sessions, id, 1, TURN_WAIT).await;
        assert_eq!(done.state.and_then(|s| s.last_turn_error), None, "{id}");
    }
    // Every Step ran its pin: a turn's runner Steps the turn_started pin, a
    // tool call's Steps the version its deferral recorded.
    let registry: BTreeSet<String> = stack
        .deployment
        .catalog
        .list_components()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.digest)
        .collect();
    for id in &started {
        let history = stack.read_step_history(id).await;
        let events = all_events(&sessions, id).await;
        let turn_pin = events
            .iter()
            .find(|e| e.event_type == event_type::TURN_STARTED)
            .and_then(|e| e.data["runner"].as_str())
            .unwrap_or_else(|| panic!("{id}: no pinned turn_started"));
        let call_pin = events
            .iter()
            .find(|e| e.event_type == event_type::TOOL_CALL_DEFERRED)
            .and_then(|e| e.data["digest"].as_str())
            .unwrap_or_else(|| panic!("{id}: no pinned deferral"));
        for entry in &history {
            let Some(ran) = entry.component.as_deref() else {
                continue;
            };
            assert!(
                registry.contains(ran),
                "{id}: {entry:?} ran a removed version"
            );
            if entry.step_type == step::CALL_TOOL {
                assert_eq!(ran, call_pin, "{id}: {entry:?}");
            } else {
                assert_eq!(ran, turn_pin, "{id}: {entry:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_version_whose_bytes_are_missing_fails_its_step_and_runs_nothing_else() {
    let agent = gated_agent("Missing", "missing-gate", None);
    let mut stack = AgentTestStack::new(vec![agent]);
    let first = stack.start_worker();
    wait_for_bootstrap(&stack, "Missing").await;
    let sessions = stack.sessions("Missing");
    let (v2, new) = write_variant(&stack, "scripted-runner", "v2");
    activate(&stack, "Missing", &["--runner", &v2.to_string_lossy()]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("missing-gate").wait_until_reached().await;
    // The bytes go (as a broken store or a bad manual edit would do it)
    // while the version is still active, and the worker that had it loaded
    // dies. A new worker still starts: only the turns that take the version
    // fail, with the digest named.
    stack
        .deployment
        .catalog
        .remove_components(std::slice::from_ref(&new), i64::MAX)
        .await
        .unwrap();
    stack.kill_worker(first);
    stack.start_worker();
    sessions.start_session("s2", "go").await.unwrap();
    let refused = wait_for_turns_within(&sessions, "s2", 1, TURN_WAIT).await;
    let error = refused
        .state
        .and_then(|s| s.last_turn_error)
        .unwrap_or_else(|| panic!("a new turn on the missing version should fail"));
    assert!(
        error.contains(&new) && error.contains("not in the registry"),
        "{error}"
    );
    // With v1 active again, the turn pinned to v2 still fails rather than
    // fall back to it.
    dexa_cli(&stack, &["agent", "rollback", "Missing"], &[]).json();
    stack.gate("missing-gate").release();
    let done = wait_for_turns_within(&sessions, "s1", 1, TURN_WAIT).await;
    let error = done
        .state
        .and_then(|s| s.last_turn_error)
        .unwrap_or_else(|| panic!("the turn should fail"));
    assert!(
        error.contains(&new) && error.contains("not in the registry"),
        "{error}"
    );
    let history = stack.read_step_history("s1").await;
    let v1 = built("scripted-runner");
    assert!(
        history
            .iter()
            .filter(|e| e.step_type == step::RUN_MODEL)
            .all(|e| e.component.as_deref() != Some(v1.as_str())),
        "no RunModel of the turn fell back to v1: {history:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_file_is_activated_when_it_changes_and_an_explicit_activation_stands_until_then()
{
    let agent = KitAgent::scripted("Boot", json!({"turns": [{"steps": [{"text": "hi"}]}]}));
    let mut stack = AgentTestStack::new(vec![agent]);
    let first = stack.start_worker();
    let sessions = stack.sessions("Boot");
    sessions.start_session("s1", "go").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 1, TURN_WAIT).await;
    let log = stack
        .deployment
        .catalog
        .activations(Some("Boot"))
        .await
        .unwrap();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].actor, "config");
    assert_eq!(log[0].digest, built("scripted-runner"));
    let (v2, new) = write_variant(&stack, "scripted-runner", "v2");
    activate(&stack, "Boot", &["--runner", &v2.to_string_lossy()]);
    // A restart with the same file keeps the explicit activation.
    stack.kill_worker(first);
    let second = stack.start_worker();
    sessions.send_user_message("s1", "again").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 2, TURN_WAIT).await;
    assert_eq!(log_len(&stack, "Boot").await, 2);
    let versions = runner_versions(&stack, "Boot", "s1").await;
    assert_eq!(versions.get("turn-2"), Some(&BTreeSet::from([new.clone()])));
    // A new file in dexa.toml wins, recorded as the config's.
    let (v3, newest) = write_variant(&stack, "scripted-runner", "v3");
    let config = std::fs::read_to_string(&stack.config_path).unwrap();
    let runner_path = dexa_tests::guest_wasm("scripted-runner")
        .display()
        .to_string();
    assert!(config.contains(&runner_path));
    std::fs::write(
        &stack.config_path,
        config.replace(&runner_path, &v3.display().to_string()),
    )
    .unwrap();
    stack.kill_worker(second);
    let on_v3 = stack.start_worker();
    sessions.send_user_message("s1", "third").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 3, TURN_WAIT).await;
    let log = stack
        .deployment
        .catalog
        .activations(Some("Boot"))
        .await
        .unwrap();
    assert_eq!(log.len(), 3, "{log:?}");
    assert_eq!(
        (log[2].actor.as_str(), log[2].digest.as_str()),
        ("config", newest.as_str())
    );
    let versions = runner_versions(&stack, "Boot", "s1").await;
    assert_eq!(
        versions.get("turn-3"),
        Some(&BTreeSet::from([newest.clone()]))
    );
    // A worker that restarts on the older dexa.toml (a rolling deploy not
    // yet done) does not bring the older file back. It is the only worker,
    // so the next turn ends only after its start.
    std::fs::write(&stack.config_path, &config).unwrap();
    stack.kill_worker(on_v3);
    stack.start_worker();
    sessions.send_user_message("s1", "fourth").await.unwrap();
    wait_for_turns_within(&sessions, "s1", 4, TURN_WAIT).await;
    assert_eq!(log_len(&stack, "Boot").await, 3);
    let versions = runner_versions(&stack, "Boot", "s1").await;
    assert_eq!(versions.get("turn-4"), Some(&BTreeSet::from([newest])));
}

/// At a first start, a worker may claim Steps while another worker is
/// still activating `dexa.toml`'s files; its view of the activation log is
/// up to `ActivationWatch::REFRESH` old. A Step that needs a role its view
/// lacks reads the log anew instead of failing its turn (before, a turn
/// taken then failed with "no active version of its gate-tool").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_activated_a_moment_ago_is_found_not_missing() {
    use dexa::catalog::{
        ActivateIf, ActivationMode, CatalogStore, ComponentRecord, NewActivation, RUNNER_ROLE,
    };
    use dexa::session::ActivationWatch;
    use dexa::store::sqlite::{SqliteOptions, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let catalog: std::sync::Arc<dyn CatalogStore> = std::sync::Arc::new(
        SqliteStore::open(dir.path().join("catalog.sqlite"), SqliteOptions::default()).unwrap(),
    );
    let watch = ActivationWatch::new(catalog.clone());
    let started = Instant::now();
    assert!(watch
        .current()
        .await
        .unwrap()
        .role("A", RUNNER_ROLE)
        .is_none());
    catalog
        .add_component(
            ComponentRecord {
                digest: "d1".into(),
                world: "runner".into(),
                wit_package: "dex:agents@0.2.0".into(),
                tools: Vec::new(),
                size: 3,
                added_at: 0,
                added_by: "test".into(),
            },
            b"abc".to_vec(),
        )
        .await
        .unwrap();
    catalog
        .activate(
            NewActivation {
                agent: "A".into(),
                role: RUNNER_ROLE.into(),
                digest: "d1".into(),
                mode: ActivationMode::Current,
                upgrade_in_flight: false,
                actor: "other-worker".into(),
                reason: String::new(),
                after_seq: None,
            },
            ActivateIf::Always,
        )
        .await
        .unwrap();
    let cached = watch.current().await.unwrap();
    if started.elapsed() < ActivationWatch::REFRESH {
        assert!(
            cached.role("A", RUNNER_ROLE).is_none(),
            "the view is cached"
        );
    }
    let states = watch.current_with("A", &[RUNNER_ROLE]).await.unwrap();
    assert_eq!(
        states
            .role("A", RUNNER_ROLE)
            .and_then(|role| role.current.as_deref()),
        Some("d1")
    );
}
