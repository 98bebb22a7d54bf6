//! Measuring a healthy session beside a load on one worker: its turn
//! latencies, and the worker's resident memory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dexa::session::AgentSessionClient;

use crate::hostile::next_turn;
use crate::kit::wait_for_turns;

/// Sorted latencies of `turns` turns answering `hello` with `fine`, in a new
/// session `id`.
pub async fn healthy_turns(sessions: &AgentSessionClient, id: &str, turns: u64) -> Vec<Duration> {
    sessions.start_session(id, "").await.expect("start healthy");
    wait_for_turns(sessions, id, 0).await;
    let mut samples = Vec::new();
    for turn in 1..=turns {
        let started = Instant::now();
        let end = next_turn(sessions, id, turn, "hello").await;
        samples.push(started.elapsed());
        assert_eq!(end.text, "fine");
    }
    samples.sort();
    samples
}

/// The median of sorted `samples`.
pub fn p50(samples: &[Duration]) -> Duration {
    samples[samples.len() / 2]
}

/// The resident set of process `pid`, in MiB (0 once it is gone).
pub fn rss_mib(pid: u32) -> u64 {
    status_mib(pid, "VmRSS:")
}

/// The highest resident set process `pid` ever had (the kernel's `VmHWM`),
/// in MiB (0 once it is gone): unlike sampling, it misses no short peak.
pub fn peak_rss_mib(pid: u32) -> u64 {
    status_mib(pid, "VmHWM:")
}

/// A `kB` field of `/proc/<pid>/status`, in MiB.
fn status_mib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib / 1024)
}

/// Samples a process's resident memory every 20 ms until stopped.
pub struct PeakRss {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    sampler: tokio::task::JoinHandle<()>,
}

impl PeakRss {
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let sampler = tokio::spawn({
            let (stop, peak) = (stop.clone(), peak.clone());
            async move {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_mib(pid), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        Self {
            stop,
            peak,
            sampler,
        }
    }

    /// The highest sample, in MiB.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.sampler.await.expect("RSS sampler");
        self.peak.load(Ordering::Relaxed)
    }
}
