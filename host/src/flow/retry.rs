//! What follows a failed attempt: the retry policy and the failure route.

use super::registry::{Registry, StepError};
use super::store::FailureAction;
use super::types::{history, ClaimedTask, StepCall, StepHistoryEntry, StoreMillis};

/// Why an attempt failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptError {
    Step(StepError),
    AttemptTimeout {
        after_ms: u64,
    },
    HeartbeatTimeout {
        after_ms: u64,
    },
    /// The worker went away after the Step had produced output.
    WorkerLost,
    /// The worker shut down (its drain deadline passed) after the Step had
    /// produced output.
    WorkerStopped,
    /// The task was taken from its flow while the Step ran (a cancel): the
    /// Step was stopped, and there is nothing to retry or record.
    Taken,
}

impl AttemptError {
    pub fn message(&self) -> String {
        match self {
            AttemptError::Step(err) => err.to_string(),
            AttemptError::AttemptTimeout { after_ms } => {
                format!("attempt timed out after {after_ms} ms")
            }
            AttemptError::HeartbeatTimeout { after_ms } => {
                format!("no heartbeat for {after_ms} ms")
            }
            AttemptError::WorkerLost => {
                "the worker was lost after the Step had started (its lease expired)".to_string()
            }
            AttemptError::WorkerStopped => {
                "the worker shut down after the Step had started (its drain deadline passed)"
                    .to_string()
            }
            AttemptError::Taken => {
                "the task was taken from its flow while the Step ran; it was stopped".to_string()
            }
        }
    }

    fn is_fatal(&self) -> bool {
        matches!(self, AttemptError::Step(StepError::Fatal(_)))
    }
}

/// Decides between another attempt and giving up, per the task's policy.
pub fn after_failure(
    registry: &Registry,
    task: &ClaimedTask,
    error: &AttemptError,
    now: StoreMillis,
) -> (FailureAction, StepHistoryEntry) {
    let message = error.message();
    let next_attempt = task.attempt + 1;
    let backoff_ms = task.policy.backoff_before(next_attempt).as_millis() as i64;
    let within_window = task
        .policy
        .window
        .is_none_or(|window| now + backoff_ms <= task.first_attempt_at + window.as_millis() as i64);
    if !error.is_fatal() && next_attempt <= task.policy.max_attempts && within_window {
        return (
            FailureAction::Retry {
                attempt: next_attempt,
                not_before: now + backoff_ms,
            },
            entry(task, history::ATTEMPT_FAILED, now, message),
        );
    }
    let route = task.failure_route.as_ref().map(|route| {
        registry.new_task(
            &task.flow_type,
            StepCall::new(route.clone(), task.input.clone()),
            now,
            Some(message.clone()),
        )
    });
    let route = match route {
        Some(Ok(task)) => Some(Box::new(task)),
        Some(Err(err)) => {
            tracing::error!(error = %err, "failure route cannot be built; failing the flow");
            None
        }
        None => None,
    };
    let flow_error = format!(
        "step {} failed after {} attempt(s): {message}",
        task.step_type, task.attempt
    );
    (
        FailureAction::GiveUp { route, flow_error },
        entry(task, history::EXECUTE_FAILED, now, message),
    )
}

/// The history entry of a lost worker's task that had produced nothing.
pub fn redelivery(task: &ClaimedTask, now: StoreMillis) -> (FailureAction, StepHistoryEntry) {
    (
        FailureAction::Redeliver,
        entry(
            task,
            history::REDELIVERED,
            now,
            "the worker was lost before the Step produced output".to_string(),
        ),
    )
}

pub(crate) fn entry(
    task: &ClaimedTask,
    event_type: &str,
    now: StoreMillis,
    detail: String,
) -> StepHistoryEntry {
    StepHistoryEntry {
        event_type: event_type.to_string(),
        step_type: task.step_type.clone(),
        step_execution_id: task.step_execution_id.clone(),
        final_attempt: task.attempt,
        at: now,
        detail: Some(detail),
        started_at: Some(task.attempt_started_at),
        component: None,
    }
}
