//! One call into a guest: a new `Store` and a new instance, with the per-call
//! state of every host capability, dropped when the call returns.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{ResourceTable, WasiCtx, WasiCtxView, WasiView};

use super::component::ComponentSettings;
use super::engine::SandboxEngine;
use super::error::CallError;
use super::factors::config::ComponentConfig;
use super::factors::events::{EventSink, EventWriter, NoEvents};
use super::factors::model::{ModelProvider, ModelState};
use super::factors::policy::{SharedPolicyResolver, ToolPolicies, ToolPolicyResolver};
use super::factors::step::{HeartbeatSink, NoHeartbeats, StepState, StepTag};

/// Per-component resource limits. Each has a default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentLimits {
    /// Largest linear memory, in bytes (capped by the engine's pool).
    pub memory_bytes: usize,
    /// Largest table, in elements.
    pub table_elements: usize,
    /// Core and component instances one call may create.
    pub instances: usize,
    /// Bytes of events one call may write; more fails the call.
    pub event_bytes_per_call: u64,
    /// Bytes of the guest's stderr kept for error messages.
    pub stderr_bytes: usize,
}

impl Default for ComponentLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 128 << 20,
            table_elements: 100_000,
            instances: 64,
            event_bytes_per_call: 4 << 20,
            stderr_bytes: 16 << 10,
        }
    }
}

/// The Step a call serves, and where its heartbeats, events, policy questions
/// and model call go.
#[derive(Clone)]
pub struct CallEnv {
    pub tag: StepTag,
    /// The call is stopped (and fails) when it runs longer.
    pub timeout: Duration,
    pub events: Arc<dyn EventSink>,
    pub heartbeats: Arc<dyn HeartbeatSink>,
    pub policy: Arc<dyn ToolPolicyResolver>,
    pub model: Option<Arc<dyn ModelProvider>>,
}

impl CallEnv {
    /// The default call timeout: the spec's longest Step attempt (RunModel).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15 * 60);

