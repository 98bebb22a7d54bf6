//! How a worker waits for a Step's handler: until it returns, its attempt
//! or heartbeat deadline passes, or its task is taken from its flow.

use std::future::Future;
use std::time::{Duration, Instant};

use super::context::Heartbeat;
use super::registry::StepError;
use super::retry::AttemptError;
use super::types::{RetryPolicy, StepResult};

/// Waits for the handler, enforcing the attempt and heartbeat deadlines.
pub(super) async fn supervise(
    mut handle: tokio::task::JoinHandle<Result<StepResult, StepError>>,
    policy: &RetryPolicy,
    heartbeat: &Heartbeat,
    taken: impl Future<Output = ()>,
) -> Result<StepResult, AttemptError> {
    tokio::pin!(taken);
    let started = Instant::now();
    let attempt_deadline = policy.attempt_timeout.map(|t| started + t);
    loop {
        let heartbeat_deadline = policy.heartbeat_timeout.map(|t| heartbeat.last_beat() + t);
        let next = [attempt_deadline, heartbeat_deadline]
            .into_iter()
            .flatten()
            .min();
        let wake = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            joined = &mut handle => {
                return match joined {
                    Ok(Ok(result)) => Ok(result),
                    Ok(Err(err)) => Err(AttemptError::Step(err)),
                    Err(err) if err.is_panic() => Err(AttemptError::Step(StepError::retryable(
                        format!("the step handler panicked: {}", panic_message(err.into_panic())),
                    ))),
                    Err(_) => Err(AttemptError::Step(StepError::retryable("the step was cancelled"))),
                };
            }
            () = &mut taken => {
                handle.abort();
                return Err(AttemptError::Taken);
            }
            _ = tokio::time::sleep_until(wake.into()) => {
                let now = Instant::now();
                if let (Some(deadline), Some(timeout)) = (attempt_deadline, policy.attempt_timeout) {
                    if now >= deadline {
                        handle.abort();
                        return Err(AttemptError::AttemptTimeout { after_ms: timeout.as_millis() as u64 });
                    }
                }
                if let Some(timeout) = policy.heartbeat_timeout {
                    if now >= heartbeat.last_beat() + timeout {
                        handle.abort();
                        return Err(AttemptError::HeartbeatTimeout { after_ms: timeout.as_millis() as u64 });
                    }
                }
            }
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        text.to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-string panic".to_string()
    }
}
