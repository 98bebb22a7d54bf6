//! Traces: OTLP export, when an endpoint is configured, of one trace per
//! turn, with one span per Step attempt.
//!
//! A turn's trace is decided where its user message is accepted (the W3C
//! `traceparent` of the request that sent it, else a new trace) and travels
//! with the message and the session's state, so that every worker that runs
//! one of the turn's Steps (in any process, after any crash) reports into
//! the same trace. The turn's own span is reported when the turn ends, with
//! the id given at the start, so the attempts' spans already point at it.
//!
//! Spans are reported after the fact with their real start and end times:
//! nothing is held open across an await, and without an installed exporter
//! reporting is a check of one flag.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Whether an exporter is installed: until then nothing is built.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The environment variables that turn export on (the OpenTelemetry
/// SDK's own: the first names the full URL, the second a base to which
/// `/v1/traces` is added).
pub const ENDPOINT_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// The trace a turn belongs to, carried with its user message and then the
/// session's state (W3C ids in lower-case hex).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TurnTrace {
    /// 32 hex digits: the sender's trace, or a new one.
    pub trace_id: String,
    /// 16 hex digits: the turn's own span, the parent of its attempts.
    pub span_id: String,
    /// The span of the request that sent the message, when it sent a
    /// `traceparent`: the turn's parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub parent_span_id: Option<String>,
    /// False when the sender's `traceparent` said not to record.
    pub sampled: bool,
    /// When the message was accepted, in Unix milliseconds.
    pub started_at_ms: u64,
}

/// `http::HeaderMap` as the propagator reads it.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|name| name.as_str()).collect()
    }
}

impl TurnTrace {
    /// A new trace, with no parent.
    pub fn new_root() -> Self {
        let ids = RandomIdGenerator::default();
        Self {
            trace_id: ids.new_trace_id().to_string(),
            span_id: ids.new_span_id().to_string(),
            parent_span_id: None,
            sampled: true,
            started_at_ms: unix_ms(SystemTime::now()),
        }
    }

    /// The turn's trace for a message sent with these request headers: a
    /// child of their W3C `traceparent` (and its sampling decision) when it
    /// is valid, else a new trace. A malformed header is ignored, as the
    /// W3C recommendation says.
    pub fn from_headers(headers: &http::HeaderMap) -> Self {
        let context = TraceContextPropagator::new().extract(&Headers(headers));
        let span = context.span();
        let parent = span.span_context();
        let mut trace = Self::new_root();
        if parent.is_valid() {
            trace.trace_id = parent.trace_id().to_string();
            trace.parent_span_id = Some(parent.span_id().to_string());
            trace.sampled = parent.is_sampled();
        }
        trace
    }

    /// The turn's span as a remote parent, when its ids are well formed
    /// (they come from the store) and it is sampled.
    pub fn as_parent(&self) -> Option<SpanParent> {
        let trace_id = TraceId::from_hex(&self.trace_id).ok()?;
        let span_id = SpanId::from_hex(&self.span_id).ok()?;
        (self.sampled && trace_id != TraceId::INVALID && span_id != SpanId::INVALID)
            .then_some(SpanParent { trace_id, span_id })
    }

    /// Reports the turn's own span, ended now, with `outcome`
    /// (`completed`, `failed`, `cancelled`).
    pub fn report_end(&self, session: &str, turn: &str, outcome: &str) {
        if !enabled() {
            return;
        }
        let Some(own) = self.as_parent() else {
            return;
        };
        let parent = self
            .parent_span_id
            .as_deref()
            .and_then(|id| SpanId::from_hex(id).ok())
            .map(|span_id| SpanParent {
                trace_id: own.trace_id,
                span_id,
            });
        report(FinishedSpan {
            name: Cow::Borrowed("turn"),
            parent,
            own_ids: Some(own),
            // A corrupt stored time must not panic: it starts at the end.
            start: UNIX_EPOCH
                .checked_add(Duration::from_millis(self.started_at_ms))
                .unwrap_or_else(SystemTime::now),
            end: SystemTime::now(),
            attributes: vec![
                KeyValue::new("dexa.session", session.to_string()),
                KeyValue::new("dexa.turn", turn.to_string()),
                KeyValue::new("dexa.outcome", outcome.to_string()),
            ],
            error: (outcome == "failed").then(|| "the turn failed".to_string()),
        });
    }
}

/// A span that another span (in any process) is reported under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanParent {
    pub trace_id: TraceId,
    pub span_id: SpanId,
}

/// A span to report, after it ended.
#[derive(Debug)]
pub struct FinishedSpan {
    pub name: Cow<'static, str>,
    /// None: the root of a trace of its own.
    pub parent: Option<SpanParent>,
    /// The span's own ids when they were given ahead (a turn's); else new.
    pub own_ids: Option<SpanParent>,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<KeyValue>,
    /// Set: the span's status is an error with this description.
    pub error: Option<String>,
}

