//! The Flow engine's conformance suite. Every test takes a store factory and
//! runs against every backend (`backends!` at the bottom).

use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dexa::flow::history::{ATTEMPT_FAILED, EXECUTE_COMPLETED, EXECUTE_FAILED, REDELIVERED};
use dexa::flow::store::{AttemptFailure, FailureAction, StepCommit};
use dexa::flow::{
    FlowClient, FlowCursor, FlowStatus, FlowStore, Json, MapQuery, NewTask, RetryPolicy, RpcError,
    StepHistoryEntry, StoreError, Worker, WorkerOptions,
};
use dexa_tests::toy::{
    toy_registry, wait_until, PostgresFactory, Probe, SqliteFactory, StoreFactory,
};
use serde_json::json;

const PATIENCE: Duration = Duration::from_secs(20);

/// A client, an in-process worker and the probe, on a fresh store.
struct Stack {
    _dir: tempfile::TempDir,
    store: Arc<dyn FlowStore>,
    client: FlowClient,
    probe: Arc<Probe>,
    worker: Option<tokio::task::JoinHandle<()>>,
}

impl Stack {
    fn new(factory: &dyn StoreFactory) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = factory.open(dir.path());
        let probe = Probe::new(Some(dir.path().to_path_buf()));
        let registry = Arc::new(toy_registry(probe.clone()));
        let client = FlowClient::new(store.clone(), registry);
        Self {
            _dir: dir,
            store,
            client,
            probe,
            worker: None,
        }
    }

    fn start_worker(&mut self) {
        self.start_worker_with_slots(WorkerOptions::default().max_concurrent_tasks);
    }

    fn start_worker_with_slots(&mut self, slots: usize) {
        let options = WorkerOptions {
            lease: Duration::from_millis(500),
            reap_interval: Duration::from_millis(50),
            max_concurrent_tasks: slots,
            ..WorkerOptions::default()
        };
        let worker = Worker::new(self.store.clone(), self.client.registry().clone(), options);
        self.worker = Some(tokio::spawn(worker.run(std::future::pending())));
    }

    async fn wait_status(&self, flow_id: &str, status: FlowStatus) {
        let client = self.client.clone();
        wait_until(&format!("{flow_id} to be {status:?}"), PATIENCE, || {
            let client = client.clone();
            async move {
                let info = client.flow(flow_id).await.ok().flatten()?;
                (info.status == status).then_some(())
            }
        })
        .await;
    }

    async fn attr(&self, flow_id: &str, name: &str) -> Option<Json> {
        self.store
            .get(flow_id, name, "")
            .await
            .expect("get")
            .map(|v| v.value)
    }

    async fn history(&self, flow_id: &str) -> Vec<StepHistoryEntry> {
        self.client.step_history(flow_id).await.expect("history")
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.abort();
        }
    }
}

/// One task claimed from `stack`'s store, if any was due.
async fn claim_one(
    stack: &Stack,
    worker_id: &str,
    flow_types: &[String],
    lease_ms: i64,
) -> Option<dexa::flow::ClaimedTask> {
    stack
        .store
        .claim(worker_id, flow_types, 1, lease_ms)
        .await
        .expect("claim")
        .pop()
}

fn events(history: &[StepHistoryEntry], step: &str) -> Vec<(String, u32)> {
    history
        .iter()
        .filter(|e| e.step_type == step)
        .map(|e| (e.event_type.clone(), e.final_attempt))
        .collect()
}

async fn retries_then_the_failure_route(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("Retry", "flaky", json!({"next": "Flaky"}))
        .await
        .expect("start");
    stack.wait_status("flaky", FlowStatus::Completed).await;
    let history = stack.history("flaky").await;
    assert_eq!(
        events(&history, "Flaky"),
        vec![
            (ATTEMPT_FAILED.to_string(), 1),
            (ATTEMPT_FAILED.to_string(), 2),
            (EXECUTE_FAILED.to_string(), 3),
        ]
    );
    let flaky_ids: Vec<_> = history
        .iter()
        .filter(|e| e.step_type == "Flaky")
        .map(|e| &e.step_execution_id)
        .collect();
    assert!(
        flaky_ids.windows(2).all(|w| w[0] == w[1]),
        "attempts share one step_execution_id"
    );
    assert_eq!(
        events(&history, "Recover"),
        vec![(EXECUTE_COMPLETED.to_string(), 1)]
    );
    assert_eq!(
        stack.attr("flaky", "recovered").await,
        Some(json!("flaky failure on attempt 3"))
    );
    assert_eq!(stack.probe.runs_of("Flaky"), 3);

    // A retry that succeeds ends the Step normally.
    stack
        .client
        .start_flow(
            "Retry",
            "flaky-2",
            json!({"next": "Flaky", "fail_times": 1}),
        )
        .await
        .expect("start");
    stack.wait_status("flaky-2", FlowStatus::Completed).await;
    assert_eq!(
        stack.attr("flaky-2", "result").await,
        Some(json!("ok on attempt 2"))
    );

    // A fatal error skips the remaining attempts.
    stack
        .client
        .start_flow("Retry", "fatal", json!({"next": "Fatal"}))
        .await
        .expect("start");
    stack.wait_status("fatal", FlowStatus::Completed).await;
    assert_eq!(
        events(&stack.history("fatal").await, "Fatal"),
        vec![(EXECUTE_FAILED.to_string(), 1)]
    );

    // With no failure route, the flow fails and says why.
    stack
        .client
        .start_flow("Retry", "unrouted", json!({"next": "Unrouted"}))
        .await
        .expect("start");
    stack.wait_status("unrouted", FlowStatus::Failed).await;
    let info = stack
        .client
        .flow("unrouted")
        .await
        .expect("flow")
        .expect("exists");
    assert!(
        info.error
            .as_deref()
            .unwrap_or_default()
            .contains("unrouted failure 2"),
        "{info:?}"
    );
}

async fn the_per_attempt_timeout(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("Retry", "slow", json!({"next": "Slow"}))
        .await
        .expect("start");
    stack.wait_status("slow", FlowStatus::Completed).await;
    let history = stack.history("slow").await;
    assert_eq!(
        events(&history, "Slow"),
        vec![
            (ATTEMPT_FAILED.to_string(), 1),
            (EXECUTE_COMPLETED.to_string(), 2)
        ]
    );
    let detail = history
        .iter()
        .find(|e| e.step_type == "Slow")
        .and_then(|e| e.detail.clone())
        .unwrap_or_default();
    assert!(detail.contains("timed out after 200 ms"), "{detail}");
    assert_eq!(
        stack.attr("slow", "result").await,
        Some(json!("ok on attempt 2"))
    );
}

async fn the_heartbeat_timeout(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("Retry", "silent", json!({"next": "Silent"}))
        .await
        .expect("start");
    stack.wait_status("silent", FlowStatus::Completed).await;
    let history = stack.history("silent").await;
    assert_eq!(
        events(&history, "Silent"),
        vec![
            (ATTEMPT_FAILED.to_string(), 1),
            (EXECUTE_COMPLETED.to_string(), 2)
        ]
    );
    let detail = history
        .iter()
        .find(|e| e.step_type == "Silent")
        .and_then(|e| e.detail.clone())
        .unwrap_or_default();
    assert!(detail.contains("no heartbeat for 200 ms"), "{detail}");
    // Attempt 2 ran for about 400 ms, twice the heartbeat timeout, and lived.
    assert_eq!(
        stack.attr("silent", "result").await,
        Some(json!("ok on attempt 2"))
    );
}

