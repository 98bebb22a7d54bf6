//! `dexa serve`: the HTTP API (and, by default, a worker) for the agents in
//! `dexa.toml`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::signals::Signals;
use super::worker::log_progress;
use crate::api::limits::{raise_fd_limit, ConnectionLimits};
use crate::api::{listener, router, ApiState};
use crate::config::{Deployment, DexaConfig};

/// How long open requests (event streams) may run on after a stop signal.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The config file.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8080", env = "DEXA_LISTEN")]
    pub listen: SocketAddr,
    /// A file holding the API token. Else `$DEXA_API_TOKEN`; else a token is
    /// generated into `.dexa/api-token` next to the config.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Serve the API only; run the Steps with `dexa worker` elsewhere.
    #[arg(long)]
    pub no_worker: bool,
    /// How long a client may take to send a request's headers, from when
    /// its connection opens or its previous response ends (default 10s;
    /// 100ms to 5m). Slower clients are disconnected.
    #[arg(long, env = "DEXA_HEADER_TIMEOUT", value_parser = parse_duration)]
    pub header_timeout: Option<Duration>,
    /// Connections served the API at once; 32 more answer only /healthz
    /// (default: what the open-file limit leaves after the store and the
    /// worker, at most 4096).
    #[arg(long, env = "DEXA_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// A browser origin that may call the API (`https://app.example.com`,
    /// or `*` for any); repeat for more. None by default: CORS is off.
    #[arg(
        long = "cors-origin",
        value_name = "ORIGIN",
        env = "DEXA_CORS_ORIGINS",
        value_delimiter = ','
    )]
    pub cors_origins: Vec<String>,
}

/// `10s`, `500ms`, `1m`...
fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|err| format!("{err} (write a duration such as 10s or 500ms)"))
}

/// The API token: from `--token-file`, else `$DEXA_API_TOKEN`, else the
/// generated file. Returns the token and where it came from.
pub fn resolve_token(
    token_file: Option<&Path>,
    config: &DexaConfig,
) -> anyhow::Result<(String, String)> {
    if let Some(path) = token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the token file {}", path.display()))?;
        let token = token.trim().to_string();
        anyhow::ensure!(
            !token.is_empty(),
            "the token file {} is empty",
            path.display()
        );
        return Ok((token, format!("the file {}", path.display())));
    }
    if let Ok(token) = std::env::var("DEXA_API_TOKEN") {
        let token = token.trim().to_string();
        anyhow::ensure!(!token.is_empty(), "DEXA_API_TOKEN is set but empty");
        return Ok((token, "$DEXA_API_TOKEN".to_string()));
    }
    let path = generated_token_path(config);
    if let Ok(existing) = std::fs::read_to_string(&path) {
        if !existing.trim().is_empty() {
            return Ok((
                existing.trim().to_string(),
                format!("the file {}", path.display()),
            ));
        }
    }
    let mut bytes = [0u8; 32];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom to make an API token")?;
    let token = hex::encode(bytes);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    write_private(&path, &token)?;
    Ok((token, format!("the file {} (generated)", path.display())))
}

fn worker_abandoned() {
    tracing::warn!(
        "dexa serve: stopped without waiting for the worker's Steps; they are delivered again \
         when their leases run out"
    );
}

