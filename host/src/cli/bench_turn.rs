//! `dexa bench turn`: one agent turn through AgentSessionFlow on each store
//! given (`--store sqlite`, the default, and/or `--store postgres://...`,
//! side by side), every Step in a fresh sandbox as in production: AwaitUserMessage
//! (build-user-message), RunModel returning N tool calls, N parallel CallTool
//! Steps, ResumeTurn, the final RunModel, and the append.
//!
//! The runner is `scripted-runner` (its script comes from config) and the
//! tools are `tiny-tool`'s instant `echo`. The worker runs in this process;
//! a turn's latency is from `send_user_message` to the commit that completes
//! the turn, observed through the worker's commit hook.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::json;
use tokio::sync::Notify;

use super::bench::{micros, percentile};
use super::bench_store::BenchStore;
use super::EngineArgs;
use crate::flow::{FlowClient, FlowStore, Registry, Worker, WorkerOptions};
use crate::plugin::{ComponentSettings, SandboxConfig, SandboxEngine};
use crate::session::{
    step, AgentComponents, AgentSessionClient, AgentSessionFlow, AgentSessionOptions, AgentState,
    ToolEffect, ToolPolicy, AGENT_STATE,
};
use crate::store::sqlite::Synchronous;

#[derive(Args, Debug)]
pub struct TurnBenchArgs {
    /// Where the built guests are (scripted-runner.wasm, tiny-tool.wasm).
    #[arg(long, default_value = "target/guests")]
    pub guests_dir: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// SQLite's synchronous mode: full (durable on power loss, the default
    /// here) or normal.
    #[arg(long, default_value = "full")]
    pub synchronous: String,
    /// Sessions of the sequential run.
    #[arg(long, default_value_t = 20)]
    pub sequential_sessions: usize,
    /// Turns per session of the sequential run.
    #[arg(long, default_value_t = 10)]
    pub sequential_turns: usize,
    /// Concurrent clients of the throughput run.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Sessions of the throughput run.
    #[arg(long, default_value_t = 50)]
    pub sessions: usize,
    /// Turns per session of the throughput run.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Tool calls the model asks for in each turn.
    #[arg(long, default_value_t = 4)]
    pub tool_calls: usize,
    /// Steps the worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Where to put a SQLite store (a temporary directory by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The store: `sqlite` (a temporary file, the default) or a
    /// `postgres://` server (the run makes and drops a schema of its own).
    /// Give it more than once to compare backends in one run.
    #[arg(long = "store", value_name = "sqlite|postgres://...")]
    pub stores: Vec<String>,
    /// Also run the workload through `dexa serve` (its router and listener
    /// on a loopback port) with an HTTP client: send-and-wait turns, send
    /// then SSE turns (with the commit-to-client gap), and the throughput
    /// of send-and-wait clients.
    #[arg(long)]
    pub over_http: bool,
    /// Also compare a turn on a session holding this many messages with one
    /// on a fresh session (0: skip). The runner reads a 50-message window.
    #[arg(long, default_value_t = 0)]
    pub history: u64,
    /// Turns on each session of the `--history` comparison.
    #[arg(long, default_value_t = 50)]
    pub history_turns: usize,
}

/// One backend's figures, for the side-by-side table.
struct TurnFigures {
    label: &'static str,
    sequential: (Duration, Duration),
    turns_per_second: f64,
    loaded: (Duration, Duration),
    http: Option<super::bench_http::HttpFigures>,
}

/// The scripted runner's turn: `tool_calls` parallel `echo` calls, then
/// the answer.
fn script(tool_calls: usize) -> serde_json::Value {
    let calls: Vec<_> = (1..=tool_calls)
        .map(|n| json!({"id": format!("c{n}"), "name": "echo", "arguments": {"n": n}, "effect": "read"}))
        .collect();
    json!({"turns": [{"steps": [{"tool_calls": calls}, {"text": "done"}]}]})
}

