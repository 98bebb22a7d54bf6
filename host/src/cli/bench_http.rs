//! `dexa bench turn --over-http`: the turn benchmark's workload through
//! `dexa serve` (its router and listener, on a loopback port, with its
//! in-process worker) and a real HTTP client, in the same run as the
//! in-process figures, so that the two can be compared:
//!
//! - **send and wait**: one `POST /v1/sessions/{id}/messages?wait=30` per
//!   turn, answered when the turn completes;
//! - **send, then SSE**: a `POST` (202), then the session's event stream
//!   (one connection per session, kept open) until `turn_completed`; the
//!   gap from the commit that completed the turn (seen by the worker's commit
//!   hook) to the event reaching the client is reported too;
//! - **throughput**: concurrent clients doing send-and-wait turns.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::bench::{micros, percentile};
use super::bench_store::BenchStore;
use super::bench_turn::{cpu_ticks, steal_since, TurnBenchArgs};
use crate::api::limits::ConnectionLimits;
use crate::api::{listener, router, ApiState};
use crate::config::{Deployment, DexaConfig};
use crate::session::step;
use crate::store::sqlite::Synchronous;

/// The agent the HTTP run serves.
const AGENT: &str = "BenchHttp";
/// The bearer token of the benchmark's server.
const TOKEN: &str = "bench-http-token";

/// The HTTP run's figures, for the side-by-side table.
pub(super) struct HttpFigures {
    /// Send-and-wait latency, p50 and p99.
    pub wait: (Duration, Duration),
    /// Send-then-SSE latency, p50 and p99.
    pub sse: (Duration, Duration),
    pub turns_per_second: f64,
}

/// When each session's last RunModel committed (the worker's hook).
type Commits = Arc<Mutex<HashMap<String, Instant>>>;

struct Client {
    http: reqwest::Client,
    base: String,
}

impl Client {
    async fn start(&self, session: &str) -> anyhow::Result<()> {
        let response = self
            .http
            .post(format!("{}/v1/agents/{AGENT}/sessions", self.base))
            .bearer_auth(TOKEN)
            .json(&json!({"session_id": session}))
            .send()
            .await?;
        anyhow::ensure!(
            response.status() == reqwest::StatusCode::CREATED,
            "starting {session}: {}",
            response.text().await.unwrap_or_default()
        );
        Ok(())
    }

    fn send(&self, session: &str, query: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!(
                "{}/v1/sessions/{session}/messages{query}",
                self.base
            ))
            .bearer_auth(TOKEN)
            .json(&json!({"text": "turn"}))
    }

    /// One send-and-wait turn.
    async fn turn_waiting(&self, session: &str) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let response = self.send(session, "?wait=30").send().await?;
        let status = response.status();
        let body: Value = response.json().await?;
        anyhow::ensure!(
            status == reqwest::StatusCode::OK && body["status"] == "completed",
            "{session}: the turn did not complete: {status} {body}"
        );
        Ok(started.elapsed())
    }
}

