//! `dexa bench scale`: how throughput grows with worker processes when
//! Steps wait (50 ms by default, like a model call) rather than compute.
//! With Steps that wait, N workers of S slots can run N x S Steps at once,
//! so throughput should grow with N until coordination through the store
//! is the limit; this measures how close it stays.
//!
//! Each worker is a process of its own (`dexa bench scale-worker`, hidden),
//! as on separate machines. Throughput is Steps over the span from the
//! first Step's start to the last Step's commit, both read from the Step
//! history on the store's clock, so process start-up does not count; nor
//! does a process's first second: each worker first runs a warm-up flow
//! per slot (its pool's connections are new server processes with cold
//! caches), and the measured flows, all created before any worker starts,
//! fall due together after it. The steady figure leaves out the first and
//! last tenth of the commits too: the end of a run, when fewer flows are
//! left than slots, weighs more in a short run.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use super::bench::{bench_registry, micros, percentile};
use super::bench_store::BenchStore;
use crate::flow::{FlowClient, FlowStatus, StepCall, Worker, WorkerOptions};
use crate::store::sqlite::Synchronous;

#[derive(Args, Debug)]
pub struct ScaleBenchArgs {
    /// The store: a postgres:// server (a fresh schema per run) or sqlite.
    #[arg(long)]
    pub store: String,
    /// Worker process counts to run, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub workers: Vec<usize>,
    /// Steps each worker runs at once.
    #[arg(long, default_value_t = 16)]
    pub slots: usize,
    /// How long each Step waits, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub step_ms: u64,
    /// Flows run at once (more than the workers' slots keeps them busy).
    #[arg(long, default_value_t = 256)]
    pub flows: usize,
    /// Steps per flow.
    #[arg(long, default_value_t = 25)]
    pub steps: usize,
    /// How long the worker processes get to come up and run their warm-up
    /// before the measured flows fall due, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub start_up_ms: u64,
    /// Also print how many Steps committed in each 250 ms of a run.
    #[arg(long)]
    pub timeline: bool,
}

/// A worker process of the scale benchmark.
#[derive(Args, Debug)]
pub struct ScaleWorkerArgs {
    #[arg(long)]
    pub store: String,
    #[arg(long)]
    pub slots: usize,
    #[arg(long)]
    pub worker_id: String,
}

pub async fn worker(args: ScaleWorkerArgs) -> anyhow::Result<()> {
    let (store, _) = crate::store::open_address(&args.store).await?;
    let registry = Arc::new(bench_registry(Arc::new(Mutex::new(Vec::new())))?);
    let options = WorkerOptions {
        worker_id: args.worker_id,
        max_concurrent_tasks: args.slots,
        ..WorkerOptions::default()
    };
    Worker::new(store, registry, options)
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    Ok(())
}

/// One run's figures.
struct ScaleFigures {
    steps: usize,
    span: Duration,
    /// Steps per second while every slot is busy: between the commits of
    /// the 10th and the 90th percentile, leaving out the start (workers
    /// taking their first tasks) and the end (fewer flows left than slots).
    steady: f64,
    overhead: (Duration, Duration),
}

pub async fn run(args: ScaleBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers.iter().all(|n| *n > 0) && !args.workers.is_empty(),
        "--workers takes counts of at least 1, like 1,2,4"
    );
    let mut all: Vec<ScaleFigures> = Vec::new();
    for &workers in &args.workers {
        let bench =
            BenchStore::open(&args.store, Synchronous::Normal, None, "scale.sqlite").await?;
        let figures = run_one(&args, &bench, workers).await;
        bench.finish().await;
        let figures = figures?;
        let base = all
            .first()
            .map(|first| first.steps as f64 / first.span.as_secs_f64());
        let steady_base = all.first().map(|first| first.steady);
        let rate = figures.steps as f64 / figures.span.as_secs_f64();
        println!(
            "scale[{}]/workers={workers}x{} slots: {} Steps of {} ms in {:.2} s = {:.0} Steps/s{}; \
             steady (10th to 90th percentile commit) {:.0} Steps/s{}; \
             overhead beyond the wait p50 {}, p99 {}",
            bench_label(&args.store),
            args.slots,
            figures.steps,
            args.step_ms,
            figures.span.as_secs_f64(),
            rate,
            base.map(|base| format!(" ({:.2}x of the first run)", rate / base))
                .unwrap_or_default(),
            figures.steady,
            steady_base
                .map(|base| format!(" ({:.2}x)", figures.steady / base))
                .unwrap_or_default(),
            micros(figures.overhead.0),
            micros(figures.overhead.1),
        );
        all.push(figures);
    }
    Ok(())
}

/// Steps of each warm-up flow.
const WARM_UP_STEPS: usize = 4;

fn bench_label(spec: &str) -> &'static str {
    if spec.starts_with("postgres") {
        "postgres"
    } else {
        "sqlite"
    }
}

