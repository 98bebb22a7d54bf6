//! `dexa bench swap`: the benchmark turn of `dexa bench turn` under 16
//! concurrent clients, served by two workers (each with its own view of the
//! component catalog, as two processes would have), once with no
//! activation and once with a runner activation every second (alternating
//! between two versions). It reports turns/s and turn p50/p99 of both runs,
//! the failed turns, how long each worker took to see each activation, and
//! how long until a turn first ran the activated version.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use super::bench::{micros, percentile};
use super::bench_turn::{cpu_ticks, steal_since, Bench, TurnWatch, AGENT};
use crate::catalog::{ActivationMode, RUNNER_ROLE};
use crate::config::activate::{activate, ActivationRequest, VersionSource};
use crate::config::versions::config_engine;
use crate::config::{Deployment, DexaConfig};
use crate::flow::{StoreMillis, WorkerOptions};
use crate::session::step;

#[derive(Args, Debug)]
pub struct SwapBenchArgs {
    /// Where the built guests are (scripted-runner.wasm, tiny-tool.wasm).
    #[arg(long, default_value = "target/guests")]
    pub guests_dir: PathBuf,
    /// Where compiled components are cached.
    #[arg(long, default_value = ".dexa/cache/components", env = "DEXA_CACHE_DIR")]
    pub cache_dir: PathBuf,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long each run lasts, in seconds.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Tool calls the model asks for in each turn.
    #[arg(long, default_value_t = 4)]
    pub tool_calls: usize,
}

/// `wasm` with a custom section appended: the same component, another digest.
fn variant(wasm: &[u8], tag: &str) -> Vec<u8> {
    let mut body = vec![9u8];
    body.extend_from_slice(b"dexa-swap");
    body.extend_from_slice(tag.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0);
    out.push(body.len() as u8);
    out.extend_from_slice(&body);
    out
}

fn config_text(args: &SwapBenchArgs, runner: &std::path::Path) -> String {
    let calls: Vec<_> = (1..=args.tool_calls)
        .map(|n| json!({"id": format!("c{n}"), "name": "echo", "arguments": {"n": n}, "effect": "read"}))
        .collect();
    let script = json!({"turns": [{"steps": [{"tool_calls": calls}, {"text": "done"}]}]});
    format!(
        "store = \"sqlite:swap.sqlite?synchronous=normal\"\ncache_dir = {cache:?}\n\
         [components.runner]\npath = {runner:?}\nconfig = {{ script = {script:?} }}\n\
         [components.tiny]\npath = {tool:?}\n\
         [agents.{AGENT}]\nrunner = \"runner\"\ntools = [\"tiny\"]\n\
         tool_policies = {{ echo = {{ effect = \"read\" }} }}\n",
        cache = std::path::absolute(&args.cache_dir).unwrap_or_else(|_| args.cache_dir.clone()),
        runner = runner,
        tool = std::path::absolute(args.guests_dir.join("tiny-tool.wasm"))
            .unwrap_or_else(|_| args.guests_dir.join("tiny-tool.wasm")),
        script = script.to_string(),
    )
}

/// One measured run: turns/s, latencies, failures.
struct RunResult {
    latencies: Vec<Duration>,
    failed: usize,
    elapsed: Duration,
    steal: String,
}

async fn load(bench: &Arc<Bench>, clients: usize, seconds: u64, label: &str) -> RunResult {
    let ticks = cpu_ticks();
    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (bench, next, label) = (bench.clone(), next.clone(), label.to_string());
        tasks.spawn(async move {
            let (mut latencies, mut failed) = (Vec::new(), 0usize);
            while Instant::now() < until {
                let session = format!("{label}-{}", next.fetch_add(1, Ordering::Relaxed));
                if bench.sessions.start_session(&session, "").await.is_err() {
                    failed += 1;
                    continue;
                }
                for turn in 1..=4 {
                    match bench.turn(&session, turn).await {
                        Ok(took) => latencies.push(took),
                        Err(err) => {
                            eprintln!("  a turn failed: {err:#}");
                            failed += 1;
                            break;
                        }
                    }
                }
            }
            (latencies, failed)
        });
    }
    let (mut latencies, mut failed) = (Vec::new(), 0);
    while let Some(joined) = tasks.join_next().await {
        if let Ok((l, f)) = joined {
            latencies.extend(l);
            failed += f;
        } else {
            failed += 1;
        }
    }
    latencies.sort();
    RunResult {
        latencies,
        failed,
        elapsed: started.elapsed(),
        steal: steal_since(ticks),
    }
}