async fn go_to_many_runs_eight_steps_at_once(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("FanOut", "fan", json!({}))
        .await
        .expect("start");
    stack.wait_status("fan", FlowStatus::Completed).await;
    assert_eq!(
        stack.attr("fan", "joined").await,
        Some(json!([0, 1, 2, 3, 4, 5, 6, 7]))
    );
    // The barrier let them through only together; the spans agree.
    let spans = stack.probe.leaf_spans.lock().expect("spans").clone();
    assert_eq!(spans.len(), 8);
    let last_start = spans.iter().map(|s| s.0).max().expect("starts");
    let first_end = spans.iter().map(|s| s.1).min().expect("ends");
    assert!(
        last_start <= first_end,
        "every leaf started before any finished"
    );
}

/// A commit leases a share of its fan-out to its own worker, out of the
/// same slots the claim loop takes from: a worker with exactly eight slots
/// still runs eight leaves at once (the barrier lets none through before),
/// twice in a row (the slots came back), and two fan-outs at once never run
/// more than eight leaves together (each leaf stays a while after the
/// barrier, so one started past the slots would be counted).
async fn a_worker_runs_as_many_steps_as_its_slots_and_never_more(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker_with_slots(8);
    for flow in ["fan-1", "fan-2"] {
        stack
            .client
            .start_flow("FanOut", flow, json!({}))
            .await
            .expect("start");
        stack.wait_status(flow, FlowStatus::Completed).await;
    }
    assert_eq!(stack.probe.leaf_spans.lock().expect("spans").len(), 16);

    for flow in ["fan-3", "fan-4"] {
        stack
            .client
            .start_flow("FanOut", flow, json!({}))
            .await
            .expect("start");
    }
    for flow in ["fan-3", "fan-4"] {
        stack.wait_status(flow, FlowStatus::Completed).await;
    }
    assert_eq!(stack.probe.leaf_spans.lock().expect("spans").len(), 32);
    let most = stack.probe.most_running.load(Ordering::SeqCst);
    assert_eq!(most, 8, "leaves at once on a worker of 8 slots");
}

async fn channel_waits_for_one_and_for_n(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    let publish = |flow: &'static str, channel: &'static str, key: &'static str, payload: Json| {
        let client = stack.client.clone();
        async move {
            client
                .rpc(flow, move |tx| {
                    Ok(tx.publish(channel, key, payload.clone())?)
                })
                .await
                .expect("publish")
        }
    };
    stack
        .client
        .start_flow("Inbox", "one", json!({"mode": "one", "expect": 3}))
        .await
        .expect("start");
    for n in 1..=3 {
        publish("one", "inbox", "", json!(n)).await;
    }
    stack.wait_status("one", FlowStatus::Completed).await;
    assert_eq!(stack.attr("one", "received").await, Some(json!([1, 2, 3])));
    assert_eq!(
        stack
            .store
            .channel_len("one", "inbox", "")
            .await
            .expect("len"),
        0,
        "all consumed"
    );

    stack
        .client
        .start_flow("Inbox", "batch", json!({"mode": "batch", "batch": 3}))
        .await
        .expect("start");
    publish("batch", "inbox", "", json!("a")).await;
    publish("batch", "inbox", "", json!("b")).await;
    // Two of three: the Step must not run yet.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(stack.attr("batch", "batch").await, None);
    publish("batch", "inbox", "", json!("c")).await;
    publish("batch", "inbox", "", json!("d")).await;
    stack.wait_status("batch", FlowStatus::Completed).await;
    assert_eq!(
        stack.attr("batch", "batch").await,
        Some(json!(["a", "b", "c"]))
    );
    assert_eq!(
        stack
            .store
            .channel_len("batch", "inbox", "")
            .await
            .expect("len"),
        1,
        "the fourth stays queued"
    );

    stack
        .client
        .start_flow("Inbox", "keyed", json!({"mode": "keyed", "key": "k2"}))
        .await
        .expect("start");
    publish("keyed", "answers", "k1", json!("not mine")).await;
    publish("keyed", "answers", "k2", json!("mine")).await;
    stack.wait_status("keyed", FlowStatus::Completed).await;
    assert_eq!(stack.attr("keyed", "answer").await, Some(json!(["mine"])));
}

async fn timers_fire_and_an_early_timer_waits_again(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow(
            "Sleeper",
            "nap",
            json!({"deadline_ms": 400, "early_ms": 100}),
        )
        .await
        .expect("start");
    stack.wait_status("nap", FlowStatus::Completed).await;
    let deadline = stack
        .attr("nap", "deadline")
        .await
        .and_then(|v| v.as_i64())
        .expect("deadline");
    let woke_at = stack
        .attr("nap", "woke_at")
        .await
        .and_then(|v| v.as_i64())
        .expect("woke");
    assert!(
        woke_at >= deadline,
        "woke at {woke_at}, before the deadline {deadline}"
    );
    assert_eq!(stack.attr("nap", "early_wakes").await, Some(json!(1)));
    let wakes = events(&stack.history("nap").await, "Wake");
    assert_eq!(wakes.len(), 2, "{wakes:?}");
}