pub(super) const AGENT: &str = "BenchAgent";

/// Wakes the client of a session when one of its RunModel Steps commits.
#[derive(Default)]
pub(super) struct TurnWatch {
    sessions: Mutex<HashMap<String, Arc<Notify>>>,
}

impl TurnWatch {
    pub(super) fn notify_of(&self, session_id: &str) -> Arc<Notify> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions
            .entry(session_id.to_string())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone()
    }
}

pub(super) struct Bench {
    pub(super) store: Arc<dyn FlowStore>,
    pub(super) sessions: AgentSessionClient,
    pub(super) watch: Arc<TurnWatch>,
}

impl Bench {
    /// Sends one message and waits until the session has finished `turn`.
    pub(super) async fn turn(&self, session_id: &str, turn: u64) -> anyhow::Result<Duration> {
        let notify = self.watch.notify_of(session_id);
        let started = Instant::now();
        anyhow::ensure!(
            self.sessions
                .send_user_message(session_id, &format!("turn {turn}"))
                .await?,
            "the message was refused"
        );
        loop {
            tokio::time::timeout(Duration::from_secs(30), notify.notified())
                .await
                .with_context(|| format!("{session_id}: turn {turn} did not finish in 30 s"))?;
            let state: Option<AgentState> =
                match self.store.get(session_id, AGENT_STATE, "").await? {
                    Some(value) => Some(serde_json::from_value(value.value)?),
                    None => None,
                };
            if let Some(state) = state {
                if state.turn_count >= turn && state.active_turn_id.is_none() {
                    if let Some(error) = state.last_turn_error {
                        anyhow::bail!("{session_id}: turn {turn} failed: {error}");
                    }
                    return Ok(started.elapsed());
                }
            }
        }
    }
}

/// The machine's CPU counters (`/proc/stat`): (steal, total) in ticks.
pub(super) fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    Some((*fields.get(7)?, fields.iter().sum()))
}

/// The share of CPU time the hypervisor took away since `since` (a noisy
/// neighbour slows every number of the run).
pub(super) fn steal_since(since: Option<(u64, u64)>) -> String {
    match (since, cpu_ticks()) {
        (Some((steal0, total0)), Some((steal1, total1))) if total1 > total0 => format!(
            "{:.0}%",
            100.0 * (steal1 - steal0) as f64 / (total1 - total0) as f64
        ),
        _ => "unknown".to_string(),
    }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|kib| kib.parse().ok())
}

pub async fn run(args: TurnBenchArgs) -> anyhow::Result<()> {
    let synchronous: Synchronous = args.synchronous.parse().map_err(anyhow::Error::msg)?;
    let specs = if args.stores.is_empty() {
        vec!["sqlite".to_string()]
    } else {
        args.stores.clone()
    };
    let mut all = Vec::new();
    for spec in &specs {
        let bench =
            BenchStore::open(spec, synchronous, args.dir.as_deref(), "bench-turn.sqlite").await?;
        let figures = run_one(&args, synchronous, &bench).await;
        bench.finish().await;
        all.push(figures?);
    }
    if args.over_http {
        println!(
            "turn/http-vs-in-process: backend | in-process p50 | send?wait p50 / p99 | send+SSE p50 / p99 | {} clients turns/s: in-process, HTTP",
            args.clients
        );
        for f in &all {
            if let Some(http) = &f.http {
                println!(
                    "turn/http-vs-in-process: {:<8} | {} | {} / {} ({:.2}x) | {} / {} ({:.2}x) | {:.0}, {:.0}",
                    f.label,
                    micros(f.sequential.0),
                    micros(http.wait.0),
                    micros(http.wait.1),
                    http.wait.0.as_secs_f64() / f.sequential.0.as_secs_f64().max(1e-9),
                    micros(http.sse.0),
                    micros(http.sse.1),
                    http.sse.0.as_secs_f64() / f.sequential.0.as_secs_f64().max(1e-9),
                    f.turns_per_second,
                    http.turns_per_second
                );
            }
        }
    }
    if all.len() > 1 {
        println!(
            "turn/side-by-side: backend | sequential p50 / p99 | {} clients: turns/s, p50 / p99",
            args.clients
        );
        for f in &all {
            println!(
                "turn/side-by-side: {:<8} | {} / {} | {:.0}, {} / {}",
                f.label,
                micros(f.sequential.0),
                micros(f.sequential.1),
                f.turns_per_second,
                micros(f.loaded.0),
                micros(f.loaded.1)
            );
        }
    }
    match peak_rss_kib() {
        Some(kib) => println!(
            "turn/peak-rss: {:.1} MiB (this process: worker, store, sandboxes and the bench clients)",
            kib as f64 / 1024.0
        ),
        None => println!("turn/peak-rss: unavailable (no /proc/self/status)"),
    }
    Ok(())
}

