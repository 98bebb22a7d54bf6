//! `dexa bench engine`: the durable Flow engine on each store given
//! (`--store sqlite`, the default, and/or `--store postgres://...`), side by
//! side.
//!
//! - Throughput and claim-to-commit latency of durable no-op Steps through
//!   the real worker.
//! - Wake latency: a Step waiting on a channel, woken by a message published
//!   through a second store handle on the same file (the path a client in
//!   another process takes), and a timer's lateness.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::json;

use super::bench_store::BenchStore;
use crate::flow::{
    ChannelWait, FlowClient, FlowStatus, FlowType, Registry, StepCall, StepContext, StepDef,
    StepResult, Worker, WorkerOptions,
};
use crate::store::sqlite::Synchronous;

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    /// Flows run at once.
    #[arg(long, default_value_t = 64)]
    pub flows: usize,
    /// No-op Steps per flow.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Steps the worker runs at once (more raises throughput and latency).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// SQLite's synchronous mode: normal (the default) or full.
    #[arg(long, default_value = "normal")]
    pub synchronous: String,
    /// Wake-latency samples.
    #[arg(long, default_value_t = 200)]
    pub wakes: usize,
    /// Where to put a SQLite store (a temporary directory by default).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The store: `sqlite` (a temporary file, the default) or a
    /// `postgres://` server (the run makes and drops a schema of its own).
    /// Give it more than once to compare backends in one run.
    #[arg(long = "store", value_name = "sqlite|postgres://...")]
    pub stores: Vec<String>,
}

