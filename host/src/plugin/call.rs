//! One call into a guest: a new `Store` and a new instance, with the per-call
//! state of every host capability, dropped when the call returns.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::{Store, Trap, UpdateDeadline};
use wasmtime_wasi::{ResourceTable, WasiCtx, WasiCtxView, WasiView};

use super::boundary::BoundaryBytes;
use super::component::ComponentSettings;
use super::engine::SandboxEngine;
use super::error::CallError;
use super::factors::config::ComponentConfig;
use super::factors::events::{EventSink, EventWriter, GuestEvent, NoEvents};
use super::factors::history::HistoryBudget;
use super::factors::http::{DeniedRequests, HttpState};
use super::factors::model::{ModelProvider, ModelState};
use super::factors::policy::{NoPolicies, SharedPolicyResolver, ToolPolicyResolver};
use super::factors::step::{HeartbeatSink, NoHeartbeats, StepState, StepTag};
use super::guest_log::{GuestLogPipe, LogStream};
use super::limits::CallLimiter;

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
    pub(crate) history: HistoryBudget,
    pub(crate) config: ComponentConfig,
}

impl CallState {
    /// The resource table and the wasi:http state, borrowed together.
    pub(crate) fn table_and_http(&mut self) -> (&mut ResourceTable, &mut HttpState) {
        (&mut self.table, &mut self.http)
    }

    /// The call's resource table (host handles the guest holds).
    pub(crate) fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
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
    /// The component's sha256, for the metrics.
    digest: Arc<str>,
    stdout: GuestLogPipe,
    stderr: GuestLogPipe,
    events: EventWriter,
    denied_http: DeniedRequests,
    output_bytes: usize,
    fuel: Option<u64>,
    /// When the guest got its slot, for the call's duration metric.
    started: Instant,
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
        let stdout = GuestLogPipe::new(settings.limits.log_bytes);
        let stderr = GuestLogPipe::new(settings.limits.log_bytes);
        let wasi = settings
            .grants
            .wasi_ctx(stdout.clone(), stderr.clone())
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
            limiter: CallLimiter::new(settings.limits.clone()),
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
            history: HistoryBudget::default(),
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
            digest: Arc::from(settings.digest.as_str()),
            stdout,
            stderr,
            events,
            denied_http,
            output_bytes: settings.limits.output_bytes,
            fuel: settings.limits.fuel,
            started: Instant::now(),
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

    /// What the guest printed, as `guest_log` events (charged to the call's
    /// event budget like any event) and as log lines tagged with the Step.
    fn hand_over_logs(&self) {
        // stderr first: when the event budget runs short, the crash
        // reason is the one to keep.
        for (stream, pipe) in [
            (LogStream::Stderr, &self.stderr),
            (LogStream::Stdout, &self.stdout),
        ] {
            let (text, dropped_bytes) = pipe.contents();
            if text.is_empty() && dropped_bytes == 0 {
                continue;
            }
            let tag = self.events.tag();
            tracing::info!(
                target: "dexa::guest",
                component = %self.component,
                export = self.export,
                flow_id = %tag.flow_id,
                turn_id = %tag.turn_id,
                step_execution_id = %tag.step_execution_id,
                attempt = tag.attempt,
                stream = stream.as_str(),
                dropped_bytes,
                // Escaped (Debug): a guest's line break cannot start a
                // log line of its own.
                text = ?text.trim_end(),
                "guest output"
            );
            // Best effort, as every event: past the budget it is dropped.
            let _ = self.events.write(GuestEvent::GuestLog {
                component: self.component.to_string(),
                stream: stream.as_str().to_string(),
                text,
                dropped_bytes,
            });
        }
    }

    /// Ends the call: later event writes are dropped, and a failure becomes a
    /// typed error that says what happened.
    pub fn finish<R: BoundaryBytes>(self, result: wasmtime::Result<R>) -> Result<R, CallError> {
        self.hand_over_logs();
        self.events.close();
        let labels = [
            ("component", self.component.to_string()),
            ("export", self.export.to_string()),
        ];
        metrics::histogram!(
            crate::telemetry::GUEST_CALL_DURATION,
            "component" => self.component.to_string(),
            "digest" => self.digest.to_string(),
            "export" => self.export
        )
        .record(self.started.elapsed().as_secs_f64());
        let outcome = self.settle(result);
        let kind = match &outcome {
            Ok(_) => "ok",
            Err(CallError::TimedOut { .. }) => "timed_out",
            Err(CallError::LimitExceeded { .. }) => "limit",
            Err(_) => "trapped",
        };
        let [component, export] = labels;
        metrics::counter!(
            crate::telemetry::GUEST_CALLS,
            [component, export, ("outcome", kind.to_string())].as_slice()
        )
        .increment(1);
        outcome
    }

    fn settle<R: BoundaryBytes>(self, result: wasmtime::Result<R>) -> Result<R, CallError> {
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
        if let Some(reason) = self.store.data().limiter.exceeded() {
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
        let (guest_stderr, _) = self.stderr.contents();
        let by_guest = err.downcast_ref::<Trap>().is_some();
        let mut reason = match err.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            // A host import refused what the guest passed: its message says
            // why; the wasm backtrace around it says nothing to a reader.
            None if err.downcast_ref::<wasmtime::WasmBacktrace>().is_some() => {
                err.root_cause().to_string()
            }
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
            by_guest,
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
