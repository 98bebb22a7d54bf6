//! The wasmtime engine every component runs on: pooling allocator, epoch
//! interruption with a background ticker, and the compiled-artifact cache.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::cache::ArtifactCache;

/// Settings of the engine, shared by every component it runs.
#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// Where compiled components are cached. `None` compiles on every start.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes of entries the cache keeps: past it, the least
    /// recently used are removed when a new one is written.
    pub cache_max_bytes: u64,
    /// Instances that may be alive at once, across all components. The pool
    /// reserves address space for this many.
    pub max_concurrent_instances: u32,
    /// The largest linear memory any instance may grow to.
    pub max_memory_bytes: usize,
    /// How often the epoch advances. Deadlines are checked at this grain.
    pub epoch_tick: Duration,
    /// Bytes of a reused memory slot kept mapped and zeroed with memset
    /// instead of being returned to the kernel; a trade of memset time
    /// against page faults on the next instance.
    pub memory_keep_resident: usize,
    /// Meter every instruction with fuel, so that components may set a fuel
    /// limit. Off by default: metering slows guest code down.
    pub consume_fuel: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            cache_dir: None,
            cache_max_bytes: super::cache::DEFAULT_MAX_BYTES,
            max_concurrent_instances: 256,
            max_memory_bytes: 256 << 20,
            epoch_tick: Duration::from_millis(10),
            // With PAGEMAP_SCAN only dirtied pages are reset; without it the
            // whole amount is memset on every reuse, so keep it small.
            memory_keep_resident: if PoolingAllocationConfig::is_pagemap_scan_available() {
                4 << 20
            } else {
                64 << 10
            },
            consume_fuel: false,
        }
    }
}

/// The shared engine. Cheap to clone.
#[derive(Clone)]
pub struct SandboxEngine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    engine: Engine,
    config: SandboxConfig,
    cache: Option<ArtifactCache>,
    ticker_stop: Arc<AtomicBool>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

/// Core instances one component may hold: its modules plus the shims and
/// adapters that toolchains such as componentize-py add.
const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 64;
const MAX_MEMORIES_PER_COMPONENT: u32 = 8;
const MAX_TABLES_PER_COMPONENT: u32 = 32;

impl SandboxEngine {
    pub fn new(config: SandboxConfig) -> anyhow::Result<Self> {
        let mut pool = PoolingAllocationConfig::new();
        let instances = config.max_concurrent_instances.max(1);
        pool.total_component_instances(instances)
            .total_core_instances(instances * MAX_CORE_INSTANCES_PER_COMPONENT / 4)
            .total_memories(instances * 2)
            .total_tables(instances * 4)
            .total_stacks(instances)
            .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memories_per_component(MAX_MEMORIES_PER_COMPONENT)
            .max_tables_per_component(MAX_TABLES_PER_COMPONENT)
            .max_memory_size(config.max_memory_bytes)
            // Reused slots keep their pages mapped: the next instance then finds
            // zeroed memory instead of faulting fresh pages in.
            .linear_memory_keep_resident(config.memory_keep_resident)
            .table_keep_resident(64 << 10)
            // Where the kernel has PAGEMAP_SCAN (Linux 6.7+), only the pages an
            // instance dirtied are reset, so a large keep-resident is cheap.
            .pagemap_scan(wasmtime::Enabled::Auto);

        let mut wasm = Config::new();
        wasm.wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(config.consume_fuel)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&wasm).map_err(anyhow::Error::from)?;

        let cache = match &config.cache_dir {
            Some(dir) => Some(
                ArtifactCache::open(dir.clone(), &engine)?.with_max_bytes(config.cache_max_bytes),
            ),
            None => None,
        };

        let ticker_stop = Arc::new(AtomicBool::new(false));
        spawn_epoch_ticker(engine.clone(), config.epoch_tick, ticker_stop.clone())?;

        Ok(Self {
            inner: Arc::new(EngineInner {
                engine,
                config,
                cache,
                ticker_stop,
            }),
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.inner.config
    }

    pub(crate) fn cache(&self) -> Option<&ArtifactCache> {
        self.inner.cache.as_ref()
    }
}

/// Advances the engine's epoch on a fixed beat until `stop` is set. Holds only
/// a weak engine reference, so the thread ends with the engine too.
fn spawn_epoch_ticker(engine: Engine, tick: Duration, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let weak = engine.weak();
    drop(engine);
    std::thread::Builder::new()
        .name("dexa-epoch".to_string())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                match weak.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => break,
                }
            }
        })?;
    Ok(())
}