/// One backend's figures, for the side-by-side table.
struct EngineFigures {
    label: &'static str,
    steps_per_second: f64,
    commit: (Duration, Duration),
    wake: (Duration, Duration),
    timer_late: Duration,
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

pub(crate) fn micros(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

/// The flow types the benchmark runs.
pub(super) fn bench_registry(
    woken: Arc<Mutex<Vec<(String, Instant)>>>,
) -> anyhow::Result<Registry> {
    let noop = |ctx: StepContext| async move {
        let left = ctx.input()["left"].as_u64().unwrap_or(0);
        if left == 0 {
            return Ok(StepResult::end());
        }
        Ok(StepResult::go_to(StepCall::new(
            "Step",
            json!({ "left": left - 1 }),
        )))
    };
    let woken_step = woken.clone();
    let wait_start = |_ctx: StepContext| async move {
        Ok(StepResult::go_to(
            StepCall::new("Woken", json!({})).wait_for(ChannelWait::for_one("ping")),
        ))
    };
    let woken_handler = move |ctx: StepContext| {
        let woken = woken_step.clone();
        async move {
            if let Ok(mut woken) = woken.lock() {
                woken.push((ctx.flow_id().to_string(), Instant::now()));
            }
            Ok(StepResult::end())
        }
    };
    let timer_start = |ctx: StepContext| async move {
        let at = ctx.input()["at"].as_i64().unwrap_or(0);
        Ok(StepResult::go_to(
            StepCall::new("Fired", json!({ "at": at })).wake_at(at),
        ))
    };
    let fired = |ctx: StepContext| async move {
        let late = ctx.now().await? - ctx.input()["at"].as_i64().unwrap_or(0);
        Ok(StepResult::end().set("late_ms", json!(late)))
    };
    // Waits like a model call would, then goes on (`dexa bench scale`).
    let sleep = |ctx: StepContext| async move {
        let left = ctx.input()["left"].as_u64().unwrap_or(0);
        let ms = ctx.input()["ms"].as_u64().unwrap_or(50);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        if left == 0 {
            return Ok(StepResult::end());
        }
        Ok(StepResult::go_to(StepCall::new(
            "Sleep",
            json!({ "left": left - 1, "ms": ms }),
        )))
    };
    Ok(Registry::new([
        FlowType::new("BenchNoop", "Step").step(StepDef::new("Step", noop)),
        FlowType::new("BenchSleep", "Sleep").step(StepDef::new("Sleep", sleep)),
        FlowType::new("BenchWake", "Wait")
            .step(StepDef::new("Wait", wait_start))
            .step(StepDef::new("Woken", woken_handler)),
        FlowType::new("BenchTimer", "Arm")
            .step(StepDef::new("Arm", timer_start))
            .step(StepDef::new("Fired", fired)),
    ])?)
}

pub async fn run(args: EngineBenchArgs) -> anyhow::Result<()> {
    let synchronous: Synchronous = args.synchronous.parse().map_err(anyhow::Error::msg)?;
    let specs = if args.stores.is_empty() {
        vec!["sqlite".to_string()]
    } else {
        args.stores.clone()
    };
    let mut all = Vec::new();
    for spec in &specs {
        let bench =
            BenchStore::open(spec, synchronous, args.dir.as_deref(), "bench.sqlite").await?;
        let figures = run_one(&args, synchronous, &bench).await;
        bench.finish().await;
        all.push(figures?);
    }
    if all.len() > 1 {
        println!(
            "engine/side-by-side: backend | no-op Steps/s | claim-to-commit p50 / p99 | wake by message p50 / p99 | timer lateness p50"
        );
        for f in &all {
            println!(
                "engine/side-by-side: {:<8} | {:>6.0} | {} / {} | {} / {} | {}",
                f.label,
                f.steps_per_second,
                micros(f.commit.0),
                micros(f.commit.1),
                micros(f.wake.0),
                micros(f.wake.1),
                micros(f.timer_late)
            );
        }
    }
    Ok(())
}

async fn run_one(
    args: &EngineBenchArgs,
    synchronous: Synchronous,
    bench: &BenchStore,
) -> anyhow::Result<EngineFigures> {
    let label = bench.label;
    let worker_store = bench.store.clone();
    // The client's own handle: its commits reach the worker as another
    // process's would.
    let client_store = bench.another_handle().await?;
    let woken = Arc::new(Mutex::new(Vec::new()));
    let registry = Arc::new(bench_registry(woken.clone())?);
    let client = FlowClient::new(client_store.clone(), registry.clone());

    let latencies = Arc::new(Mutex::new(Vec::with_capacity(
        args.flows * (args.steps + 1),
    )));
    let sink = latencies.clone();
    let options = WorkerOptions {
        max_concurrent_tasks: args.concurrency,
        on_step_committed: Some(Arc::new(move |_task, d| {
            if let Ok(mut all) = sink.lock() {
                all.push(d);
            }
        })),
        ..WorkerOptions::default()
    };
    let worker = tokio::spawn(
        Worker::new(worker_store.clone(), registry, options).run(std::future::pending()),
    );

    eprintln!(
        "bench engine [{label}]: {} flows x {} no-op Steps, concurrency {}, store {}{}",
        args.flows,
        args.steps + 1,
        args.concurrency,
        bench.address,
        if label == "sqlite" {
            format!(", synchronous={synchronous:?}")
        } else {
            String::new()
        }
    );
    let started = Instant::now();
    for n in 0..args.flows {
        client
            .start_flow(
                "BenchNoop",
                &format!("noop-{n}"),
                json!({ "left": args.steps }),
            )
            .await?;
    }
    let total_steps = args.flows * (args.steps + 1);
    let mut last_report = Instant::now();
    loop {
        let done = latencies.lock().map(|l| l.len()).unwrap_or(0);
        if done >= total_steps {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(2) {
            eprintln!("  {done}/{total_steps} Steps committed");
            last_report = Instant::now();
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "the benchmark took over 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let mut sorted = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    sorted.sort();
    let unfinished = client_store
        .list_flows(Some("BenchNoop"), None, args.flows)
        .await?
        .into_iter()
        .filter(|f| f.status != FlowStatus::Completed)
        .count();
    anyhow::ensure!(unfinished == 0, "{unfinished} flows did not complete");
    let commit = (percentile(&sorted, 0.50), percentile(&sorted, 0.99));
    println!(
        "engine[{label}]/noop-steps: {total_steps} Steps in {:.2} s = {:.0} Steps/s; claim-to-commit p50 {}, p99 {}",
        elapsed.as_secs_f64(),
        total_steps as f64 / elapsed.as_secs_f64(),
        micros(percentile(&sorted, 0.50)),
        micros(percentile(&sorted, 0.99)),
    );

    // Wake latency through another store handle (the cross-process path).
    let mut wakes = Vec::with_capacity(args.wakes);
    for n in 0..args.wakes {
        let flow_id = format!("wake-{n}");
        client.start_flow("BenchWake", &flow_id, json!({})).await?;
        // Wait until the Step is parked on its channel.
        let parked = Instant::now();
        while client_store.step_history(&flow_id).await?.is_empty() {
            anyhow::ensure!(
                parked.elapsed() < Duration::from_secs(10),
                "{flow_id} never parked"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let sent = Instant::now();
        client
            .rpc(&flow_id, |tx| Ok(tx.publish("ping", "", json!(1))?))
            .await?;
        let woke_at = loop {
            let found = woken
                .lock()
                .ok()
                .and_then(|w| w.iter().find(|(id, _)| *id == flow_id).map(|(_, at)| *at));
            if let Some(at) = found {
                break at;
            }
            anyhow::ensure!(
                sent.elapsed() < Duration::from_secs(10),
                "{flow_id} never woke"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        wakes.push(woke_at.saturating_duration_since(sent));
    }
    wakes.sort();
    println!(
        "engine[{label}]/wake-by-message (another store handle): p50 {}, p99 {}, max {} over {} wakes",
        micros(percentile(&wakes, 0.50)),
        micros(percentile(&wakes, 0.99)),
        micros(wakes.last().copied().unwrap_or_default()),
        wakes.len()
    );

    let mut lateness = Vec::new();
    for n in 0..20 {
        let flow_id = format!("timer-{n}");
        let at = client_store.now().await? + 30;
        client
            .start_flow("BenchTimer", &flow_id, json!({ "at": at }))
            .await?;
        let started = Instant::now();
        let late = loop {
            if let Some(value) = client_store.get(&flow_id, "late_ms", "").await? {
                break value.value.as_i64().context("late_ms")?;
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "{flow_id} never fired"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        lateness.push(Duration::from_millis(late.max(0) as u64));
    }
    lateness.sort();
    println!(
        "engine[{label}]/timer-lateness: p50 {}, max {} over {} timers",
        micros(percentile(&lateness, 0.50)),
        micros(lateness.last().copied().unwrap_or_default()),
        lateness.len()
    );
    worker.abort();
    Ok(EngineFigures {
        label,
        steps_per_second: total_steps as f64 / elapsed.as_secs_f64(),
        commit,
        wake: (percentile(&wakes, 0.50), percentile(&wakes, 0.99)),
        timer_late: percentile(&lateness, 0.50),
    })
}
