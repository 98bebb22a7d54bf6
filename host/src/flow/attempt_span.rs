//! The span of one Step attempt, reported when the attempt is over (see
//! [`crate::telemetry::traces`]).

use std::time::SystemTime;

use opentelemetry::KeyValue;

use super::context::StepContext;
use super::types::ClaimedTask;
use crate::telemetry::traces::{self, FinishedSpan};

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
    if !traces::enabled() || trace.unsampled {
        return;
    }
    let (label, error) = match outcome {
        SpanOutcome::Committed => ("committed", None),
        SpanOutcome::Failed(error) => ("failed", Some(cut(error))),
        SpanOutcome::NotCommitted => ("not_committed", Some("the result did not commit".into())),
        SpanOutcome::Taken => ("taken", None),
        SpanOutcome::Stopped => ("stopped", None),
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
        end: SystemTime::now(),
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
