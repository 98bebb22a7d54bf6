//! The span of one Step attempt, reported when the attempt is over (see
//! [`crate::telemetry::traces`]), and its duration metric.

use std::time::SystemTime;

use opentelemetry::KeyValue;

use super::context::StepContext;
use super::types::ClaimedTask;
use crate::telemetry::{
    self,
    traces::{self, FinishedSpan},
};

/// The longest error text a span carries: the history keeps the whole.
const ERROR_BYTES: usize = 1024;

/// How an attempt ended, as its span's `dexa.outcome` says.
pub(super) enum SpanOutcome<'a> {
    /// Its result committed.
    Committed,
    /// It failed (retried, routed or failing the flow) with this error.
    Failed(&'a str),
    /// Its result was ready but the commit did not land (lease lost, store
    /// down): the Step runs again.
    NotCommitted,
    /// The task was taken from the flow (a cancel).
    Taken,
    /// The worker's drain deadline stopped it; the lease was handed back.
    Stopped,
}

impl SpanOutcome<'_> {
    /// The outcome's name, in spans and metrics.
    fn label(&self) -> &'static str {
        match self {
            SpanOutcome::Committed => "committed",
            SpanOutcome::Failed(_) => "failed",
            SpanOutcome::NotCommitted => "not_committed",
            SpanOutcome::Taken => "taken",
            SpanOutcome::Stopped => "stopped",
        }
    }
}

/// Reports the attempt of `task` that began at `started`, and, when it
/// committed, runs what its handler left for after the commit (a turn's
/// own span). `ctx` is None when no handler ran.
pub(super) fn report(
    task: &ClaimedTask,
    ctx: Option<&StepContext>,
    started: SystemTime,
    outcome: SpanOutcome<'_>,
) {
    let trace = ctx.map(StepContext::take_trace).unwrap_or_default();
    if matches!(outcome, SpanOutcome::Committed) {
        for then in trace.on_commit {
            then();
        }
    }
    let end = SystemTime::now();
    metrics::histogram!(
        telemetry::STEP_ATTEMPT,
        "step" => task.step_type.clone(),
        "outcome" => outcome.label()
    )
    .record(
        end.duration_since(started)
            .unwrap_or_default()
            .as_secs_f64(),
    );
    if !traces::enabled() || trace.unsampled {
        return;
    }
    let label = outcome.label();
    let error = match outcome {
        SpanOutcome::Failed(error) => Some(cut(error)),
        SpanOutcome::NotCommitted => Some("the result did not commit".into()),
        SpanOutcome::Committed | SpanOutcome::Taken | SpanOutcome::Stopped => None,
    };
    let mut attributes = vec![
        KeyValue::new("dexa.session", task.flow_id.clone()),
        KeyValue::new("dexa.flow_type", task.flow_type.clone()),
        KeyValue::new("dexa.step", task.step_type.clone()),
        KeyValue::new("dexa.step_execution_id", task.step_execution_id.clone()),
        KeyValue::new("dexa.attempt", i64::from(task.attempt)),
        KeyValue::new("dexa.outcome", label),
    ];
    if let Some(component) = ctx.and_then(StepContext::component) {
        attributes.push(KeyValue::new("dexa.component", component));
    }
    attributes.extend(trace.attributes);
    traces::report(FinishedSpan {
        name: task.step_type.clone().into(),
        parent: trace.parent,
        own_ids: None,
        start: started,
        end,
        attributes,
        error,
    });
}

fn cut(error: &str) -> String {
    if error.len() <= ERROR_BYTES {
        return error.to_string();
    }
    let mut end = ERROR_BYTES;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &error[..end])
}