/// Writes the HTTP run's `dexa.toml` in `dir`: the in-process run's
/// components, script and policy, on the same store.
fn write_config(
    args: &TurnBenchArgs,
    bench_store: &BenchStore,
    synchronous: Synchronous,
    script: &Value,
    dir: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    let store = match bench_store.label {
        "sqlite" => format!(
            "sqlite:{}?synchronous={}",
            bench_store.address,
            format!("{synchronous:?}").to_lowercase()
        ),
        _ => bench_store.address.clone(),
    };
    let absolute = |path: &std::path::Path| -> anyhow::Result<std::path::PathBuf> {
        std::path::absolute(path).with_context(|| format!("{}", path.display()))
    };
    let text = format!(
        "store = {store:?}\ncache_dir = {cache:?}\n[worker]\nslots = {slots}\n\
         [components.runner]\npath = {runner:?}\nconfig = {{ script = {script:?} }}\n\
         [components.tools]\npath = {tools:?}\n\
         [agents.{AGENT}]\nrunner = \"runner\"\ntools = [\"tools\"]\n\
         tool_policies = {{ echo = {{ effect = \"read\" }} }}\n",
        cache = absolute(&args.engine.cache_dir)?,
        slots = args.concurrency,
        runner = absolute(&args.guests_dir.join("scripted-runner.wasm"))?,
        tools = absolute(&args.guests_dir.join("tiny-tool.wasm"))?,
        script = script.to_string(),
    );
    let path = dir.join("dexa.toml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// Runs the HTTP half on `bench_store`, after the in-process half.
pub(super) async fn run_http(
    args: &TurnBenchArgs,
    bench_store: &BenchStore,
    synchronous: Synchronous,
    script: &Value,
    in_process_p50: Duration,
) -> anyhow::Result<HttpFigures> {
    let label = bench_store.label;
    let dir = tempfile::tempdir()?;
    let config = DexaConfig::load(&write_config(
        args,
        bench_store,
        synchronous,
        script,
        dir.path(),
    )?)?;
    let deployment = Arc::new(Deployment::for_workers(config, &|_| {}).await?);
    let commits: Commits = Arc::default();
    let seen = commits.clone();
    let mut options = deployment.config.worker.options();
    options.on_step_committed = Some(Arc::new(move |task, _| {
        if task.step_type == step::RUN_MODEL {
            if let Ok(mut seen) = seen.lock() {
                seen.insert(task.flow_id.clone(), Instant::now());
            }
        }
    }));
    let worker = tokio::spawn(deployment.worker_with(options).run(std::future::pending()));
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", tcp.local_addr()?);
    let app = router(ApiState::new(
        deployment.clone(),
        Some(Arc::new(TOKEN.to_string())),
    ));
    let limits = ConnectionLimits::new(None, None, 4096)?;
    let server = tokio::spawn(listener::serve(tcp, app, limits, std::future::pending()));
    let client = Arc::new(Client {
        http: reqwest::Client::new(),
        base: base.clone(),
    });
    eprintln!("bench turn [{label}] over HTTP: dexa serve's router and listener on {base}");
    let result = measure(args, label, &client, &commits, in_process_p50).await;
    server.abort();
    worker.abort();
    result
}

async fn measure(
    args: &TurnBenchArgs,
    label: &str,
    client: &Arc<Client>,
    commits: &Commits,
    in_process_p50: Duration,
) -> anyhow::Result<HttpFigures> {
    // Warm-up, not measured.
    client.start("http-warm-up").await?;
    for _ in 0..3 {
        client.turn_waiting("http-warm-up").await?;
    }

    // Sequential, send and wait.
    let ticks = cpu_ticks();
    let mut waited = Vec::new();
    for s in 0..args.sequential_sessions {
        let session = format!("http-wait-{s}");
        client.start(&session).await?;
        for _ in 0..args.sequential_turns {
            waited.push(client.turn_waiting(&session).await?);
        }
    }
    waited.sort();
    println!(
        "turn[{label}]/http/sequential send?wait: {} turns; latency p50 {}, p99 {} ({:.2}x the in-process p50); CPU steal {}",
        waited.len(),
        micros(percentile(&waited, 0.50)),
        micros(percentile(&waited, 0.99)),
        percentile(&waited, 0.50).as_secs_f64() / in_process_p50.as_secs_f64().max(1e-9),
        steal_since(ticks),
    );

    // Sequential, send then SSE, with the commit-to-client gap.
    let ticks = cpu_ticks();
    let mut streamed = Vec::new();
    let mut gaps = Vec::new();
    for s in 0..args.sequential_sessions {
        let session = format!("http-sse-{s}");
        client.start(&session).await?;
        let response = client
            .http
            .get(format!("{}/v1/sessions/{session}/events", client.base))
            .bearer_auth(TOKEN)
            .send()
            .await?;
        anyhow::ensure!(response.status().is_success(), "{session}: no event stream");
        let mut events = response.bytes_stream().eventsource();
        for _ in 0..args.sequential_turns {
            let started = Instant::now();
            let sent = client.send(&session, "").send().await?;
            anyhow::ensure!(
                sent.status() == reqwest::StatusCode::ACCEPTED,
                "{session}: not queued"
            );
            loop {
                let event = tokio::time::timeout(Duration::from_secs(30), events.next())
                    .await
                    .with_context(|| format!("{session}: no turn_completed in 30 s"))?
                    .with_context(|| format!("{session}: the event stream ended"))??;
                if event.event == "turn_completed" {
                    break;
                }
                anyhow::ensure!(event.event != "turn_failed", "{session}: a turn failed");
            }
            let received = Instant::now();
            streamed.push(received - started);
            let committed = commits.lock().ok().and_then(|c| c.get(&session).copied());
            if let Some(committed) = committed {
                gaps.push(received.saturating_duration_since(committed));
            }
        }
    }
    streamed.sort();
    gaps.sort();
    println!(
        "turn[{label}]/http/sequential send+SSE: {} turns; latency p50 {}, p99 {} ({:.2}x the in-process p50); commit-to-client gap p50 {}, p99 {}, max {}; CPU steal {}",
        streamed.len(),
        micros(percentile(&streamed, 0.50)),
        micros(percentile(&streamed, 0.99)),
        percentile(&streamed, 0.50).as_secs_f64() / in_process_p50.as_secs_f64().max(1e-9),
        micros(percentile(&gaps, 0.50)),
        micros(percentile(&gaps, 0.99)),
        micros(gaps.last().copied().unwrap_or_default()),
        steal_since(ticks),
    );

    // Throughput: concurrent clients, send and wait.
    for s in 0..args.sessions {
        client.start(&format!("http-load-{s}")).await?;
    }
    let next = Arc::new(AtomicU64::new(0));
    let ticks = cpu_ticks();
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..args.clients {
        let (client, next) = (client.clone(), next.clone());
        let (sessions, turns) = (args.sessions as u64, args.turns);
        clients.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let s = next.fetch_add(1, Ordering::Relaxed);
                if s >= sessions {
                    return Ok::<_, anyhow::Error>(latencies);
                }
                for _ in 0..turns {
                    latencies.push(client.turn_waiting(&format!("http-load-{s}")).await?);
                }
            }
        });
    }
    let mut loaded = Vec::new();
    while let Some(joined) = clients.join_next().await {
        loaded.extend(joined??);
    }
    let elapsed = started.elapsed();
    loaded.sort();
    let turns_per_second = loaded.len() as f64 / elapsed.as_secs_f64();
    println!(
        "turn[{label}]/http/throughput: {} clients, {} turns over {} sessions in {:.2} s = {:.0} turns/s; turn latency p50 {}, p99 {}; CPU steal {}",
        args.clients,
        loaded.len(),
        args.sessions,
        elapsed.as_secs_f64(),
        turns_per_second,
        micros(percentile(&loaded, 0.50)),
        micros(percentile(&loaded, 0.99)),
        steal_since(ticks),
    );
    Ok(HttpFigures {
        wait: (percentile(&waited, 0.50), percentile(&waited, 0.99)),
        sse: (percentile(&streamed, 0.50), percentile(&streamed, 0.99)),
        turns_per_second,
    })
}