/// Whether spans are exported (an endpoint was configured at start).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Reports `span` to the installed exporter (nothing without one).
pub fn report(span: FinishedSpan) {
    if !enabled() {
        return;
    }
    let tracer = opentelemetry::global::tracer("dexa");
    let parent = match span.parent {
        Some(parent) => Context::new().with_remote_span_context(SpanContext::new(
            parent.trace_id,
            parent.span_id,
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        )),
        None => Context::new(),
    };
    let mut builder = tracer
        .span_builder(span.name)
        .with_kind(SpanKind::Internal)
        .with_start_time(span.start)
        .with_attributes(span.attributes);
    if let Some(own) = span.own_ids {
        builder = builder
            .with_trace_id(own.trace_id)
            .with_span_id(own.span_id);
    }
    let mut built = tracer.build_with_context(builder, &parent);
    use opentelemetry::trace::Span as _;
    if let Some(error) = span.error {
        built.set_status(Status::error(error));
    }
    built.end_with_timestamp(span.end);
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map(|since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The installed exporter: flushes and stops it when dropped.
pub struct TracesGuard {
    provider: SdkTracerProvider,
}

impl Drop for TracesGuard {
    fn drop(&mut self) {
        ENABLED.store(false, Ordering::Relaxed);
        let provider = self.provider.clone();
        // Shutting down waits for the last export: off the async runtime's
        // threads, so that it may block.
        let flushed = std::thread::spawn(move || provider.shutdown()).join();
        if let Ok(Err(err)) = flushed {
            tracing::warn!(error = %err, "the last spans were not exported");
        }
    }
}

/// The protocol dexa exports with, as `OTEL_EXPORTER_OTLP_PROTOCOL` names it.
const PROTOCOL: &str = "http/json";

/// Installs an OTLP/HTTP (JSON) span exporter when one of
/// [`ENDPOINT_VARIABLES`] is set and `OTEL_SDK_DISABLED` is not `true`; the
/// SDK's other `OTEL_*` variables (headers, timeout, the batch's delay and
/// size, `OTEL_SERVICE_NAME`) apply. None when no endpoint is set. A
/// protocol other than `http/json` is refused, rather than ignored.
pub fn install_from_env() -> anyhow::Result<Option<TracesGuard>> {
    let set = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|value| value.trim().to_string())
            .filter(|value| !value.is_empty())
    };
    let configured = ENDPOINT_VARIABLES.iter().any(|name| set(name).is_some());
    let disabled = set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !configured || disabled {
        return Ok(None);
    }
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(protocol) = set(name) {
            anyhow::ensure!(
                protocol == PROTOCOL,
                "{name}={protocol:?}: dexa exports traces over OTLP {PROTOCOL} only (unset it, \
                 or set {PROTOCOL})"
            );
        }
    }
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .build()
        .map_err(|err| anyhow::anyhow!("the OTLP trace exporter could not be set up: {err}"))?;
    let resource = Resource::builder()
        .with_service_name(
            std::env::var("OTEL_SERVICE_NAME")
                .ok()
                .filter(|name| !name.trim().is_empty())
                .unwrap_or_else(|| "dexa".to_string()),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    // The provider is the global one; `tracer_provider` keeps the trait in use.
    let _ = provider.tracer("dexa");
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Some(TracesGuard { provider }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(traceparent: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_str(traceparent).expect("a header value"),
        );
        headers
    }

    #[test]
    fn a_valid_traceparent_becomes_the_turns_parent_and_keeps_its_sampling() {
        let trace = TurnTrace::from_headers(&headers(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ));
        assert_eq!(trace.trace_id, "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(trace.parent_span_id.as_deref(), Some("b7ad6b7169203331"));
        assert_ne!(trace.span_id, "b7ad6b7169203331");
        assert!(trace.sampled);
        let unsampled = TurnTrace::from_headers(&headers(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        ));
        assert!(!unsampled.sampled);
        assert_eq!(unsampled.as_parent(), None);
    }

    #[test]
    fn a_malformed_or_absent_traceparent_starts_a_new_trace() {
        for bad in [
            "",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "garbage",
        ] {
            let trace = TurnTrace::from_headers(&headers(bad));
            assert_eq!(trace.parent_span_id, None, "{bad:?}");
            assert_ne!(
                trace.trace_id, "0af7651916cd43dd8448eb211c80319c",
                "{bad:?}"
            );
            assert!(trace.as_parent().is_some(), "{bad:?}");
        }
        assert!(TurnTrace::from_headers(&http::HeaderMap::new())
            .as_parent()
            .is_some());
    }

    #[test]
    fn ids_read_back_from_the_store_are_checked() {
        let mut trace = TurnTrace::new_root();
        trace.trace_id = "not hex".to_string();
        assert_eq!(trace.as_parent(), None);
        let mut trace = TurnTrace::new_root();
        trace.span_id = "0000000000000000".to_string();
        assert_eq!(trace.as_parent(), None);
    }
}
