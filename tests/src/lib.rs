//! The dexa test kit: helpers for testing dexa and guest components.
//!
//! - [`guest_wasm`]: the path of a guest built by `guests/build.sh`;
//! - [`CollectingEvents`] and [`CountingHeartbeats`]: sinks that record what a
//!   guest sent, with the Step tags the host attached;
//! - [`step_tag`]: a tag for a test call.

pub mod api_contract;
pub mod api_server;
pub mod chat_server;
pub mod hostile;
pub mod kit;
pub mod languages;
pub mod measure;
pub mod pg_cluster;
pub mod serve_process;
pub mod session;
pub mod toy;
pub mod versions;
pub mod wat;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use dexa::plugin::{EventSink, HeartbeatSink, StepTag, TaggedEvent};

/// The repository root (the parent of this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The directory holding built guest components: `$DEXA_GUESTS_DIR`, else
/// `target/guests` at the repository root.
pub fn guests_dir() -> PathBuf {
    std::env::var_os("DEXA_GUESTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target").join("guests"))
}

/// The path of guest `name` (for example `echo-tool`). Panics with the command
/// to run when the guests have not been built.
pub fn guest_wasm(name: &str) -> PathBuf {
    let path = guests_dir().join(format!("{name}.wasm"));
    assert!(
        path.is_file(),
        "guest component {} is missing; build the guests first with guests/build.sh",
        path.display()
    );
    path
}

/// Reads a guest component's bytes.
pub fn guest_bytes(name: &str) -> Vec<u8> {
    let path = guest_wasm(name);
    std::fs::read(&path).unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()))
}

/// A Step tag for test calls.
pub fn step_tag(flow_id: &str, turn_id: &str, step_execution_id: &str, attempt: u32) -> StepTag {
    StepTag {
        flow_id: flow_id.to_string(),
        turn_id: turn_id.to_string(),
        step_execution_id: step_execution_id.to_string(),
        attempt,
    }
}

/// Records every event a call wrote.
#[derive(Default)]
pub struct CollectingEvents {
    events: Mutex<Vec<TaggedEvent>>,
}

impl CollectingEvents {
    pub fn events(&self) -> Vec<TaggedEvent> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }
}

impl EventSink for CollectingEvents {
    fn write(&self, event: TaggedEvent) {
        if let Ok(mut events) = self.events.lock() {
            events.push(event);
        }
    }
}

/// Counts heartbeats and keeps the tags they carried.
#[derive(Default)]
pub struct CountingHeartbeats {
    count: AtomicU64,
    tags: Mutex<Vec<StepTag>>,
}

impl CountingHeartbeats {
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    pub fn tags(&self) -> Vec<StepTag> {
        self.tags.lock().map(|t| t.clone()).unwrap_or_default()
    }
}

impl HeartbeatSink for CountingHeartbeats {
    fn heartbeat(&self, tag: &StepTag) {
        self.count.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut tags) = self.tags.lock() {
            tags.push(tag.clone());
        }
    }
}

/// A sandbox engine whose compiled-component cache lives under `target/`, so
/// test runs after the first do not recompile the guests.
pub fn test_engine() -> dexa::plugin::SandboxEngine {
    let config = dexa::plugin::SandboxConfig {
        cache_dir: Some(repo_root().join("target").join("test-component-cache")),
        ..dexa::plugin::SandboxConfig::default()
    };
    dexa::plugin::SandboxEngine::new(config).unwrap_or_else(|err| panic!("sandbox engine: {err:#}"))
}