async fn streams_trim_to_their_capacity(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .store
        .set_stream_capacity("s", "events", 2_000)
        .await
        .expect("capacity");
    stack
        .client
        .start_flow("Streamer", "s", json!({"count": 60, "size": 90}))
        .await
        .expect("start");
    // Read while it runs, by cursor.
    let store = stack.store.clone();
    let first = wait_until("stream entries", PATIENCE, || {
        let store = store.clone();
        async move {
            let page = store.read_stream("s", "events", 0, 5).await.ok()?;
            (!page.entries.is_empty()).then_some(page)
        }
    })
    .await;
    assert!(first.entries.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    stack.wait_status("s", FlowStatus::Completed).await;
    let page = stack
        .client
        .read_stream("s", "events", 0, 1000)
        .await
        .expect("read");
    assert_eq!(
        page.next_seq, 62,
        "60 live entries and one committed with the Step"
    );
    assert!(page.first_seq > 1, "old entries were trimmed");
    let bytes: usize = page
        .entries
        .iter()
        .map(|e| e.payload.to_string().len())
        .sum();
    assert!(bytes <= 2_000, "{bytes} bytes kept");
    assert_eq!(page.entries.first().map(|e| e.seq), Some(page.first_seq));
    assert_eq!(
        page.entries.last().map(|e| e.payload.clone()),
        Some(json!({"n": "last"}))
    );
    let after = page.entries[page.entries.len() - 3].seq;
    let tail = stack
        .client
        .read_stream("s", "events", after, 10)
        .await
        .expect("cursor");
    assert_eq!(tail.entries.len(), 2);
    // Completed: its streams take no live appends.
    let late = stack
        .store
        .append_stream("s", "events", vec![json!("late")])
        .await;
    assert!(
        matches!(&late, Err(StoreError::FlowEnded { status, .. }) if status == "completed"),
        "{late:?}"
    );
    // An entry larger than a running flow's stream can ever hold.
    dexa_tests::toy::create_running_flow(stack.store.as_ref(), "t").await;
    stack
        .store
        .set_stream_capacity("t", "events", 2_000)
        .await
        .expect("capacity");
    let too_big = stack
        .store
        .append_stream("t", "events", vec![json!("y".repeat(3_000))])
        .await;
    assert!(
        matches!(too_big, Err(StoreError::Conflict(_))),
        "{too_big:?}"
    );
}

async fn an_rpc_meets_a_lock_conflict(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("Locker", "lock", json!({}))
        .await
        .expect("start");
    let probe = stack.probe.clone();
    wait_until("Hold to run", PATIENCE, || {
        let probe = probe.clone();
        async move { (probe.runs_of("Hold") == 1).then_some(()) }
    })
    .await;
    let once = stack
        .client
        .rpc_once("lock", |tx| {
            tx.lock("GUARDED")?;
            Ok(tx.set("GUARDED", "", json!("rpc"))?)
        })
        .await;
    assert!(
        matches!(once, Err(RpcError::LockConflict { ref name, .. }) if name == "GUARDED"),
        "{once:?}"
    );
    assert_eq!(
        stack.attr("lock", "GUARDED").await,
        None,
        "the conflicting RPC changed nothing"
    );
    // Unrelated state is not locked.
    stack
        .client
        .rpc_once("lock", |tx| {
            tx.lock("OTHER")?;
            Ok(())
        })
        .await
        .expect("no conflict");

    // The retrying client gets through once the Step commits.
    let client = stack.client.clone();
    let retried = tokio::spawn(async move {
        client
            .rpc("lock", |tx| {
                tx.lock("GUARDED")?;
                Ok(tx.set("GUARDED", "", json!("rpc"))?)
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    stack.probe.release.notify_one();
    let version = retried.await.expect("join").expect("rpc after release");
    assert_eq!(version, 1);
    stack.wait_status("lock", FlowStatus::Completed).await;
}

async fn a_stale_workers_commit_is_refused(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Noop", "stale", json!({"left": 0}))
        .await
        .expect("start");
    let types = vec!["Noop".to_string()];
    let a = claim_one(&stack, "worker-a", &types, 100)
        .await
        .expect("a task");
    assert_eq!(a.attempt, 1);
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The lease ran out; it is handed back and worker B takes it.
    let expired = stack
        .store
        .expired_leases(&types, 10)
        .await
        .expect("expired");
    assert_eq!(expired.len(), 1);
    assert!(!expired[0].output_recorded);
    let now = stack.store.now().await.expect("now");
    let reap = AttemptFailure::of(
        &a,
        dexa::flow::retry::redelivery(&expired[0].task, now),
        true,
    );
    stack.store.fail_attempt(reap).await.expect("reap");
    let b = claim_one(&stack, "worker-b", &types, 10_000)
        .await
        .expect("b task");
    assert_eq!(
        (b.task_id, b.attempt),
        (a.task_id, 1),
        "redelivered at the same attempt"
    );
    assert!(b.lease_token > a.lease_token);

    let commit = |task: &dexa::flow::ClaimedTask| StepCommit {
        task_id: task.task_id,
        lease_token: task.lease_token,
        flow_id: "stale".into(),
        consumed: vec![],
        writes: vec![dexa::flow::StateWrite::Set {
            name: "by".into(),
            key: String::new(),
            value: json!(task.lease_token),
        }],
        next: vec![],
        complete_flow: false,
        claim_next: None,
        history: StepHistoryEntry {
            event_type: EXECUTE_COMPLETED.into(),
            step_type: task.step_type.clone(),
            step_execution_id: task.step_execution_id.clone(),
            final_attempt: task.attempt,
            at: now,
            detail: None,
            started_at: None,
            component: None,
        },
    };
    let refused = stack.store.commit_step(commit(&a)).await;
    assert!(
        matches!(refused, Err(StoreError::StaleLease { .. })),
        "{refused:?}"
    );
    assert!(matches!(
        stack.store.record_output(a.task_id, a.lease_token).await,
        Err(StoreError::StaleLease { .. })
    ));
    let lost = stack
        .store
        .renew_leases("worker-a", &[(a.task_id, a.lease_token)], 1000)
        .await
        .expect("renew");
    assert_eq!(lost, vec![(a.task_id, a.lease_token)]);
    stack
        .store
        .commit_step(commit(&b))
        .await
        .expect("the current holder commits");
    assert_eq!(stack.attr("stale", "by").await, Some(json!(b.lease_token)));
    let history = stack.history("stale").await;
    assert_eq!(
        events(&history, "Step"),
        vec![
            (REDELIVERED.to_string(), 1),
            (EXECUTE_COMPLETED.to_string(), 1)
        ]
    );
    assert_eq!(
        stack
            .client
            .flow("stale")
            .await
            .expect("flow")
            .map(|f| f.status),
        Some(FlowStatus::Completed)
    );
}

/// The reaper's look at an expired lease (`output_recorded = false`), then the
/// lapsed worker's "started" write: the write must be refused, because the
/// redelivery that follows would let another worker act a second time.
async fn a_lapsed_lease_cannot_record_output(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Once", "lapsed", json!({}))
        .await
        .expect("start");
    let types = vec!["Once".to_string()];
    let a = claim_one(&stack, "worker-a", &types, 50)
        .await
        .expect("a task");
    tokio::time::sleep(Duration::from_millis(80)).await;
    let expired = stack.store.expired_leases(&types, 10).await.expect("look");
    assert_eq!(expired.len(), 1);
    assert!(!expired[0].output_recorded, "the reaper saw no output");
    let started = stack.store.record_output(a.task_id, a.lease_token).await;
    assert!(
        matches!(started, Err(StoreError::StaleLease { .. })),
        "a lapsed lease may not record output: {started:?}"
    );
    let now = stack.store.now().await.expect("now");
    let reap = AttemptFailure::of(&a, dexa::flow::retry::redelivery(&a, now), true);
    stack.store.fail_attempt(reap).await.expect("redelivered");
    let b = claim_one(&stack, "worker-b", &types, 10_000)
        .await
        .expect("b task");
    assert_eq!((b.task_id, b.attempt), (a.task_id, 1));
    stack
        .store
        .record_output(b.task_id, b.lease_token)
        .await
        .expect("the new holder records output");
}

/// The reaper looks (`output_recorded = false`), the worker renews its lapsed
/// lease and records output, the lease lapses again, and only then does the
/// reaper apply its stale decision: the redelivery must be refused in the
/// same transaction, and nothing of it (history included) stored.
async fn a_redelivery_is_refused_once_output_is_recorded(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Once", "raced", json!({}))
        .await
        .expect("start");
    let types = vec!["Once".to_string()];
    let a = claim_one(&stack, "worker-a", &types, 50)
        .await
        .expect("a task");
    tokio::time::sleep(Duration::from_millis(80)).await;
    let expired = stack.store.expired_leases(&types, 10).await.expect("look");
    assert!(!expired[0].output_recorded);
    let now = stack.store.now().await.expect("now");
    let stale_decision = dexa::flow::retry::redelivery(&expired[0].task, now);
    let lost = stack
        .store
        // Long enough that a busy machine cannot let it lapse before the
        // record below.
        .renew_leases("worker-a", &[(a.task_id, a.lease_token)], 1_000)
        .await
        .expect("renew");
    assert!(lost.is_empty(), "an unreaped lease can be renewed");
    stack
        .store
        .record_output(a.task_id, a.lease_token)
        .await
        .expect("started within the renewed lease");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let refused = stack
        .store
        .fail_attempt(AttemptFailure::of(&a, stale_decision, true))
        .await;
    assert!(
        matches!(refused, Err(StoreError::OutputRecorded { .. })),
        "{refused:?}"
    );
    assert!(
        events(&stack.history("raced").await, "Act").is_empty(),
        "the refused redelivery left no history"
    );
    assert!(
        stack
            .store
            .claim("worker-b", &types, 1, 10_000)
            .await
            .expect("claim")
            .is_empty(),
        "the attempt was not handed to another worker"
    );
    let expired = stack.store.expired_leases(&types, 10).await.expect("look");
    assert!(expired[0].output_recorded, "the next look sees the output");
}

/// Many single-attempt Steps whose first holder stalls past its lease and
/// then tries to start, while real workers reap with a widened window: no
/// Step acts twice, whoever wins each race.
async fn a_single_attempt_step_never_acts_twice_under_lapsing_leases(factory: &dyn StoreFactory) {
    const FLOWS: usize = 40;
    let mut stack = Stack::new(factory);
    let types = vec!["Once".to_string()];
    for n in 0..FLOWS {
        stack
            .client
            .start_flow("Once", &format!("once-{n}"), json!({}))
            .await
            .expect("start");
    }
    // The stalled holder takes every task first, with a short lease.
    let stalled = stack
        .store
        .claim("stalled", &types, FLOWS, 30)
        .await
        .expect("claim");
    assert_eq!(stalled.len(), FLOWS);
    let mut workers = Vec::new();
    for n in 0..2 {
        let options = WorkerOptions {
            worker_id: format!("reaper-{n}"),
            lease: Duration::from_millis(300),
            reap_interval: Duration::from_millis(5),
            reap_pause: Duration::from_millis(20),
            ..WorkerOptions::default()
        };
        let worker = Worker::new(
            stack.store.clone(),
            stack.client.registry().clone(),
            options,
        );
        workers.push(tokio::spawn(worker.run(std::future::pending())));
    }
    // It wakes at staggered times around its lease's end and tries to start.
    let mut stalled_acts = std::collections::BTreeMap::new();
    let mut attempts = Vec::new();
    for (n, task) in stalled.iter().enumerate() {
        let store = stack.store.clone();
        let task = task.clone();
        attempts.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20 + (n as u64 * 7) % 40)).await;
            let acted = store
                .record_output(task.task_id, task.lease_token)
                .await
                .is_ok();
            (task.flow_id, acted)
        }));
    }
    for attempt in attempts {
        let (flow_id, acted) = attempt.await.expect("stalled holder");
        stalled_acts.insert(flow_id, acted);
    }
    for n in 0..FLOWS {
        stack
            .wait_status(&format!("once-{n}"), FlowStatus::Completed)
            .await;
    }
    for n in 0..FLOWS {
        let flow_id = format!("once-{n}");
        let by_stalled = usize::from(stalled_acts[&flow_id]);
        let by_workers = stack.probe.runs_of(&format!("Act:{flow_id}"));
        assert!(
            by_stalled + by_workers <= 1,
            "{flow_id} acted {by_stalled} time(s) in the stalled holder and {by_workers} in the reapers"
        );
        let acted = stack.attr(&flow_id, "acted").await.is_some();
        let unknown = stack.attr(&flow_id, "unknown").await.is_some();
        assert!(acted != unknown, "{flow_id} ends acted or unknown, once");
    }
    stack.worker = workers.pop();
    for worker in workers {
        worker.abort();
    }
}

