//! `dexa worker`: runs the Steps of every agent in `dexa.toml` until it is
//! stopped (Ctrl-C or SIGTERM). Several workers, in one process or many,
//! share one store.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use anyhow::Context;
use clap::Args;

use crate::api::error::{ApiError, ErrorCode};
use crate::config::deploy::LoadProgress;
use crate::config::{Deployment, DexaConfig};
use crate::flow::{ClaimedTask, FlowStore, StoreHealth};

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The config file.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
    /// Steps run at once (default: `[worker] slots`).
    #[arg(long)]
    pub slots: Option<usize>,
    /// This worker's id; unique among live workers (default: from the pid).
    #[arg(long)]
    pub worker_id: Option<String>,
    /// Fault injection for crash tests: abort the process, as a crash
    /// would, right after the first commit of a Step of this type (before
    /// the Step its commit leased to this worker starts).
    #[arg(long, value_name = "STEP_TYPE")]
    pub crash_after_commit: Option<String>,
    /// Serve `GET /metrics` (Prometheus text, no token: keep it on a
    /// private address) and `GET /healthz` here, for example
    /// `127.0.0.1:9464`.
    #[arg(long, value_name = "ADDRESS", env = "DEXA_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

/// Load progress, as log lines (on stderr, for people in the text format,
/// with the component, index and timing as fields in the JSON one): the
/// first start compiles each component.
pub(super) fn log_progress(progress: LoadProgress) {
    match progress {
        LoadProgress::Loading {
            component,
            index,
            total,
        } => tracing::info!(
            component,
            index,
            total,
            "[{index}/{total}] loading {component}..."
        ),
        LoadProgress::Loaded {
            component,
            compiled,
            millis,
        } => tracing::info!(
            component,
            compiled,
            millis,
            "      {component}: {} in {millis} ms",
            if compiled { "compiled" } else { "from cache" }
        ),
    }
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let signals = super::signals::Signals::listen()?;
    let config = DexaConfig::load(&args.config)?;
    // Flushes the last spans when `run` returns.
    let _traces = crate::telemetry::traces::install_from_env()?;
    let loaded = Arc::new(OnceLock::new());
    if let Some(address) = args.metrics_listen {
        serve_metrics(address, loaded.clone()).await?;
    }
    if config.agents.is_empty() {
        anyhow::bail!(config.error("there are no [agents.NAME] sections, so no work to do"));
    }
    // Files and sockets a tool is granted are real descriptors; a guest's
    // handles are capped per call (limits.host_handles), not per process.
    if let Err(err) = crate::api::limits::raise_fd_limit() {
        tracing::warn!(error = %err, "cannot raise the open-file limit");
    }
    let deployment = Deployment::for_workers(config, &log_progress).await?;
    let mut options = deployment.config.worker.options();
    if let Some(slots) = args.slots {
        anyhow::ensure!(slots > 0, "--slots must be at least 1");
        options.max_concurrent_tasks = slots;
    }
    if let Some(id) = args.worker_id {
        options.worker_id = id;
    }
    if let Some(step_type) = args.crash_after_commit {
        tracing::warn!("fault injection: this worker aborts after its first {step_type} commit");
        options.on_step_committed = Some(Arc::new(move |task: &ClaimedTask, _| {
            if task.step_type == step_type {
                eprintln!(
                    "fault injection: aborting after committing {} of {}",
                    task.step_type, task.flow_id
                );
                std::process::abort();
            }
        }));
    }
    let agents: Vec<&String> = deployment.config.agents.keys().collect();
    tracing::info!(
        worker = %options.worker_id,
        slots = options.max_concurrent_tasks,
        agents = ?agents,
        store = %deployment.config.store.describe(),
        "worker ready"
    );
    let _ = loaded.set(Loaded {
        store: deployment.store.clone(),
        health: deployment.store_health.clone(),
    });
    let drain = options.drain;
    let run = deployment.worker_with(options).run(async {
        signals.received(1).await;
        tracing::info!(
            drain = %humantime::format_duration(drain),
            "worker stopping: claiming nothing more; the running Steps have until the drain \
             deadline (a second signal stops at once)"
        );
    });
    tokio::select! {
        () = run => tracing::info!("worker stopped"),
        () = signals.received(2) => tracing::warn!(
            "worker stopped without waiting for its Steps; they are delivered again when their \
             leases run out"
        ),
    }
    Ok(())
}

/// What the metrics listener reads once the worker has loaded.
struct Loaded {
    store: Arc<dyn FlowStore>,
    health: StoreHealth,
}

/// Serves the worker's metrics at `address` until the process ends:
/// `/metrics` (with the queue depth once the store is open), `/healthz`
/// (alive), and `/readyz`: 503 `loading` until the components are loaded,
/// 503 `store_unavailable` while the store refuses the worker's claims, else
/// 200. Set `loaded` once the worker has loaded.
async fn serve_metrics(
    address: std::net::SocketAddr,
    loaded: Arc<OnceLock<Loaded>>,
) -> anyhow::Result<()> {
    let handle = crate::telemetry::install_prometheus()?;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address} (--metrics-listen)"))?;
    let scraped = loaded.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let (handle, loaded) = (handle.clone(), scraped.clone());
                async move {
                    if let Some(loaded) = loaded.get() {
                        crate::api::metrics::record_queue_depth(loaded.store.as_ref()).await;
                    }
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            crate::api::metrics::PROMETHEUS_TEXT,
                        )],
                        crate::telemetry::render(&handle),
                    )
                }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let loaded = loaded.clone();
                async move { worker_ready(loaded.get()) }
            }),
        );
    tracing::info!(address = %listener.local_addr()?, "serving metrics at /metrics");
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::warn!(error = %err, "the metrics listener stopped");
        }
    });
    Ok(())
}

/// `/readyz` of a worker: see [`serve_metrics`].
fn worker_ready(loaded: Option<&Loaded>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let unavailable = axum::http::StatusCode::SERVICE_UNAVAILABLE;
    match loaded {
        None => ApiError::new(
            unavailable,
            ErrorCode::Loading,
            "the worker is loading its components",
        )
        .into_response(),
        Some(loaded) if loaded.health.unavailable_since_ms().is_some() => ApiError::new(
            unavailable,
            ErrorCode::StoreUnavailable,
            "the store refuses this worker's claims; it backs off and resumes by itself",
        )
        .into_response(),
        Some(_) => axum::Json(serde_json::json!({"ok": true})).into_response(),
    }
}
