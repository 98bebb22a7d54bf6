//! Toy flows that exercise every primitive of the Flow engine, and the store
//! factories the conformance suite runs them against.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dexa::flow::{
    ChannelWait, FlowStore, FlowType, Json, Registry, RetryPolicy, StepCall, StepContext, StepDef,
    StepError, StepResult,
};
use serde_json::json;

/// Opens a fresh store in a directory; one per backend.
pub trait StoreFactory: Send + Sync {
    fn name(&self) -> &'static str;
    fn open(&self, dir: &Path) -> Arc<dyn FlowStore>;
    /// The address another process opens the same store at.
    fn address(&self, dir: &Path) -> String;
}

/// The embedded SQLite backend.
pub struct SqliteFactory;

impl StoreFactory for SqliteFactory {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn address(&self, dir: &Path) -> String {
        dir.join("store.sqlite").display().to_string()
    }

    fn open(&self, dir: &Path) -> Arc<dyn FlowStore> {
        let path = dir.join("store.sqlite");
        Arc::new(
            dexa::store::sqlite::SqliteStore::open(&path, Default::default())
                .unwrap_or_else(|err| panic!("open {}: {err}", path.display())),
        )
    }
}

/// PostgreSQL at `DEXA_TEST_POSTGRES` (`./ci.sh` starts a throwaway
/// cluster and sets it), in a fresh schema per test directory, so that
/// tests running at once never see each other's rows.
pub struct PostgresFactory;

/// The server the PostgreSQL tests use. Panics, saying how to get one,
/// when none is set: a PostgreSQL test never passes by skipping.
pub fn test_postgres_url() -> String {
    std::env::var("DEXA_TEST_POSTGRES").unwrap_or_else(|_| {
        panic!(
            "DEXA_TEST_POSTGRES is not set: run ./ci.sh (it starts a throwaway PostgreSQL), \
             or `export DEXA_TEST_POSTGRES=$(scripts/test-postgres.sh start target/postgres)`"
        )
    })
}

/// The address of a fresh schema for `dir` on the test server.
pub fn postgres_address(dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    dir.hash(&mut hasher);
    std::process::id().hash(&mut hasher);
    let base = test_postgres_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}schema=dexa_test_{:016x}", hasher.finish())
}

/// Opens the PostgreSQL store of `dir`'s schema, from synchronous test code
/// on a multi-threaded runtime.
pub fn open_postgres(dir: &Path) -> dexa::store::postgres::PostgresStore {
    let address = postgres_address(dir);
    let url = dexa::store::postgres::PostgresUrl::parse(&address)
        .unwrap_or_else(|err| panic!("{address}: {err}"));
    tokio::task::block_in_place(|| {
        tokio::runtime::Handle::current()
            .block_on(dexa::store::postgres::PostgresStore::connect(url))
            .unwrap_or_else(|err| panic!("open {address}: {err}"))
    })
}

impl StoreFactory for PostgresFactory {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn address(&self, dir: &Path) -> String {
        postgres_address(dir)
    }

    fn open(&self, dir: &Path) -> Arc<dyn FlowStore> {
        Arc::new(open_postgres(dir))
    }
}

/// Shared, in-process test instruments the toy Steps report to.
pub struct Probe {
    /// Eight parallel leaves meet here; only overlapping Steps get through.
    pub barrier: tokio::sync::Barrier,
    /// (start, end) of each leaf.
    pub leaf_spans: Mutex<Vec<(Instant, Instant)>>,
    /// Released by the test to let the `Locker` Step finish.
    pub release: tokio::sync::Notify,
    /// How many times each named Step ran (any attempt).
    pub runs: Mutex<std::collections::BTreeMap<String, usize>>,
    /// Files the process-crossing Steps use as gates.
    pub gate_dir: Option<PathBuf>,
    /// Leaves running now, and the most that ever ran at once.
    pub running_now: AtomicUsize,
    pub most_running: AtomicUsize,
}

impl Probe {
    pub fn new(gate_dir: Option<PathBuf>) -> Arc<Self> {
        Arc::new(Self {
            barrier: tokio::sync::Barrier::new(8),
            leaf_spans: Mutex::new(Vec::new()),
            release: tokio::sync::Notify::new(),
            runs: Mutex::new(Default::default()),
            gate_dir,
            running_now: AtomicUsize::new(0),
            most_running: AtomicUsize::new(0),
        })
    }

    fn ran(&self, step: &str) {
        if let Ok(mut runs) = self.runs.lock() {
            *runs.entry(step.to_string()).or_default() += 1;
        }
    }