/// A stream created smaller than what a Step now appends (an operator raised
/// the configured capacity after the flow began): the entry that can never
/// fit is dropped and the rest of the commit applies, instead of failing the
/// commit on every retry.
async fn a_committed_entry_over_the_streams_capacity_does_not_refuse_the_commit(
    factory: &dyn StoreFactory,
) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Noop", "small-stream", json!({}))
        .await
        .expect("start");
    stack
        .store
        .set_stream_capacity("small-stream", "events", 2_000)
        .await
        .expect("capacity");
    let task = claim_one(&stack, "w", &["Noop".to_string()], 10_000)
        .await
        .expect("task");
    let now = stack.store.now().await.expect("now");
    let append = |payload: Json| dexa::flow::StateWrite::Append {
        stream: "events".into(),
        payload,
    };
    stack
        .store
        .commit_step(StepCommit {
            task_id: task.task_id,
            lease_token: task.lease_token,
            flow_id: "small-stream".into(),
            consumed: vec![],
            writes: vec![
                append(json!({"pad": "x".repeat(5_000)})),
                append(json!({"small": true})),
                dexa::flow::StateWrite::Set {
                    name: "after".into(),
                    key: String::new(),
                    value: json!(1),
                },
            ],
            next: vec![],
            complete_flow: false,
            claim_next: None,
            history: StepHistoryEntry {
                event_type: EXECUTE_COMPLETED.into(),
                step_type: task.step_type.clone(),
                step_execution_id: task.step_execution_id.clone(),
                final_attempt: task.attempt,
                at: now,
                detail: None,
                started_at: None,
                component: None,
            },
        })
        .await
        .expect("the commit applies");
    assert_eq!(stack.attr("small-stream", "after").await, Some(json!(1)));
    let page = stack
        .store
        .read_stream("small-stream", "events", 0, 10)
        .await
        .expect("read");
    let payloads: Vec<&Json> = page.entries.iter().map(|e| &e.payload).collect();
    assert_eq!(payloads, vec![&json!({"small": true})]);
}

/// One flow's backlog (a fan-out) must not hold back another flow's next
/// Step: a claim takes, among due tasks, those of flows running fewer Steps
/// first, and a commit in a flow that runs other Steps claims nothing with
/// it (its next task goes through the fair claim).
async fn claims_favour_flows_running_fewer_steps(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    let types = vec!["Noop".to_string()];
    stack
        .client
        .start_flow("Noop", "busy", json!({}))
        .await
        .expect("start");
    let first = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("busy's first");
    let now = stack.store.now().await.expect("now");
    let step = |n: usize| NewTask {
        step_type: "Step".into(),
        input: json!({"n": n}),
        wait: None,
        policy: RetryPolicy::default(),
        failure_route: None,
        failure: None,
        locks: Vec::new(),
        not_before: now,
    };
    let history = |task: &dexa::flow::ClaimedTask| StepHistoryEntry {
        event_type: EXECUTE_COMPLETED.into(),
        step_type: task.step_type.clone(),
        step_execution_id: task.step_execution_id.clone(),
        final_attempt: task.attempt,
        at: now,
        detail: None,
        started_at: None,
        component: None,
    };
    // busy fans out into five Steps and runs one of them.
    stack
        .store
        .commit_step(StepCommit {
            task_id: first.task_id,
            lease_token: first.lease_token,
            flow_id: "busy".into(),
            consumed: vec![],
            writes: vec![],
            next: (0..5).map(step).collect(),
            complete_flow: false,
            history: history(&first),
            claim_next: None,
        })
        .await
        .expect("fan out");
    let running = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("one of busy's five");
    assert_eq!(running.flow_id, "busy");
    // quiet's Step falls due after busy's four waiting ones, and goes first.
    stack
        .client
        .start_flow("Noop", "quiet", json!({}))
        .await
        .expect("start");
    let next = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("a task");
    assert_eq!(next.flow_id, "quiet", "the flow running nothing goes first");
    // A commit in busy, which still runs another Step, claims none of its
    // four waiting ones with it.
    let second = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("busy's next");
    assert_eq!(second.flow_id, "busy");
    let with_commit = stack
        .store
        .commit_step(StepCommit {
            task_id: running.task_id,
            lease_token: running.lease_token,
            flow_id: "busy".into(),
            consumed: vec![],
            writes: vec![],
            next: vec![],
            complete_flow: false,
            history: history(&running),
            claim_next: Some(dexa::flow::store::ClaimNext {
                worker_id: "w".into(),
                max: 1,
                lease_ms: 10_000,
            }),
        })
        .await
        .expect("commit");
    assert!(
        with_commit.is_empty(),
        "a fan-out claims through the fair claim"
    );
}