fn report(name: &str, run: &RunResult) {
    println!(
        "swap/{name}: {} turns in {:.1} s = {:.0} turns/s; turn p50 {}, p99 {}; {} failed; CPU steal {}",
        run.latencies.len(),
        run.elapsed.as_secs_f64(),
        run.latencies.len() as f64 / run.elapsed.as_secs_f64(),
        micros(percentile(&run.latencies, 0.50)),
        micros(percentile(&run.latencies, 0.99)),
        run.failed,
        run.steal,
    );
}

pub async fn run(args: SwapBenchArgs) -> anyhow::Result<()> {
    let runner_path = std::path::absolute(args.guests_dir.join("scripted-runner.wasm"))?;
    anyhow::ensure!(
        runner_path.is_file() && args.guests_dir.join("tiny-tool.wasm").is_file(),
        "{} or tiny-tool.wasm is missing; build the guests first with guests/build.sh",
        runner_path.display()
    );
    let temp = tempfile::tempdir()?;
    let v1 = std::fs::read(&runner_path)?;
    let v2_path = temp.path().join("scripted-runner-v2.wasm");
    std::fs::write(&v2_path, variant(&v1, "v2"))?;
    let config_path = temp.path().join("dexa.toml");
    std::fs::write(&config_path, config_text(&args, &runner_path))?;
    eprintln!("bench swap: loading two workers (the first run compiles)");
    let watch = Arc::new(TurnWatch::default());
    let mut deployments = Vec::new();
    let mut workers = Vec::new();
    for n in 0..2 {
        let deployment = Deployment::for_workers(DexaConfig::load(&config_path)?, &|_| {}).await?;
        let observed = watch.clone();
        let options = WorkerOptions {
            worker_id: format!("swap-worker-{n}"),
            max_concurrent_tasks: 64,
            poll_interval: Duration::from_millis(20),
            on_step_committed: Some(Arc::new(move |task, _| {
                if task.step_type == step::RUN_MODEL {
                    observed.notify_of(&task.flow_id).notify_one();
                }
            })),
            ..WorkerOptions::default()
        };
        workers.push(tokio::spawn(
            deployment.worker_with(options).run(std::future::pending()),
        ));
        deployments.push(deployment);
    }
    let client = &deployments[0];
    let bench = Arc::new(Bench {
        store: client.store.clone(),
        sessions: client.sessions(AGENT)?,
        watch,
    });
    // Warm-up, not measured: both versions load on both workers.
    let engine = config_engine(&client.config)?;
    let versions = [
        VersionSource::File(v2_path.clone()),
        VersionSource::File(runner_path.clone()),
    ];
    for source in &versions {
        activate_one(client, &engine, source.clone()).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        load(&bench, args.clients, 1, "warm").await;
    }

    let steady = load(&bench, args.clients, args.seconds, "steady").await;
    report("steady", &steady);

    // The same load, with an activation every second.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (stop, engine, config) = (stop.clone(), engine.clone(), client.config.clone());
        let catalog = client.catalog.clone();
        let watches: Vec<_> = deployments.iter().filter_map(|d| d.watch.clone()).collect();
        tokio::spawn(async move {
            let mut activations: Vec<(StoreMillis, String)> = Vec::new();
            let mut visible: Vec<Duration> = Vec::new();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let tick = Instant::now();
                let request = ActivationRequest {
                    agent: AGENT.to_string(),
                    role: RUNNER_ROLE.to_string(),
                    source: versions[n % 2].clone(),
                    mode: ActivationMode::Current,
                    upgrade_in_flight: false,
                    actor: "bench".to_string(),
                    reason: format!("swap {n}"),
                    after_seq: None,
                };
                match activate(&config, &engine, &*catalog, request).await {
                    Ok(activation) => {
                        let committed = Instant::now();
                        // How long until each worker's view has it.
                        for watch in &watches {
                            loop {
                                match watch.current().await {
                                    Ok(states) if states.last_seq >= activation.seq => break,
                                    _ => tokio::time::sleep(Duration::from_millis(2)).await,
                                }
                            }
                            visible.push(committed.elapsed());
                        }
                        activations.push((activation.at, activation.digest));
                    }
                    Err(err) => eprintln!("  an activation failed: {err}"),
                }
                n += 1;
                tokio::time::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed())).await;
            }
            (activations, visible)
        })
    };
    let swapping = load(&bench, args.clients, args.seconds, "swap").await;
    stop.store(true, Ordering::Relaxed);
    let (activations, mut visible) = swapper.await?;
    report("with-activations", &swapping);
    let ratio = percentile(&swapping.latencies, 0.99).as_secs_f64()
        / percentile(&steady.latencies, 0.99).as_secs_f64().max(1e-9);
    println!(
        "swap/p99-ratio: {ratio:.2}x the steady run (goal: at most 1.5x); {} activations",
        activations.len()
    );
    visible.sort();
    println!(
        "swap/visible-on-each-worker: p50 {}, p99 {}, max {} over {} (activation x worker)",
        micros(percentile(&visible, 0.50)),
        micros(percentile(&visible, 0.99)),
        micros(visible.last().copied().unwrap_or_default()),
        visible.len()
    );
    let mut first_use = first_use(client, &activations).await?;
    first_use.sort();
    println!(
        "swap/activation-to-first-turn: p50 {}, p99 {}, max {} over {} activations (store clock, ms resolution)",
        micros(percentile(&first_use, 0.50)),
        micros(percentile(&first_use, 0.99)),
        micros(first_use.last().copied().unwrap_or_default()),
        first_use.len()
    );
    for worker in workers {
        worker.abort();
    }
    Ok(())
}

