//! One call into a guest: a new `Store` and a new instance, with the per-call
//! state of every host capability, dropped when the call returns.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::{ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{ResourceTable, WasiCtx, WasiCtxView, WasiView};

use super::boundary::BoundaryBytes;
use super::component::ComponentSettings;
use super::engine::SandboxEngine;
use super::error::CallError;
use super::factors::config::ComponentConfig;
use super::factors::events::{EventSink, EventWriter, NoEvents};
use super::factors::http::{DeniedRequests, HttpState};
use super::factors::model::{ModelProvider, ModelState};
use super::factors::policy::{NoPolicies, SharedPolicyResolver, ToolPolicyResolver};
use super::factors::step::{HeartbeatSink, NoHeartbeats, StepState, StepTag};

/// Per-component resource limits. Each has a default. CPU time is bounded by
/// the deadline of the Step a call serves (see [`CallEnv::timeout`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentLimits {
    /// Largest linear memory, in bytes (at most the engine's pool slot).
    pub memory_bytes: usize,
    /// Largest table, in elements.
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
    /// [`EventSink::stored_cost`]); past it they are dropped and the call
    /// goes on.
    pub event_bytes_per_call: u64,
    /// Bytes of the guest's stderr kept for error messages.
    pub stderr_bytes: usize,
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
            stderr_bytes: 16 << 10,
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

    /// A call with no sinks, no session policies ([`NoPolicies`]) and no model.
    pub fn new(tag: StepTag) -> Self {
        Self {
            tag,
            timeout: Self::DEFAULT_TIMEOUT,
            events: Arc::new(NoEvents),
            heartbeats: Arc::new(NoHeartbeats),
            policy: Arc::new(NoPolicies),
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
    http: HttpState,
    pub(crate) step: StepState,
    pub(crate) events: EventWriter,
    pub(crate) policy: SharedPolicyResolver,
    pub(crate) model: ModelState,
    pub(crate) config: ComponentConfig,
}

impl CallState {
    /// The resource table and the wasi:http state, borrowed together.
    pub(crate) fn table_and_http(&mut self) -> (&mut ResourceTable, &mut HttpState) {
        (&mut self.table, &mut self.http)
    }
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
    /// When the call must be over, counted from before it waited for a slot.
    pub deadline: Instant,
    component: Arc<str>,
    stderr: MemoryOutputPipe,
    events: EventWriter,
    denied_http: DeniedRequests,
    output_bytes: usize,
    fuel: Option<u64>,
    /// The component's concurrency slot, released when the call ends.
    _slot: OwnedSemaphorePermit,
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
    pub async fn begin(
        engine: &SandboxEngine,
        settings: &ComponentSettings,
        slots: &Arc<Semaphore>,
        env: CallEnv,
        export: &'static str,
        model_allowed: bool,
    ) -> Result<Self, CallError> {
        let deadline = Instant::now() + env.timeout;
        let slot = match tokio::time::timeout(env.timeout, slots.clone().acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            Ok(Err(_closed)) => {
                return Err(CallError::NotStarted {
                    component: settings.name.clone(),
                    export,
                    reason: "the component is shutting down".to_string(),
                })
            }
            Err(_elapsed) => {
                return Err(CallError::NotStarted {
                    component: settings.name.clone(),
                    export,
                    reason: format!(
                    "no free instance within {:?}: {} calls of this component were already running",
                    env.timeout, settings.limits.max_concurrent_calls
                ),
                })
            }
        };
        let component: Arc<str> = Arc::from(settings.name.as_str());
        let stderr = MemoryOutputPipe::new(settings.limits.stderr_bytes);
        let wasi =
            settings
                .grants
                .wasi_ctx(stderr.clone())
                .map_err(|err| CallError::NotStarted {
                    component: settings.name.clone(),
                    export,
                    reason: format!("{err:#}"),
                })?;
        let events = EventWriter::new(
            env.tag.clone(),
            env.events,
            settings.limits.event_bytes_per_call,
        );
        let http = HttpState::new(settings.grants.http.clone().into(), component.clone());
        // Handles (streams, pollables, HTTP fields) hold host memory the
        // guest's memory limit does not count; bound how many it may keep.
        let mut table = ResourceTable::new();
        table.set_max_capacity(settings.limits.host_handles);
        let denied_http = http.denied();
        let state = CallState {
            component: component.clone(),
            wasi,
            table,
            limiter: CallLimiter {
                limits: settings.limits.clone(),
                exceeded: None,
            },
            http,
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
        if engine.config().consume_fuel {
            store
                .set_fuel(settings.limits.fuel.unwrap_or(u64::MAX))
                .map_err(|err| CallError::Instantiate {
                    component: settings.name.clone(),
                    reason: format!("cannot set fuel: {err:#}"),
                })?;
        }
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
            deadline,
            component,
            stderr,
            events,
            denied_http,
            output_bytes: settings.limits.output_bytes,
            fuel: settings.limits.fuel,
            _slot: slot,
        })
    }

    /// Fails the call when it returned more than the output cap.
    fn check_output<R: BoundaryBytes>(&self, value: &R) -> Result<(), CallError> {
        let bytes = value.boundary_bytes();
        if bytes > self.output_bytes {
            return Err(CallError::LimitExceeded {
                component: self.component.to_string(),
                export: self.export,
                reason: format!(
                    "it returned {bytes} bytes, over the output limit of {} bytes",
                    self.output_bytes
                ),
            });
        }
        Ok(())
    }

    /// Ends the call: later event writes are dropped, and a failure becomes a
    /// typed error that says what happened.
    pub fn finish<R: BoundaryBytes>(self, result: wasmtime::Result<R>) -> Result<R, CallError> {
        self.events.close();
        let err = match result {
            Ok(value) => {
                self.check_output(&value)?;
                return Ok(value);
            }
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
        if matches!(err.downcast_ref::<Trap>(), Some(Trap::OutOfFuel)) {
            return Err(CallError::LimitExceeded {
                component,
                export,
                reason: format!(
                    "it ran out of fuel ({} units)",
                    self.fuel.unwrap_or(u64::MAX)
                ),
            });
        }
        let guest_stderr = String::from_utf8_lossy(&self.stderr.contents()).into_owned();
        let mut reason = match err.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => format!("{err:#}"),
        };
        let denied = self.denied_http.describe();
        if !denied.is_empty() {
            reason.push_str(&format!(" (outbound HTTP refused, not granted: {denied})"));
        }
        tracing::debug!(component = %component, export, error = ?err, "guest call failed");
        Err(CallError::Trapped {
            component,
            export,
            reason,
            guest_stderr,
        })
    }
}

/// Runs `work` with the call's deadline as a host-side backstop.
pub(crate) async fn with_deadline<R>(
    deadline: Instant,
    work: impl Future<Output = wasmtime::Result<R>>,
) -> wasmtime::Result<R> {
    // The epoch interrupts the guest at the deadline; the grace covers a
    // host import that is itself waiting.
    let grace = Duration::from_millis(250);
    let at = tokio::time::Instant::from_std(deadline + grace);
    match tokio::time::timeout_at(at, work).await {
        Ok(result) => result,
        Err(_) => Err(wasmtime::Error::new(HostDeadlineElapsed)),
    }
}

// `dex:agents/types` has no functions; the linker still asks for its trait.
impl super::bindings::runner::dex::agents::types::Host for CallState {}