/// A commit that asks for the flow's next task leases it only when the
/// flow runs nothing else and has no older due task: then it is the task a
/// claim right after would take (the PostgreSQL backend inserts it leased),
/// and its lease is a real one. Otherwise the new task waits for a claim,
/// and an older due task goes first.
async fn a_commit_leases_its_next_step_only_when_the_flow_runs_nothing_else(
    factory: &dyn StoreFactory,
) {
    let stack = Stack::new(factory);
    let types = vec!["Noop".to_string()];
    let now = stack.store.now().await.expect("now");
    let step = |n: usize| NewTask {
        step_type: "Step".into(),
        input: json!({"n": n}),
        wait: None,
        policy: RetryPolicy::default(),
        failure_route: None,
        failure: None,
        locks: Vec::new(),
        not_before: now,
    };
    let commit = |task: &dexa::flow::ClaimedTask, next: Vec<NewTask>, claim: bool| StepCommit {
        task_id: task.task_id,
        lease_token: task.lease_token,
        flow_id: task.flow_id.clone(),
        consumed: vec![],
        writes: vec![],
        next,
        complete_flow: false,
        history: StepHistoryEntry {
            event_type: EXECUTE_COMPLETED.into(),
            step_type: task.step_type.clone(),
            step_execution_id: task.step_execution_id.clone(),
            final_attempt: task.attempt,
            at: now,
            detail: None,
            started_at: None,
            component: None,
        },
        claim_next: claim.then(|| dexa::flow::store::ClaimNext {
            worker_id: "w".into(),
            max: 1,
            lease_ms: 10_000,
        }),
    };
    let input = |task: &dexa::flow::ClaimedTask| task.input["n"].as_u64();

    // Sequential: the next Step comes leased with the commit, and its lease
    // fences like any other.
    stack
        .client
        .start_flow("Noop", "solo", json!({}))
        .await
        .expect("start");
    let first = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("solo's first");
    let leased = stack
        .store
        .commit_step(commit(&first, vec![step(1)], true))
        .await
        .expect("commit");
    assert_eq!(leased.len(), 1, "the next Step is leased with the commit");
    assert_eq!(input(&leased[0]), Some(1));
    assert_eq!(leased[0].attempt, 1);
    assert!(
        claim_one(&stack, "other", &types, 10_000).await.is_none(),
        "a leased task is not claimed again"
    );
    let lost = stack
        .store
        .renew_leases("w", &[(leased[0].task_id, leased[0].lease_token)], 10_000)
        .await
        .expect("renew");
    assert!(lost.is_empty(), "the lease is this worker's");
    let stale = dexa::flow::ClaimedTask {
        lease_token: leased[0].lease_token + 1,
        ..leased[0].clone()
    };
    assert!(
        matches!(
            stack
                .store
                .commit_step(commit(&stale, vec![step(99)], true))
                .await,
            Err(StoreError::StaleLease { .. })
        ),
        "another token is fenced out"
    );
    assert!(
        claim_one(&stack, "other", &types, 10_000).await.is_none(),
        "a refused commit adds no task, though its insert ran after the fence"
    );
    let done = stack
        .store
        .commit_step(commit(&leased[0], vec![], true))
        .await
        .expect("the leased Step commits");
    assert!(done.is_empty());
    let info = stack
        .client
        .flow("solo")
        .await
        .expect("flow")
        .expect("exists");
    assert_eq!(info.status, FlowStatus::Completed);

    // Another Step of the flow runs: the new task waits for a claim.
    stack
        .client
        .start_flow("Noop", "pair", json!({}))
        .await
        .expect("start");
    let first = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("pair's first");
    stack
        .store
        .commit_step(commit(&first, vec![step(10), step(11)], false))
        .await
        .expect("fan out");
    let a = claim_one(&stack, "w", &types, 10_000).await.expect("a");
    let b = claim_one(&stack, "w", &types, 10_000).await.expect("b");
    let with_commit = stack
        .store
        .commit_step(commit(&b, vec![step(12)], true))
        .await
        .expect("commit b");
    assert!(with_commit.is_empty(), "the flow still runs a Step");
    let c = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("the new task is ready for a claim");
    assert_eq!(input(&c), Some(12));
    for task in [&a, &c] {
        stack
            .store
            .commit_step(commit(task, vec![], false))
            .await
            .expect("finish");
    }

    // An older task of the flow is due: the commit's claim takes it first.
    stack
        .client
        .start_flow("Noop", "queue", json!({}))
        .await
        .expect("start");
    let first = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("queue's first");
    stack
        .store
        .commit_step(commit(&first, vec![step(20)], false))
        .await
        .expect("one next");
    let x = claim_one(&stack, "w", &types, 10_000).await.expect("x");
    // x fans out to two; the first runs and commits one next task while
    // the second is due.
    let leased = stack
        .store
        .commit_step(commit(&x, vec![step(21), step(22)], false))
        .await
        .expect("fan out");
    assert!(leased.is_empty());
    let y = claim_one(&stack, "w", &types, 10_000).await.expect("y");
    assert_eq!(input(&y), Some(21));
    let leased = stack
        .store
        .commit_step(commit(&y, vec![step(23)], true))
        .await
        .expect("commit y");
    assert_eq!(
        leased.len(),
        1,
        "nothing of the flow runs: the claim leases"
    );
    assert_eq!(
        input(&leased[0]),
        Some(22),
        "the older due task goes before the one this commit made"
    );
}