async fn run_one(
    args: &TurnBenchArgs,
    synchronous: Synchronous,
    bench_store: &BenchStore,
) -> anyhow::Result<TurnFigures> {
    let label = bench_store.label;
    let runner_path = args.guests_dir.join("scripted-runner.wasm");
    let tool_path = args.guests_dir.join("tiny-tool.wasm");
    for path in [&runner_path, &tool_path] {
        anyhow::ensure!(
            path.is_file(),
            "{} is missing; build the guests first with guests/build.sh",
            path.display()
        );
    }
    let store: Arc<dyn FlowStore> = bench_store.store.clone();

    eprintln!("bench turn: loading components (the first run compiles them)");
    let engine = SandboxEngine::new(SandboxConfig {
        cache_dir: Some(args.engine.cache_dir.clone()),
        ..SandboxConfig::default()
    })?;
    let script = script(args.tool_calls);
    let mut config = std::collections::BTreeMap::new();
    config.insert("script".to_string(), script.to_string());
    let runner = engine.load_runner_file(
        &runner_path,
        ComponentSettings::named("scripted-runner").with_config(config),
    )?;
    let tool = engine
        .load_tool_file(&tool_path, ComponentSettings::named("tiny-tool"))
        .await?;
    let components = AgentComponents::new(Arc::new(runner), vec![Arc::new(tool)])?;
    let options =
        AgentSessionOptions::default().tool_policy("echo", ToolPolicy::new(ToolEffect::Read));
    let flow = AgentSessionFlow::new(AGENT, components, options);
    let registry = Arc::new(Registry::new([flow.definition()])?);

    let watch = Arc::new(TurnWatch::default());
    let steps = Arc::new(AtomicU64::new(0));
    let step_times: Arc<Mutex<HashMap<String, Vec<Duration>>>> = Arc::default();
    let (observed_watch, observed_steps, observed_times) =
        (watch.clone(), steps.clone(), step_times.clone());
    let worker_options = WorkerOptions {
        max_concurrent_tasks: args.concurrency,
        on_step_committed: Some(Arc::new(move |task, took| {
            observed_steps.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut times) = observed_times.lock() {
                times.entry(task.step_type.clone()).or_default().push(took);
            }
            if task.step_type == step::RUN_MODEL {
                observed_watch.notify_of(&task.flow_id).notify_one();
            }
        })),
        ..WorkerOptions::default()
    };
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry.clone(), worker_options).run(std::future::pending()),
    );
    let bench = Arc::new(Bench {
        store: store.clone(),
        sessions: AgentSessionClient::new(FlowClient::new(store.clone(), registry), AGENT),
        watch,
    });
    eprintln!(
        "bench turn [{label}]: 1 turn = RunModel -> {} x CallTool (parallel) -> ResumeTurn -> RunModel -> append; store {}{}",
        args.tool_calls,
        bench_store.address,
        if label == "sqlite" {
            format!(", synchronous={synchronous:?}")
        } else {
            String::new()
        }
    );

    // Warm-up, not measured.
    bench.sessions.start_session("warm-up", "").await?;
    for turn in 1..=3 {
        bench.turn("warm-up", turn).await?;
    }

    // Sequential: one turn at a time.
    let ticks = cpu_ticks();
    let mut latencies = Vec::new();
    for s in 0..args.sequential_sessions {
        bench
            .sessions
            .start_session(&format!("seq-{s}"), "")
            .await?;
    }
    let mut last_report = Instant::now();
    for s in 0..args.sequential_sessions {
        for turn in 1..=args.sequential_turns as u64 {
            latencies.push(bench.turn(&format!("seq-{s}"), turn).await?);
            if last_report.elapsed() > Duration::from_secs(2) {
                eprintln!("  sequential: {} turns", latencies.len());
                last_report = Instant::now();
            }
        }
    }
    latencies.sort();
    let mut per_step: Vec<(String, Vec<Duration>)> = step_times
        .lock()
        .map(|mut times| times.drain().collect())
        .unwrap_or_default();
    per_step.sort();
    for (step_type, mut times) in per_step {
        times.sort();
        println!(
            "turn[{label}]/sequential/step {step_type}: claim-to-commit p50 {}, p99 {} over {}",
            micros(percentile(&times, 0.50)),
            micros(percentile(&times, 0.99)),
            times.len()
        );
    }
    println!(
        "turn[{label}]/sequential: {} turns over {} sessions; latency p50 {}, p99 {}, max {}; CPU steal {}",
        latencies.len(),
        args.sequential_sessions,
        micros(percentile(&latencies, 0.50)),
        micros(percentile(&latencies, 0.99)),
        micros(latencies.last().copied().unwrap_or_default()),
        steal_since(ticks),
    );

    // Throughput: concurrent clients, each taking the next session.
    for s in 0..args.sessions {
        bench
            .sessions
            .start_session(&format!("load-{s}"), "")
            .await?;
    }
    let next = Arc::new(AtomicU64::new(0));
    let steps_before = steps.load(Ordering::Relaxed);
    let ticks = cpu_ticks();
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.clients {
        let (bench, next) = (bench.clone(), next.clone());
        let (sessions, turns) = (args.sessions as u64, args.turns as u64);
        clients.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let s = next.fetch_add(1, Ordering::Relaxed);
                if s >= sessions {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                for turn in 1..=turns {
                    latencies.push(bench.turn(&format!("load-{s}"), turn).await?);
                }
            }
        });
    }
    let mut loaded = Vec::new();
    while let Some(joined) = clients.join_next().await {
        loaded.extend(joined??);
    }
    let elapsed = started.elapsed();
    let committed = steps.load(Ordering::Relaxed) - steps_before;
    loaded.sort();
    println!(
        "turn[{label}]/throughput: {} clients, {} turns over {} sessions in {:.2} s = {:.0} turns/s, {:.0} Steps/s; turn latency p50 {}, p99 {}; CPU steal {}",
        args.clients,
        loaded.len(),
        args.sessions,
        elapsed.as_secs_f64(),
        loaded.len() as f64 / elapsed.as_secs_f64(),
        committed as f64 / elapsed.as_secs_f64(),
        micros(percentile(&loaded, 0.50)),
        micros(percentile(&loaded, 0.99)),
        steal_since(ticks),
    );
    if args.history > 0 {
        super::bench_long::run(&bench, label, args.history, args.history_turns).await?;
    }
    worker.abort();
    let sequential = (percentile(&latencies, 0.50), percentile(&latencies, 0.99));
    let http = if args.over_http {
        Some(
            super::bench_http::run_http(args, bench_store, synchronous, &script, sequential.0)
                .await?,
        )
    } else {
        None
    };
    Ok(TurnFigures {
        label,
        sequential,
        turns_per_second: loaded.len() as f64 / elapsed.as_secs_f64(),
        loaded: (percentile(&loaded, 0.50), percentile(&loaded, 0.99)),
        http,
    })
}