    /// A call with no sinks, the default policies and no model.
    pub fn new(tag: StepTag) -> Self {
        Self {
            tag,
            timeout: Self::DEFAULT_TIMEOUT,
            events: Arc::new(NoEvents),
            heartbeats: Arc::new(NoHeartbeats),
            policy: Arc::new(ToolPolicies::default()),
            model: None,
        }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn with_events(mut self, events: Arc<dyn EventSink>) -> Self {
        self.events = events;
        self
    }

    pub fn with_heartbeats(mut self, heartbeats: Arc<dyn HeartbeatSink>) -> Self {
        self.heartbeats = heartbeats;
        self
    }

    pub fn with_policy(mut self, policy: Arc<dyn ToolPolicyResolver>) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_model(mut self, model: Arc<dyn ModelProvider>) -> Self {
        self.model = Some(model);
        self
    }
}

/// Enforces [`ComponentLimits`] and remembers which limit stopped the guest,
/// so the error can say so.
struct CallLimiter {
    limits: ComponentLimits,
    exceeded: Option<String>,
}

impl ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limits.memory_bytes {
            let reason = format!(
                "linear memory would grow to {desired} bytes, over the limit of {} bytes",
                self.limits.memory_bytes
            );
            self.exceeded = Some(reason.clone());
            return Err(wasmtime::format_err!(reason));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.limits.table_elements {
            let reason = format!(
                "a table would grow to {desired} elements, over the limit of {}",
                self.limits.table_elements
            );
            self.exceeded = Some(reason.clone());
            return Err(wasmtime::format_err!(reason));
        }
        Ok(true)
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

/// The data of one call's `Store`. Every host import is implemented on it.
pub struct CallState {
    pub(crate) component: Arc<str>,
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: CallLimiter,
    pub(crate) step: StepState,
    pub(crate) events: EventWriter,
    pub(crate) policy: SharedPolicyResolver,
    pub(crate) model: ModelState,
    pub(crate) config: ComponentConfig,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// A call in progress: its store and what is needed to explain a failure.
pub(crate) struct Call {
    pub store: Store<CallState>,
    pub export: &'static str,
    pub timeout: Duration,
    component: Arc<str>,
    stderr: MemoryOutputPipe,
    events: EventWriter,
}

/// The host-side backstop for a call that waits on the host (for example on
/// the model) past its deadline; guest CPU time is bounded by the epoch.
#[derive(Debug)]
struct HostDeadlineElapsed;

impl std::fmt::Display for HostDeadlineElapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("call deadline elapsed")
    }
}

impl std::error::Error for HostDeadlineElapsed {}

impl Call {
    pub fn begin(
        engine: &SandboxEngine,
        settings: &ComponentSettings,
        env: CallEnv,
        export: &'static str,
        model_allowed: bool,
    ) -> Result<Self, CallError> {
        let component: Arc<str> = Arc::from(settings.name.as_str());
        let stderr = MemoryOutputPipe::new(settings.limits.stderr_bytes);
        let wasi =
            settings
                .grants
                .wasi_ctx(stderr.clone())
                .map_err(|err| CallError::Instantiate {
                    component: settings.name.clone(),
                    reason: format!("{err:#}"),
                })?;
        let events = EventWriter::new(
            env.tag.clone(),
            env.events,
            settings.limits.event_bytes_per_call,
        );
        let state = CallState {
            component: component.clone(),
            wasi,
            table: ResourceTable::new(),
            limiter: CallLimiter {
                limits: settings.limits.clone(),
                exceeded: None,
            },
            step: StepState {
                tag: env.tag,
                sink: env.heartbeats,
            },
            events: events.clone(),
            policy: env.policy,
            model: ModelState {
                provider: env.model,
                allowed: model_allowed,
                called: false,
            },
            config: settings.config.clone(),
        };
        let mut store = Store::new(engine.engine(), state);
        store.limiter(|state| &mut state.limiter);
        let deadline = Instant::now() + env.timeout;
        store.set_epoch_deadline(1);
        // Every tick, yield to the executor so a busy guest cannot starve other
        // calls on the thread; past the deadline, interrupt it.
        store.epoch_deadline_callback(move |_| {
            if Instant::now() >= deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Yield(1))
            }
        });
        Ok(Self {
            store,
            export,
            timeout: env.timeout,
            component,
            stderr,
            events,
        })
    }

    /// Ends the call: later event writes are dropped, and a failure becomes a
    /// typed error that says what happened.
    pub fn finish<R>(self, result: wasmtime::Result<R>) -> Result<R, CallError> {
        self.events.close();
        let err = match result {
            Ok(value) => return Ok(value),
            Err(err) => err,
        };
        let component = self.component.to_string();
        let export = self.export;
        if err.downcast_ref::<HostDeadlineElapsed>().is_some()
            || matches!(err.downcast_ref::<Trap>(), Some(Trap::Interrupt))
        {
            return Err(CallError::TimedOut {
                component,
                export,
                timeout: self.timeout,
            });
        }
        if let Some(reason) = self.store.data().limiter.exceeded.clone() {
            return Err(CallError::LimitExceeded {
                component,
                export,
                reason,
            });
        }
        let guest_stderr = String::from_utf8_lossy(&self.stderr.contents()).into_owned();
        let reason = match err.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => format!("{err:#}"),
        };
        tracing::debug!(component = %component, export, error = ?err, "guest call failed");
        Err(CallError::Trapped {
            component,
            export,
            reason,
            guest_stderr,
        })
    }
}

/// Runs `work` with the call's timeout as a host-side backstop.
pub(crate) async fn with_deadline<R>(
    timeout: Duration,
    work: impl Future<Output = wasmtime::Result<R>>,
) -> wasmtime::Result<R> {
    // The epoch interrupts the guest at the deadline; the grace covers a
    // host import that is itself waiting.
    let grace = Duration::from_millis(250);
    match tokio::time::timeout(timeout + grace, work).await {
        Ok(result) => result,
        Err(_) => Err(wasmtime::Error::new(HostDeadlineElapsed)),
    }
}

// `dex:agents/types` has no functions; the linker still asks for its trait.
impl super::bindings::runner::dex::agents::types::Host for CallState {}