/// A commit of many statements (40 messages consumed, 40 next tasks: the
/// PostgreSQL backend sends them as one pipeline) applies whole or not at
/// all, and its first refusal is the one reported: a stale lease before a
/// message that is not there, and either leaves every message in place.
async fn a_large_commit_applies_whole_or_not_at_all(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    let types = vec!["Noop".to_string()];
    let now = stack.store.now().await.expect("now");
    let task = |n: usize, wait: Option<dexa::flow::types::WaitSpec>| NewTask {
        step_type: "Step".into(),
        input: json!({"n": n}),
        wait,
        policy: RetryPolicy::default(),
        failure_route: None,
        failure: None,
        locks: Vec::new(),
        not_before: now,
    };
    let commit =
        |claimed: &dexa::flow::ClaimedTask, token: i64, consumed: Vec<i64>, next| StepCommit {
            task_id: claimed.task_id,
            lease_token: token,
            flow_id: claimed.flow_id.clone(),
            consumed,
            writes: vec![],
            next,
            complete_flow: false,
            history: StepHistoryEntry {
                event_type: EXECUTE_COMPLETED.into(),
                step_type: claimed.step_type.clone(),
                step_execution_id: claimed.step_execution_id.clone(),
                final_attempt: claimed.attempt,
                at: now,
                detail: None,
                started_at: None,
                component: None,
            },
            claim_next: None,
        };
    stack
        .client
        .start_flow("Noop", "big", json!({}))
        .await
        .expect("start");
    let first = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("big's first");
    let wait = dexa::flow::types::WaitSpec {
        channel: Some(dexa::flow::types::ChannelWait::for_n("inbox", 40)),
        timer_at: None,
    };
    stack
        .store
        .commit_step(commit(
            &first,
            first.lease_token,
            vec![],
            vec![task(0, Some(wait))],
        ))
        .await
        .expect("wait for 40");
    stack
        .client
        .rpc("big", |tx| {
            for n in 0..40 {
                tx.publish("inbox", "", json!(n))?;
            }
            Ok(())
        })
        .await
        .expect("publish 40");
    let waiting = claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("the wait holds");
    let ids: Vec<i64> = waiting.messages.iter().map(|m| m.message_id).collect();
    assert_eq!(ids.len(), 40);
    let fan_out = || (1..=40).map(|n| task(n, None)).collect::<Vec<_>>();

    let missing = ids.iter().max().copied().unwrap_or(0) + 1_000;
    let mut with_missing = ids.clone();
    with_missing.push(missing);
    let stale = stack
        .store
        .commit_step(commit(
            &waiting,
            waiting.lease_token + 1,
            with_missing.clone(),
            fan_out(),
        ))
        .await;
    assert!(
        matches!(stale, Err(StoreError::StaleLease { .. })),
        "the fence answers first: {stale:?}"
    );
    let conflict = stack
        .store
        .commit_step(commit(
            &waiting,
            waiting.lease_token,
            with_missing,
            fan_out(),
        ))
        .await;
    assert!(
        matches!(conflict, Err(StoreError::Conflict(_))),
        "a message that is not there refuses the commit: {conflict:?}"
    );
    assert!(
        stack
            .store
            .claim("other", &types, 100, 10_000)
            .await
            .expect("claim")
            .is_empty(),
        "neither refused commit added a task"
    );

    // Every message is still there: the commit that consumes them all
    // applies, whole.
    stack
        .store
        .commit_step(commit(
            &waiting,
            waiting.lease_token,
            ids.clone(),
            fan_out(),
        ))
        .await
        .expect("the whole commit");
    let next = stack
        .store
        .claim("w", &types, 100, 10_000)
        .await
        .expect("claim");
    let mut inputs: Vec<u64> = next.iter().filter_map(|t| t.input["n"].as_u64()).collect();
    inputs.sort();
    assert_eq!(inputs, (1..=40).collect::<Vec<u64>>(), "all 40 next tasks");
    let again = stack
        .store
        .commit_step(commit(&next[0], next[0].lease_token, vec![ids[7]], vec![]))
        .await;
    assert!(
        matches!(again, Err(StoreError::Conflict(_))),
        "consumed once: {again:?}"
    );
}

/// A cancel's transaction takes every task of a flow and leaves one in their
/// place: the running Step's lease is gone (its commit and its output are
/// refused, and `lease_held` says so), the flow's revocation signal wakes in
/// this process and in another (a second handle on the store, with its own
/// listener or watch), its stream readers are woken by the append in the
/// same transaction, and the new task runs.
async fn taking_a_flows_tasks_fences_the_running_step_and_wakes_its_readers(
    factory: &dyn StoreFactory,
) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Noop", "taken", json!({"left": 0}))
        .await
        .expect("start");
    let types = vec!["Noop".to_string()];
    let running = claim_one(&stack, "worker-a", &types, 10_000)
        .await
        .expect("a task");
    stack
        .store
        .record_output(running.task_id, running.lease_token)
        .await
        .expect("started");
    assert!(stack
        .store
        .lease_held(running.task_id, running.lease_token)
        .await
        .expect("look"));
    let signal = stack
        .store
        .stream_signal("taken")
        .expect("both backends push appends");
    let woken = signal.notified();
    tokio::pin!(woken);
    woken.as_mut().enable();
    let here = stack
        .store
        .revocation_signal("taken")
        .expect("both backends signal takes");
    let revoked_here = here.notified();
    tokio::pin!(revoked_here);
    revoked_here.as_mut().enable();
    let other = factory.open(stack._dir.path());
    let there = other
        .revocation_signal("taken")
        .expect("both backends signal takes");
    // A watch wakes a flow it has not seen before on the first commit it
    // sees (SQLite's): let that pass, so that only the take can wake it.
    stack
        .client
        .start_flow("Inbox", "unrelated", json!({"mode": "one", "expect": 5}))
        .await
        .expect("start");
    let first_sight = there.notified();
    other
        .append_stream("unrelated", "events", vec![json!({})])
        .await
        .expect("append");
    let _ = tokio::time::timeout(Duration::from_millis(500), first_sight).await;
    let revoked_there = there.notified();
    tokio::pin!(revoked_there);
    revoked_there.as_mut().enable();
    let registry = stack.client.registry().clone();
    let now = stack.store.now().await.expect("now");
    let replacement = registry
        .new_task(
            "Noop",
            dexa::flow::StepCall::new(&running.step_type, json!({"left": 0, "replaced": true})),
            now,
            None,
        )
        .expect("task");
    let taken = stack
        .client
        .rpc("taken", move |tx| {
            let taken = tx.take_tasks()?;
            tx.add_task(replacement.clone())?;
            tx.append("events", json!({"cancel": true}))?;
            Ok(taken)
        })
        .await
        .expect("take");
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(taken[0].step_type, running.step_type);
    assert_eq!(taken[0].input, json!({"left": 0}));
    assert!(taken[0].leased && taken[0].output_recorded);
    tokio::time::timeout(PATIENCE, woken)
        .await
        .expect("the append in the same transaction woke the flow's readers");
    tokio::time::timeout(PATIENCE, revoked_here)
        .await
        .expect("the take woke this process's Steps of the flow");
    tokio::time::timeout(PATIENCE, revoked_there)
        .await
        .expect("the take woke another process's Steps of the flow");
    assert!(!stack
        .store
        .lease_held(running.task_id, running.lease_token)
        .await
        .expect("look"));
    assert!(matches!(
        stack
            .store
            .record_output(running.task_id, running.lease_token)
            .await,
        Err(StoreError::StaleLease { .. })
    ));
    let again = claim_one(&stack, "worker-b", &types, 10_000)
        .await
        .expect("the replacement is due");
    assert_eq!(again.input, json!({"left": 0, "replaced": true}));
    assert_ne!(again.task_id, running.task_id);
    // A read-only transaction takes nothing.
    let refused = stack
        .client
        .read_rpc("taken", |tx| Ok(tx.take_tasks()?))
        .await;
    assert!(refused.is_err(), "{refused:?}");
    assert!(stack
        .store
        .lease_held(again.task_id, again.lease_token)
        .await
        .expect("look"));
}