    pub fn runs_of(&self, step: &str) -> usize {
        self.runs
            .lock()
            .map(|runs| runs.get(step).copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

/// Fast retries for tests.
fn quick(attempts: u32) -> RetryPolicy {
    RetryPolicy::default()
        .attempts(attempts)
        .backoff(Duration::from_millis(10))
}

fn input_str(ctx: &StepContext, field: &str) -> String {
    ctx.input()[field].as_str().unwrap_or_default().to_string()
}

/// All toy flow types, wired to `probe`.
pub fn toy_registry(probe: Arc<Probe>) -> Registry {
    let types = vec![
        retry_flow(probe.clone()),
        fan_out_flow(probe.clone()),
        inbox_flow(),
        sleeper_flow(),
        locker_flow(probe.clone()),
        stream_flow(),
        gated_flow(probe.clone()),
        noop_flow(),
        once_flow(probe.clone()),
    ];
    Registry::new(types).unwrap_or_else(|err| panic!("toy registry: {err}"))
}

/// `Retry`: `Flaky` fails its first `fail_times` attempts (all, by default),
/// `Slow` overruns its first attempt, `Silent` skips heartbeats on its first
/// attempt; each has the failure route `Recover`.
fn retry_flow(probe: Arc<Probe>) -> FlowType {
    let start = |ctx: StepContext| async move {
        let next = input_str(&ctx, "next");
        Ok(StepResult::go_to(StepCall::new(next, ctx.input().clone())))
    };
    let flaky_probe = probe.clone();
    let flaky = move |ctx: StepContext| {
        let probe = flaky_probe.clone();
        async move {
            probe.ran("Flaky");
            let fail_times = ctx.input()["fail_times"].as_u64().unwrap_or(u64::MAX);
            if u64::from(ctx.attempt()) <= fail_times {
                return Err(StepError::retryable(format!(
                    "flaky failure on attempt {}",
                    ctx.attempt()
                )));
            }
            Ok(StepResult::end().set("result", json!(format!("ok on attempt {}", ctx.attempt()))))
        }
    };
    let slow = |ctx: StepContext| async move {
        if ctx.attempt() == 1 {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Ok(StepResult::end().set("result", json!(format!("ok on attempt {}", ctx.attempt()))))
    };
    let silent = |ctx: StepContext| async move {
        if ctx.attempt() == 1 {
            tokio::time::sleep(Duration::from_secs(30)).await;
        } else {
            // Runs well past the heartbeat timeout, heartbeating all along.
            for _ in 0..8 {
                ctx.heartbeat_handle().beat();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(StepResult::end().set("result", json!(format!("ok on attempt {}", ctx.attempt()))))
    };
    let recover = |ctx: StepContext| async move {
        Ok(StepResult::end().set("recovered", json!(ctx.failure().unwrap_or_default())))
    };
    let fatal = |_ctx: StepContext| async move {
        Err::<StepResult, _>(StepError::fatal("no point retrying"))
    };
    FlowType::new("Retry", "Start")
        .step(StepDef::new("Start", start))
        .step(
            StepDef::new("Flaky", flaky)
                .policy(quick(3))
                .failure_route("Recover"),
        )
        .step(
            StepDef::new("Unrouted", move |ctx: StepContext| async move {
                Err::<StepResult, _>(StepError::retryable(format!(
                    "unrouted failure {}",
                    ctx.attempt()
                )))
            })
            .policy(quick(2)),
        )
        .step(
            StepDef::new("Fatal", fatal)
                .policy(quick(3))
                .failure_route("Recover"),
        )
        .step(
            StepDef::new("Slow", slow)
                .policy(quick(2).attempt_timeout(Duration::from_millis(200)))
                .failure_route("Recover"),
        )
        .step(
            StepDef::new("Silent", silent)
                .policy(quick(2).heartbeat_timeout(Duration::from_millis(200)))
                .failure_route("Recover"),
        )
        .step(StepDef::new("Recover", recover))
}

/// How long a leaf stays running once the eight have met.
const LEAF_HOLD: Duration = Duration::from_millis(50);

/// `FanOut`: eight `Leaf` Steps that must all run at once (they meet at a
/// barrier), then `Join` waits for their eight results.
fn fan_out_flow(probe: Arc<Probe>) -> FlowType {
    let fan = |_ctx: StepContext| async move {
        let mut next: Vec<StepCall> = (0..8)
            .map(|i| StepCall::new("Leaf", json!({ "leaf": i })))
            .collect();
        next.push(StepCall::new("Join", json!({})).wait_for(ChannelWait::for_n("leaf_done", 8)));
        Ok(StepResult::go_to_many(next))
    };
    let leaf = move |ctx: StepContext| {
        let probe = probe.clone();
        async move {
            let started = Instant::now();
            let now = probe.running_now.fetch_add(1, Ordering::SeqCst) + 1;
            probe.most_running.fetch_max(now, Ordering::SeqCst);
            let met = tokio::time::timeout(Duration::from_secs(20), probe.barrier.wait()).await;
            // Held a while after the barrier, so that a Step started past
            // the worker's slots would overlap the eight and be counted.
            tokio::time::sleep(LEAF_HOLD).await;
            probe.running_now.fetch_sub(1, Ordering::SeqCst);
            if met.is_err() {
                return Err(StepError::fatal(
                    "the eight leaves did not run at the same time",
                ));
            }
            if let Ok(mut spans) = probe.leaf_spans.lock() {
                spans.push((started, Instant::now()));
            }
            Ok(StepResult::end().publish("leaf_done", "", ctx.input()["leaf"].clone()))
        }
    };
    let join = |ctx: StepContext| async move {
        let mut leaves: Vec<i64> = ctx
            .messages()
            .iter()
            .filter_map(|m| m.payload.as_i64())
            .collect();
        leaves.sort();
        Ok(StepResult::complete().set("joined", json!(leaves)))
    };
    FlowType::new("FanOut", "Fan")
        .step(StepDef::new("Fan", fan))
        .step(StepDef::new("Leaf", leaf).policy(quick(1)))
        .step(StepDef::new("Join", join))
}

/// `Inbox`: `Receive` waits for one message at a time (`for_one`) until it
/// has `expect` of them; `Batch` waits for `batch` at once (`for_n`); `Keyed`
/// waits on one key of a ChannelMap.
fn inbox_flow() -> FlowType {
    let start = |ctx: StepContext| async move {
        let mode = input_str(&ctx, "mode");
        let input = ctx.input().clone();
        let call = match mode.as_str() {
            "batch" => {
                let n = input["batch"].as_u64().unwrap_or(3) as u32;
                StepCall::new("Batch", input).wait_for(ChannelWait::for_n("inbox", n))
            }
            "keyed" => {
                let key = input["key"].as_str().unwrap_or_default().to_string();
                StepCall::new("Keyed", input).wait_for(ChannelWait::for_key("answers", key))
            }
            _ => StepCall::new("Receive", input).wait_for(ChannelWait::for_one("inbox")),
        };
        Ok(StepResult::go_to(call))
    };
    let receive = |ctx: StepContext| async move {
        let received: Vec<Json> = ctx.get_value("received", "").await?.unwrap_or_default();
        let mut received = received;
        received.extend(ctx.messages().iter().map(|m| m.payload.clone()));
        let expect = ctx.input()["expect"].as_u64().unwrap_or(1) as usize;
        let result = StepResult::end().set("received", json!(received.clone()));
        if received.len() >= expect {
            return Ok(result);
        }
        let again =
            StepCall::new("Receive", ctx.input().clone()).wait_for(ChannelWait::for_one("inbox"));
        Ok(StepResult {
            outcome: dexa::flow::StepOutcome::Next(vec![again]),
            ..result
        })
    };
    let batch = |ctx: StepContext| async move {
        let batch: Vec<Json> = ctx.messages().iter().map(|m| m.payload.clone()).collect();
        Ok(StepResult::end().set("batch", json!(batch)))
    };
    let keyed = |ctx: StepContext| async move {
        let answer: Vec<Json> = ctx.messages().iter().map(|m| m.payload.clone()).collect();
        Ok(StepResult::end().set("answer", json!(answer)))
    };
    FlowType::new("Inbox", "Start")
        .step(StepDef::new("Start", start))
        .step(StepDef::new("Receive", receive))
        .step(StepDef::new("Batch", batch))
        .step(StepDef::new("Keyed", keyed))
}

/// `Sleeper`: sets a deadline, then a timer that fires before it (on purpose),
/// so `Wake` must wait again until the deadline.
fn sleeper_flow() -> FlowType {
    let start =
        |ctx: StepContext| async move {
            let now = ctx.now().await?;
            let deadline = now + ctx.input()["deadline_ms"].as_i64().unwrap_or(300);
            let early = now + ctx.input()["early_ms"].as_i64().unwrap_or(100);
            Ok(StepResult::go_to(
                StepCall::new("Wake", json!({ "deadline": deadline })).wake_at(early),
            )
            .set("deadline", json!(deadline)))
        };
    let wake = |ctx: StepContext| async move {
        let now = ctx.now().await?;
        let deadline = ctx.input()["deadline"].as_i64().unwrap_or(0);
        let early: i64 = ctx.get_value("early_wakes", "").await?.unwrap_or(0);
        if !ctx.timer_fired() {
            return Err(StepError::fatal("Wake ran without its timer"));
        }
        if now < deadline {
            return Ok(StepResult::go_to(
                StepCall::new("Wake", ctx.input().clone()).wake_at(deadline),
            )
            .set("early_wakes", json!(early + 1)));
        }
        Ok(StepResult::end().set("woke_at", json!(now)))
    };
    FlowType::new("Sleeper", "Start")
        .step(StepDef::new("Start", start))
        .step(StepDef::new("Wake", wake))
}

/// `Locker`: `Hold` holds the `GUARDED` attribute until the test releases it.
fn locker_flow(probe: Arc<Probe>) -> FlowType {
    let hold = move |_ctx: StepContext| {
        let probe = probe.clone();
        async move {
            probe.ran("Hold");
            probe.release.notified().await;
            Ok(StepResult::end().set("held", json!(true)))
        }
    };
    FlowType::new("Locker", "Hold").step(StepDef::new("Hold", hold).locks(["GUARDED"]))
}

/// `Streamer`: appends `count` entries of `size` bytes to its stream, live.
fn stream_flow() -> FlowType {
    let write = |ctx: StepContext| async move {
        let count = ctx.input()["count"].as_u64().unwrap_or(10);
        let size = ctx.input()["size"].as_u64().unwrap_or(10) as usize;
        for n in 0..count {
            ctx.append_stream("events", vec![json!({ "n": n, "pad": "x".repeat(size) })])
                .await?;
        }
        Ok(StepResult::end().append("events", json!({ "n": "last" })))
    };
    FlowType::new("Streamer", "Write").step(StepDef::new("Write", write))
}

/// `Gated`: `Work` marks a gate file and waits for its release file, so a test
/// can kill the worker process at that point. With `heartbeat: true` it
/// records output first, so a lost worker means a new attempt.
fn gated_flow(probe: Arc<Probe>) -> FlowType {
    let work = move |ctx: StepContext| {
        let probe = probe.clone();
        async move {
            let Some(dir) = probe.gate_dir.clone() else {
                return Err(StepError::fatal("Gated needs a gate directory"));
            };
            if ctx.input()["heartbeat"].as_bool().unwrap_or(false) {
                ctx.heartbeat().await?;
            }
            let name = format!("{}-attempt-{}", ctx.flow_id(), ctx.attempt());
            let pid = std::process::id().to_string();
            std::fs::write(dir.join(format!("{name}.reached")), pid)
                .map_err(|err| StepError::retryable(err.to_string()))?;
            let release = dir.join(format!("{}.release", ctx.flow_id()));
            while !release.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(StepResult::end().set("worked_on_attempt", json!(ctx.attempt())))
        }
    };
    FlowType::new("Gated", "Work").step(StepDef::new("Work", work).policy(quick(3)))
}

/// `Once`: `Act` is a single-attempt side effect. It records output first
/// (its durable "started" marker), then acts, counted per flow as
/// `Act:<flow id>`; a lost worker after the marker takes the failure route
/// `Unknown`, never a second run.
fn once_flow(probe: Arc<Probe>) -> FlowType {
    let act = move |ctx: StepContext| {
        let probe = probe.clone();
        async move {
            ctx.heartbeat().await?;
            probe.ran(&format!("Act:{}", ctx.flow_id()));
            Ok(StepResult::end().set("acted", json!(true)))
        }
    };
    let unknown = |ctx: StepContext| async move {
        Ok(StepResult::end().set("unknown", json!(ctx.failure().unwrap_or_default())))
    };
    FlowType::new("Once", "Act")
        .step(
            StepDef::new("Act", act)
                .policy(quick(1))
                .failure_route("Unknown"),
        )
        .step(StepDef::new("Unknown", unknown))
}

/// `Noop`: one Step that does nothing.
fn noop_flow() -> FlowType {
    FlowType::new("Noop", "Step").step(StepDef::new("Step", |_ctx: StepContext| async move {
        Ok(StepResult::end())
    }))
}

/// Polls `probe` until it returns `Some`, failing after `deadline`.
pub async fn wait_until<T, F, Fut>(description: &str, deadline: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            started.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {description}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Creates flow `flow_id` of a type no worker here runs, straight in the
/// store: a running flow whose streams a test may append to (a store takes
/// live appends only for a running flow).
pub async fn create_running_flow(store: &dyn FlowStore, flow_id: &str) {
    store
        .create_flow(
            flow_id,
            "Idle",
            dexa::flow::NewTask {
                step_type: "Start".into(),
                input: serde_json::json!({}),
                wait: None,
                policy: dexa::flow::RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            },
        )
        .await
        .unwrap_or_else(|err| panic!("create flow {flow_id}: {err}"));
}