async fn run_one(
    args: &ScaleBenchArgs,
    bench: &BenchStore,
    workers: usize,
) -> anyhow::Result<ScaleFigures> {
    // What is measured is how the workers run the work: not how fast one
    // client creates it while they wait, nor a process's first second (its
    // pool opening connections, each a server process with cold caches).
    // So every flow exists before the workers start; a warm-up flow per
    // slot runs first; and the measured flows all fall due at one time,
    // after it.
    let registry = Arc::new(bench_registry(Arc::new(Mutex::new(Vec::new())))?);
    let client = FlowClient::new(bench.store.clone(), registry.clone());
    for n in 0..workers * args.slots {
        client
            .start_flow(
                "BenchSleep",
                &format!("warm-{n}"),
                json!({ "left": WARM_UP_STEPS - 1, "ms": args.step_ms }),
            )
            .await?;
    }
    let due = bench.store.now().await? + args.start_up_ms as i64 + 5 * args.flows as i64;
    for n in 0..args.flows {
        let mut first = registry.new_task(
            "BenchSleep",
            StepCall::new(
                "Sleep",
                json!({ "left": args.steps.saturating_sub(1), "ms": args.step_ms }),
            ),
            due,
            None,
        )?;
        first.not_before = due;
        bench
            .store
            .create_flow(&format!("sleep-{n}"), "BenchSleep", first)
            .await?;
    }
    anyhow::ensure!(
        bench.store.now().await? < due,
        "creating the flows took past the time they fall due; raise --start-up-ms"
    );
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for n in 0..workers {
        let child = tokio::process::Command::new(&exe)
            .args(["bench", "scale-worker", "--store", &bench.address])
            .args(["--slots", &args.slots.to_string()])
            .args(["--worker-id", &format!("scale-{n}")])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        children.push(child);
    }
    eprintln!(
        "bench scale: {workers} worker process(es) x {} slots, {} flows x {} Steps of {} ms",
        args.slots, args.flows, args.steps, args.step_ms
    );
    let started = Instant::now();
    let mut last_report = Instant::now();
    loop {
        let flows = bench
            .store
            .list_flows(Some("BenchSleep"), None, args.flows + workers * args.slots)
            .await?;
        let done = flows
            .iter()
            .filter(|f| f.status == FlowStatus::Completed && f.flow_id.starts_with("sleep-"))
            .count();
        anyhow::ensure!(
            flows.iter().all(|f| f.status != FlowStatus::Failed),
            "a flow failed"
        );
        if done == args.flows {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(2) {
            eprintln!("  {done}/{} flows done", args.flows);
            last_report = Instant::now();
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(900),
            "the run took over 15 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Gone before the schema is dropped: a killed worker's connections must
    // close first, or the drop waits on their locks.
    for child in &mut children {
        let _ = child.start_kill();
    }
    for child in &mut children {
        let _ = child.wait().await;
    }
    let (mut first, mut last) = (i64::MAX, i64::MIN);
    let mut overhead = Vec::new();
    let mut commits = Vec::new();
    let mut steps = 0;
    for n in 0..args.flows {
        for entry in bench.store.step_history(&format!("sleep-{n}")).await? {
            let begun = entry.started_at.unwrap_or(entry.at);
            first = first.min(begun);
            last = last.max(entry.at);
            commits.push(entry.at);
            let took = (entry.at - begun).max(0) as u64;
            overhead.push(Duration::from_millis(took.saturating_sub(args.step_ms)));
            steps += 1;
        }
    }
    anyhow::ensure!(steps > 0, "no Step history");
    let mut warm_last = i64::MIN;
    for n in 0..workers * args.slots {
        for entry in bench.store.step_history(&format!("warm-{n}")).await? {
            warm_last = warm_last.max(entry.at);
        }
    }
    if warm_last > first {
        eprintln!(
            "bench scale: the warm-up ran until {} ms after the measured flows started (the \
             workers came up late), so the figures include it; a larger --start-up-ms avoids that",
            warm_last - first
        );
    }
    overhead.sort();
    commits.sort();
    if args.timeline {
        let mut buckets = std::collections::BTreeMap::new();
        for at in &commits {
            *buckets.entry((at - first) / 250).or_insert(0) += 1;
        }
        eprintln!(
            "timeline (commits per 250 ms): {:?}",
            buckets.values().collect::<Vec<_>>()
        );
    }
    let (low, high) = (commits.len() / 10, commits.len() * 9 / 10);
    let middle = (commits[high.min(commits.len() - 1)] - commits[low]).max(1);
    Ok(ScaleFigures {
        steps,
        span: Duration::from_millis((last - first).max(1) as u64),
        // Too few commits for a middle: the whole span's rate.
        steady: if high > low {
            (high - low) as f64 * 1000.0 / middle as f64
        } else {
            steps as f64 * 1000.0 / (last - first).max(1) as f64
        },
        overhead: (percentile(&overhead, 0.50), percentile(&overhead, 0.99)),
    })
}