/// `.dexa/api-token` next to the config file.
pub fn generated_token_path(config: &DexaConfig) -> PathBuf {
    config.local_dir().join("api-token")
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let signals = Signals::listen()?;
    // Sized before anything else opens files, so that a bad value is
    // refused at once.
    let fd_limit = raise_fd_limit().context("cannot read the open-file limit")?;
    let limits = ConnectionLimits::new(args.header_timeout, args.max_connections, fd_limit)?;
    let cors =
        crate::api::cors::CorsOrigins::parse(&args.cors_origins).map_err(anyhow::Error::msg)?;
    let config = DexaConfig::load(&args.config)?;
    // Before the worker starts, which records from its first claim.
    let metrics = crate::telemetry::install_prometheus()?;
    // Flushes the last spans when `run` returns.
    let _traces = crate::telemetry::traces::install_from_env()?;
    let (token, source) = resolve_token(args.token_file.as_deref(), &config)?;
    let deployment = if args.no_worker {
        Deployment::for_clients(config).await?
    } else {
        Deployment::for_workers(config, &log_progress).await?
    };
    let deployment = Arc::new(deployment);
    // The worker drains (see `dexa worker`) once the server has stopped.
    // The first signal stops the server and starts the worker's drain at
    // once, side by side: a container runtime's grace period (10 s in
    // docker and podman, 30 s in Kubernetes) counts from that signal.
    let drain = deployment.config.worker.drain;
    let worker = (!args.no_worker).then(|| {
        let worker = deployment.worker();
        let signals = signals.clone();
        tokio::spawn(worker.run(async move {
            signals.received(1).await;
            tracing::info!(
                "dexa serve: the worker claims nothing more; its running Steps have {} to \
                 finish (a second signal stops at once)",
                humantime::format_duration(drain)
            );
        }))
    });
    let first_signal = signals.clone();
    let app = router(
        ApiState::new(deployment.clone(), Some(Arc::new(token)))
            .with_metrics(metrics)
            .with_cors(cors),
    );
    let tcp = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let address = tcp.local_addr()?;
    let agents: Vec<&String> = deployment.config.agents.keys().collect();
    tracing::info!(
        "dexa serve: http://{address} (API under /v1, OpenAPI at /openapi.json); agents {agents:?}; {}; the API token is in {source}",
        if args.no_worker { "no worker (run dexa worker)" } else { "with a worker" }
    );
    tracing::info!(
        "dexa serve: up to {} connections ({} more for /healthz), headers within {} (open-file limit {fd_limit})",
        limits.max_connections,
        limits.health_reserve,
        humantime::format_duration(limits.header_timeout),
    );
    // Event streams never end by themselves: after the signal, open
    // requests get a few seconds, then the server stops anyway.
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = listener::serve(tcp, app, limits, async move {
        first_signal.received(1).await;
        let _ = stopping.send(());
    });
    tokio::select! {
        () = server => {}
        _ = async {
            if stopped.await.is_ok() {
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => tracing::info!("dexa serve: closed the event streams still open"),
    }
    if let Some(worker) = worker {
        tokio::select! {
            _ = worker => {}
            () = signals.received(2) => worker_abandoned(),
        }
    }
    tracing::info!("dexa serve stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_comes_from_a_file_else_is_generated_once_and_private() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let config = DexaConfig::parse(dir.path().join("dexa.toml"), "")
            .unwrap_or_else(|err| panic!("{err}"));
        let file = dir.path().join("token");
        std::fs::write(&file, "  s3cret \n").unwrap_or_else(|err| panic!("{err}"));
        let (token, source) =
            resolve_token(Some(&file), &config).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(token, "s3cret");
        assert!(source.contains("token"), "{source}");
        std::fs::write(&file, " \n").unwrap_or_else(|err| panic!("{err}"));
        let empty = resolve_token(Some(&file), &config).map_err(|err| err.to_string());
        assert!(empty.is_err_and(|e| e.contains("is empty")));
        let missing =
            resolve_token(Some(&dir.path().join("nope")), &config).map_err(|err| err.to_string());
        assert!(missing.is_err_and(|e| e.contains("cannot read the token file")));
        if std::env::var_os("DEXA_API_TOKEN").is_none() {
            let (first, source) =
                resolve_token(None, &config).unwrap_or_else(|err| panic!("{err}"));
            assert_eq!(first.len(), 64);
            assert!(source.contains("generated"), "{source}");
            let path = generated_token_path(&config);
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0);
            assert_eq!(mode, 0o600);
            let (second, _) = resolve_token(None, &config).unwrap_or_else(|err| panic!("{err}"));
            assert_eq!(first, second, "one token per deployment");
        }
    }
}