async fn stopping_a_flow_keeps_its_state_readable(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    stack.start_worker();
    stack
        .client
        .start_flow("Inbox", "stop-me", json!({"mode": "one", "expect": 5}))
        .await
        .expect("start");
    stack
        .client
        .rpc("stop-me", |tx| {
            Ok(tx.publish("inbox", "", json!("first"))?)
        })
        .await
        .expect("publish");
    let store = stack.store.clone();
    wait_until("the first message to be received", PATIENCE, || {
        let store = store.clone();
        async move {
            store
                .get("stop-me", "received", "")
                .await
                .ok()
                .flatten()
                .map(|_| ())
        }
    })
    .await;
    assert!(stack.client.stop_flow("stop-me").await.expect("stop"));
    assert!(
        !stack.client.stop_flow("stop-me").await.expect("stop again"),
        "already stopped"
    );
    stack
        .client
        .rpc("stop-me", |tx| {
            Ok(tx.publish("inbox", "", json!("second"))?)
        })
        .await
        .expect("publish");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let info = stack
        .client
        .flow("stop-me")
        .await
        .expect("flow")
        .expect("exists");
    assert_eq!(info.status, FlowStatus::Stopped);
    assert_eq!(
        stack.attr("stop-me", "received").await,
        Some(json!(["first"])),
        "no Step ran after the stop"
    );
    assert!(matches!(
        stack.client.start_flow("Inbox", "stop-me", json!({})).await,
        Err(dexa::flow::FlowError::Store(StoreError::FlowExists { .. }))
    ));
    // A stopped flow's streams take no live appends: a reader that saw it
    // stopped, then read its stream to the end, has every entry.
    let refused = stack
        .store
        .append_stream("stop-me", "events", vec![json!({"late": true})])
        .await;
    assert!(
        matches!(&refused, Err(StoreError::FlowEnded { status, .. }) if status == "stopped"),
        "{refused:?}"
    );
    let page = stack
        .store
        .read_stream("stop-me", "events", 0, 10)
        .await
        .expect("read");
    assert!(page.entries.is_empty(), "{:?}", page.entries);
    assert!(matches!(
        stack
            .store
            .append_stream("never-started", "events", vec![json!(1)])
            .await,
        Err(StoreError::NoSuchFlow { .. })
    ));
}

/// A map read honours its range, its order, its limit and its byte cap,
/// counting the stored bytes of every row before the one that passes it.
async fn a_map_read_pages_by_range_order_limit_and_bytes(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Inbox", "pages", json!({"mode": "one", "expect": 5}))
        .await
        .expect("start");
    stack
        .client
        .rpc("pages", |tx| {
            for n in 1..=10 {
                // 100 bytes stored: a JSON string of 98 characters.
                tx.set("m", &format!("k{n:02}"), json!("x".repeat(98)))?;
            }
            Ok(())
        })
        .await
        .expect("set");
    let keys = |query: MapQuery| {
        let store = stack.store.clone();
        async move {
            store
                .read_map("pages", "m", query)
                .await
                .expect("read")
                .into_iter()
                .map(|(key, _)| key)
                .collect::<Vec<_>>()
        }
    };
    let range = |descending, limit, max_bytes| MapQuery {
        after: Some("k03".to_string()),
        before: Some("k08".to_string()),
        descending,
        limit,
        max_bytes,
    };
    assert_eq!(
        keys(range(false, 0, None)).await,
        ["k04", "k05", "k06", "k07"]
    );
    assert_eq!(keys(range(true, 2, None)).await, ["k07", "k06"]);
    assert_eq!(
        keys(range(false, 0, Some(250))).await,
        ["k04", "k05", "k06"]
    );
    assert_eq!(keys(range(true, 0, Some(200))).await, ["k07", "k06"]);
    assert_eq!(keys(range(true, 1, Some(u64::MAX))).await, ["k07"]);
    assert_eq!(keys(range(false, 0, Some(1))).await, ["k04"], "never empty");
    assert_eq!(keys(range(false, 0, Some(0))).await, ["k04"], "never empty");
    let all = keys(MapQuery::default()).await;
    assert_eq!(all.len(), 10);
    assert_eq!(
        keys(MapQuery {
            after: Some("k10".to_string()),
            ..MapQuery::default()
        })
        .await,
        Vec::<String>::new()
    );
}

/// A worker child process, killed when dropped (also when a test fails).
struct WorkerProcess(Child);

