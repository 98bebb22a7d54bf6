//! `dexa bench scale`: how throughput grows with worker processes when
//! Steps wait (50 ms by default, like a model call) rather than compute.
//! With Steps that wait, N workers of S slots can run N x S Steps at once,
//! so throughput should grow with N until coordination through the store
//! is the limit; this measures how close it stays.
//!
//! Each worker is a process of its own (`dexa bench scale-worker`, hidden),
//! as on separate machines. Throughput is Steps over the span from the
//! first Step's start to the last Step's commit, both read from the Step
//! history on the store's clock, so process start-up does not count.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use super::bench::{bench_registry, micros, percentile};
use super::bench_store::BenchStore;
use crate::flow::{FlowClient, FlowStatus, Worker, WorkerOptions};
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
        let rate = figures.steps as f64 / figures.span.as_secs_f64();
        println!(
            "scale[{}]/workers={workers}x{} slots: {} Steps of {} ms in {:.2} s = {:.0} Steps/s{}; \
             overhead beyond the wait p50 {}, p99 {}",
            bench_label(&args.store),
            args.slots,
            figures.steps,
            args.step_ms,
            figures.span.as_secs_f64(),
            rate,
            base.map(|base| format!(" ({:.2}x of the first run)", rate / base))
                .unwrap_or_default(),
            micros(figures.overhead.0),
            micros(figures.overhead.1),
        );
        all.push(figures);
    }
    Ok(())
}

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
    let registry = Arc::new(bench_registry(Arc::new(Mutex::new(Vec::new())))?);
    let client = FlowClient::new(bench.store.clone(), registry);
    for n in 0..args.flows {
        client
            .start_flow(
                "BenchSleep",
                &format!("sleep-{n}"),
                json!({ "left": args.steps.saturating_sub(1), "ms": args.step_ms }),
            )
            .await?;
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
            .list_flows(Some("BenchSleep"), args.flows)
            .await?;
        let done = flows
            .iter()
            .filter(|f| f.status == FlowStatus::Completed)
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
    let mut steps = 0;
    for n in 0..args.flows {
        for entry in bench.store.step_history(&format!("sleep-{n}")).await? {
            let begun = entry.started_at.unwrap_or(entry.at);
            first = first.min(begun);
            last = last.max(entry.at);
            let took = (entry.at - begun).max(0) as u64;
            overhead.push(Duration::from_millis(took.saturating_sub(args.step_ms)));
            steps += 1;
        }
    }
    anyhow::ensure!(steps > 0, "no Step history");
    overhead.sort();
    Ok(ScaleFigures {
        steps,
        span: Duration::from_millis((last - first).max(1) as u64),
        overhead: (percentile(&overhead, 0.50), percentile(&overhead, 0.99)),
    })
}
