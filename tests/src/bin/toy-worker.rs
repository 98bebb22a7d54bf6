//! A worker process for the toy flows, so tests can SIGKILL it mid-Step.
//!
//! Usage: toy-worker <store.sqlite | postgres://...> <gate-dir> [lease-ms]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dexa::flow::{Worker, WorkerOptions};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: toy-worker <store.sqlite | postgres://...> <gate-dir> [lease-ms]");
        return std::process::ExitCode::from(2);
    }
    let lease_ms: u64 = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(500);
    let store = match dexa::store::open_address(&args[1]).await {
        Ok((store, _)) => store,
        Err(err) => {
            eprintln!("toy-worker: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let probe = dexa_tests::toy::Probe::new(Some(PathBuf::from(&args[2])));
    let registry = Arc::new(dexa_tests::toy::toy_registry(probe));
    let options = WorkerOptions {
        lease: Duration::from_millis(lease_ms),
        reap_interval: Duration::from_millis(50),
        ..WorkerOptions::default()
    };
    Worker::new(store, registry, options)
        .run(std::future::pending())
        .await;
    std::process::ExitCode::SUCCESS
}