impl WorkerProcess {
    fn id(&self) -> u32 {
        self.0.id()
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn_worker_process(store: &str, gates: &Path) -> WorkerProcess {
    WorkerProcess(
        Command::new(env!("CARGO_BIN_EXE_toy-worker"))
            .arg(store)
            .arg(gates)
            .arg("300")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start toy-worker"),
    )
}

/// Kills a worker process with SIGKILL mid-Step; a new worker process runs the
/// Step again and the flow completes. Without output the same attempt is
/// delivered again; after a heartbeat, the next attempt runs.
async fn a_killed_worker_process_mid_step(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    let dir = stack._dir.path().to_path_buf();
    let store_path = factory.address(&dir);
    for (flow, heartbeat, rerun_attempt, first_event) in [
        ("quiet", false, 1, REDELIVERED),
        ("beating", true, 2, ATTEMPT_FAILED),
    ] {
        let mut first = spawn_worker_process(&store_path, &dir);
        stack
            .client
            .start_flow("Gated", flow, json!({"heartbeat": heartbeat}))
            .await
            .expect("start");
        let gate = dir.join(format!("{flow}-attempt-1.reached"));
        // The Step creates the file, then writes its pid: wait for the pid.
        let reached_by = wait_until("the gate", PATIENCE, || {
            let gate = gate.clone();
            async move {
                std::fs::read_to_string(&gate)
                    .ok()
                    .filter(|pid| !pid.is_empty())
            }
        })
        .await;
        assert_eq!(reached_by, first.id().to_string());
        first.kill();
        // A redelivery reaches the same gate again; clear it to see the rerun.
        std::fs::remove_file(&gate).expect("clear gate");

        let mut second = spawn_worker_process(&store_path, &dir);
        let rerun = dir.join(format!("{flow}-attempt-{rerun_attempt}.reached"));
        let rerun_gate = rerun.clone();
        let rerun_by = wait_until("the rerun", PATIENCE, || {
            let rerun = rerun_gate.clone();
            async move {
                std::fs::read_to_string(&rerun)
                    .ok()
                    .filter(|pid| !pid.is_empty())
            }
        })
        .await;
        assert_eq!(rerun_by, second.id().to_string());
        std::fs::write(dir.join(format!("{flow}.release")), "go").expect("release");
        stack.wait_status(flow, FlowStatus::Completed).await;
        let history = events(&stack.history(flow).await, "Work");
        assert_eq!(
            history,
            vec![
                (first_event.to_string(), 1),
                (EXECUTE_COMPLETED.to_string(), rerun_attempt)
            ]
        );
        second.kill();
    }
}

async fn leases_fence_the_retry_policy(factory: &dyn StoreFactory) {
    // A retry policy survives the trip through the store unchanged.
    let stack = Stack::new(factory);
    stack
        .client
        .start_flow("Retry", "policy", json!({"next": "Slow"}))
        .await
        .expect("start");
    let task = claim_one(&stack, "w", &["Retry".to_string()], 1000)
        .await
        .expect("task");
    assert_eq!(task.step_type, "Start");
    assert_eq!(task.policy, RetryPolicy::default());
    let now = stack.store.now().await.expect("now");
    stack
        .store
        .fail_attempt(AttemptFailure {
            task_id: task.task_id,
            lease_token: task.lease_token,
            flow_id: "policy".into(),
            action: FailureAction::Retry {
                attempt: 2,
                not_before: now + 60_000,
            },
            history: dexa::flow::retry::redelivery(&task, now).1,
            require_expired: false,
        })
        .await
        .expect("retry later");
    assert!(
        stack
            .store
            .claim("w", &["Retry".to_string()], 1, 1000)
            .await
            .expect("claim")
            .is_empty(),
        "not before its time"
    );
    assert_eq!(
        stack
            .store
            .next_due(&["Retry".to_string()])
            .await
            .expect("due"),
        Some(now + 60_000)
    );
}

/// The queue depth `/metrics` shows counts the tasks by state.
async fn task_counts_count_the_tasks_by_state(factory: &dyn StoreFactory) {
    let stack = Stack::new(factory);
    let counts = stack.store.task_counts().await.expect("counts");
    assert_eq!(counts, dexa::flow::TaskCounts::default(), "an empty store");
    for id in ["q1", "q2", "q3"] {
        stack
            .client
            .start_flow("Noop", id, json!({}))
            .await
            .expect("start");
    }
    let counts = stack.store.task_counts().await.expect("counts");
    assert_eq!((counts.ready, counts.waiting, counts.leased), (3, 0, 0));
    let types = vec!["Noop".to_string()];
    claim_one(&stack, "w", &types, 10_000)
        .await
        .expect("a task");
    let counts = stack.store.task_counts().await.expect("counts");
    assert_eq!((counts.ready, counts.waiting, counts.leased), (2, 0, 1));
}

/// Sets the creation time of `flows` in `stack`'s store behind its back:
/// the stores take the time from the clock, and a test of ties needs them.
async fn set_created_at(factory: &dyn StoreFactory, stack: &Stack, flows: &[&str], millis: i64) {
    let ids: Vec<String> = flows.iter().map(|f| f.to_string()).collect();
    match factory.name() {
        "sqlite" => {
            let conn = rusqlite::Connection::open(stack._dir.path().join("store.sqlite"))
                .expect("open the SQLite file");
            conn.busy_timeout(Duration::from_secs(10))
                .expect("busy timeout");
            for id in &ids {
                conn.execute(
                    "UPDATE flows SET created_at_ms = ?1 WHERE flow_id = ?2",
                    rusqlite::params![millis, id],
                )
                .expect("update");
            }
        }
        _ => {
            let address = dexa_tests::toy::postgres_address(stack._dir.path());
            let schema = address
                .rsplit_once("schema=")
                .map(|(_, schema)| schema.to_string())
                .expect("a schema");
            let (client, connection) = tokio_postgres::connect(
                &dexa_tests::toy::test_postgres_url(),
                tokio_postgres::NoTls,
            )
            .await
            .expect("connect");
            let connection = tokio::spawn(connection);
            let sql =
                format!("UPDATE \"{schema}\".flows SET created_at_ms = $1 WHERE flow_id = $2");
            for id in &ids {
                client.execute(&sql, &[&millis, id]).await.expect("update");
            }
            drop(client);
            let _ = connection.await;
        }
    }
}

/// Flows list newest first and Step history oldest first; a page that
/// starts at the cursor of the one before misses nothing and repeats
/// nothing, also among flows created in the same millisecond.
async fn listings_page_by_cursor_without_a_gap_or_a_repeat(factory: &dyn StoreFactory) {
    let mut stack = Stack::new(factory);
    for n in 0..9 {
        let kind = if n % 3 == 0 { "Retry" } else { "Noop" };
        let input = if kind == "Retry" {
            json!({"next": "Flaky"})
        } else {
            json!({})
        };
        stack
            .client
            .start_flow(kind, &format!("f{n}"), input)
            .await
            .expect("start");
    }
    // Ties: five flows in one millisecond, a page boundary among them.
    set_created_at(factory, &stack, &["f2", "f3", "f4", "f5", "f6"], 1_000).await;
    let whole = stack.store.list_flows(None, None, 100).await.expect("list");
    assert_eq!(whole.len(), 9);
    let tied: Vec<&str> = whole
        .iter()
        .filter(|f| f.created_at == 1_000)
        .map(|f| f.flow_id.as_str())
        .collect();
    assert_eq!(tied, ["f2", "f3", "f4", "f5", "f6"], "ties by id");
    assert!(whole
        .windows(2)
        .all(|w| (w[0].created_at, &w[1].flow_id) >= (w[1].created_at, &w[0].flow_id)));
    for (kind, size) in [
        (None, 1),
        (None, 2),
        (None, 4),
        (Some("Noop"), 2),
        (Some("Retry"), 1),
    ] {
        let mut paged = Vec::new();
        let mut after: Option<FlowCursor> = None;
        loop {
            let page = stack
                .store
                .list_flows(kind, after.as_ref(), size)
                .await
                .expect("page");
            assert!(page.len() <= size);
            let Some(last) = page.last() else { break };
            after = Some(FlowCursor::after(last));
            paged.extend(page);
        }
        let expected: Vec<_> = whole
            .iter()
            .filter(|f| kind.is_none_or(|k| f.flow_type == k))
            .cloned()
            .collect();
        assert_eq!(paged, expected, "{kind:?} by {size}");
    }

    stack.start_worker();
    stack.wait_status("f0", FlowStatus::Completed).await;
    let history = stack.history("f0").await;
    assert!(history.len() >= 4, "{history:?}");
    let mut paged = Vec::new();
    let mut after = None;
    loop {
        let page = stack
            .store
            .step_history_page("f0", after, 2)
            .await
            .expect("page");
        assert!(page.len() <= 2);
        assert!(page.windows(2).all(|w| w[0].0 < w[1].0), "ids increase");
        let Some((last, _)) = page.last() else { break };
        after = Some(*last);
        paged.extend(page.into_iter().map(|(_, entry)| entry));
    }
    assert_eq!(paged, history);
    assert!(stack
        .store
        .step_history_page("nobody", None, 10)
        .await
        .expect("page")
        .is_empty());
}

macro_rules! backends {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(&super::SqliteFactory).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(&super::PostgresFactory).await;
                }
            )*
        }
    };
}

backends!(
    retries_then_the_failure_route,
    the_per_attempt_timeout,
    the_heartbeat_timeout,
    go_to_many_runs_eight_steps_at_once,
    a_worker_runs_as_many_steps_as_its_slots_and_never_more,
    channel_waits_for_one_and_for_n,
    timers_fire_and_an_early_timer_waits_again,
    streams_trim_to_their_capacity,
    an_rpc_meets_a_lock_conflict,
    a_stale_workers_commit_is_refused,
    a_lapsed_lease_cannot_record_output,
    a_committed_entry_over_the_streams_capacity_does_not_refuse_the_commit,
    claims_favour_flows_running_fewer_steps,
    a_commit_leases_its_next_step_only_when_the_flow_runs_nothing_else,
    a_large_commit_applies_whole_or_not_at_all,
    a_redelivery_is_refused_once_output_is_recorded,
    a_single_attempt_step_never_acts_twice_under_lapsing_leases,
    stopping_a_flow_keeps_its_state_readable,
    taking_a_flows_tasks_fences_the_running_step_and_wakes_its_readers,
    a_killed_worker_process_mid_step,
    leases_fence_the_retry_policy,
    a_map_read_pages_by_range_order_limit_and_bytes,
    task_counts_count_the_tasks_by_state,
    listings_page_by_cursor_without_a_gap_or_a_repeat,
);