async fn activate_one(
    deployment: &Deployment,
    engine: &crate::plugin::SandboxEngine,
    source: VersionSource,
) -> anyhow::Result<()> {
    let request = ActivationRequest {
        agent: AGENT.to_string(),
        role: RUNNER_ROLE.to_string(),
        source,
        mode: ActivationMode::Current,
        upgrade_in_flight: false,
        actor: "bench".to_string(),
        reason: "warm-up".to_string(),
        after_seq: None,
    };
    activate(&deployment.config, engine, &*deployment.catalog, request).await?;
    Ok(())
}

/// For each activation, how long until a turn first began on its version
/// (the start of the AwaitUserMessage attempt that pinned it).
async fn first_use(
    deployment: &Deployment,
    activations: &[(StoreMillis, String)],
) -> anyhow::Result<Vec<Duration>> {
    let mut starts: Vec<(StoreMillis, String)> = Vec::new();
    for flow in deployment
        .store
        .list_flows(Some(AGENT), None, usize::MAX)
        .await?
    {
        for entry in deployment.store.step_history(&flow.flow_id).await? {
            if entry.step_type != step::AWAIT_USER_MESSAGE {
                continue;
            }
            if let (Some(at), Some(digest)) = (entry.started_at, entry.component) {
                starts.push((at, digest));
            }
        }
    }
    starts.sort();
    let mut waits = Vec::new();
    for (index, (at, digest)) in activations.iter().enumerate() {
        let until = activations.get(index + 1).map_or(StoreMillis::MAX, |a| a.0);
        let first = starts
            .iter()
            .find(|(started, used)| *started >= *at && *started < until && used == digest);
        if let Some((started, _)) = first {
            waits.push(Duration::from_millis((started - at) as u64));
        }
    }
    Ok(waits)
}
