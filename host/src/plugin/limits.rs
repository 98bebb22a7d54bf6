//! The resource limits of one component, and the limiter that enforces them
//! on each call's `Store`.
//!
//! Memory and table limits bound the **sum** over every linear memory and
//! every table the call's instances create, not each one alone: a component
//! may declare several memories (multi-memory) or instantiate several core
//! modules, and each would otherwise get the whole limit.

use super::engine::SandboxEngine;
use wasmtime::ResourceLimiter;

/// Per-component resource limits. Each has a default. CPU time is bounded by
/// the deadline of the Step a call serves (see [`CallEnv::timeout`](super::CallEnv::timeout)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentLimits {
    /// Bytes of linear memory one call may hold, summed over every memory of
    /// every core instance it creates (at most the engine's pool slot).
    pub memory_bytes: usize,
    /// Table elements one call may hold, summed over every table it creates.
    pub table_elements: usize,
    /// Core instances, memories and tables one call may create.
    pub instances: usize,
    /// Wasm instructions (roughly) one call may execute; none is unmetered.
    /// Needs an engine built with [`super::SandboxConfig::consume_fuel`].
    pub fuel: Option<u64>,
    /// Calls of this component that may run at once; more wait their turn
    /// within their own deadline.
    pub max_concurrent_calls: usize,
    /// Bytes of strings one call may return (a tool's output or error, a
    /// runner's messages and tool-call arguments).
    pub output_bytes: usize,
    /// Bytes of framework run state a runner may hand back.
    pub run_state_bytes: usize,
    /// What the events of one call may cost in stored bytes (see
    /// [`EventSink::stored_cost`](super::EventSink::stored_cost)); past it they are dropped and the call
    /// goes on.
    pub event_bytes_per_call: u64,
    /// Bytes of each of the guest's stdout and stderr kept per call (for
    /// `guest_log` events, the log, and error messages); the rest is
    /// dropped and counted, and the guest goes on.
    pub log_bytes: usize,
    /// Host resources (streams, pollables, HTTP headers...) one call may
    /// hold at once; each holds host memory outside `memory_bytes`.
    pub host_handles: usize,
}

impl Default for ComponentLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 128 << 20,
            table_elements: 100_000,
            instances: 64,
            fuel: None,
            max_concurrent_calls: 32,
            output_bytes: 1 << 20,
            run_state_bytes: 1 << 20,
            event_bytes_per_call: 1 << 20,
            log_bytes: 16 << 10,
            host_handles: 4096,
        }
    }
}

impl ComponentLimits {
    /// Checks the limits against the engine they will run on.
    pub fn validate(&self, engine: &SandboxEngine) -> Result<(), String> {
        let config = engine.config();
        if self.memory_bytes > config.max_memory_bytes {
            return Err(format!(
                "memory limit of {} bytes is above the engine's largest memory of {} bytes",
                self.memory_bytes, config.max_memory_bytes
            ));
        }
        if self.max_concurrent_calls == 0 {
            return Err("max_concurrent_calls must be at least 1".to_string());
        }
        if self.fuel.is_some() && !config.consume_fuel {
            return Err(
                "a fuel limit needs an engine with fuel metering on (consume_fuel)".to_string(),
            );
        }
        Ok(())
    }
}

/// Enforces [`ComponentLimits`] on one call's `Store`, and remembers which
/// limit stopped the guest, so the error can say so.
pub(crate) struct CallLimiter {
    limits: ComponentLimits,
    /// Bytes of linear memory granted so far, across all memories.
    memory_bytes: usize,
    /// Elements granted so far, across all tables.
    table_elements: usize,
    exceeded: Option<String>,
}

impl CallLimiter {
    pub(crate) fn new(limits: ComponentLimits) -> Self {
        Self {
            limits,
            memory_bytes: 0,
            table_elements: 0,
            exceeded: None,
        }
    }

    /// Why the guest was stopped, if a limit stopped it.
    pub(crate) fn exceeded(&self) -> Option<String> {
        self.exceeded.clone()
    }

    fn refuse(&mut self, reason: String) -> wasmtime::Result<bool> {
        self.exceeded = Some(reason.clone());
        Err(wasmtime::format_err!(reason))
    }
}

/// The running `sum` after one memory or table grows from `current` to
/// `desired`: `Ok` within `limit`, `Err` with the sum it would have been.
fn add_within(sum: usize, current: usize, desired: usize, limit: usize) -> Result<usize, usize> {
    let total = sum.saturating_add(desired.saturating_sub(current));
    if total > limit {
        Err(total)
    } else {
        Ok(total)
    }
}

// wasmtime asks before each memory or table is created (from 0 to its
// initial size) and before each growth, so the running sums see every byte.
// A growth the engine refuses after the limiter allowed it (past a declared
// maximum) is not given back: telling that case apart would let a guest undo
// growths that did happen, and counting it only ever hurts the guest itself.
impl ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        match add_within(
            self.memory_bytes,
            current,
            desired,
            self.limits.memory_bytes,
        ) {
            Ok(total) => {
                self.memory_bytes = total;
                Ok(true)
            }
            Err(total) => self.refuse(format!(
                "linear memory would grow to {total} bytes across the instance's memories, \
                 over the limit of {} bytes",
                self.limits.memory_bytes
            )),
        }
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        match add_within(
            self.table_elements,
            current,
            desired,
            self.limits.table_elements,
        ) {
            Ok(total) => {
                self.table_elements = total;
                Ok(true)
            }
            Err(total) => self.refuse(format!(
                "tables would grow to {total} elements across the instance's tables, \
                 over the limit of {}",
                self.limits.table_elements
            )),
        }
    }

    fn instances(&self) -> usize {
        self.limits.instances
    }

    fn tables(&self) -> usize {
        self.limits.instances
    }

    fn memories(&self) -> usize {
        self.limits.instances
    }
}
