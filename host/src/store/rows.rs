//! Row decoding every store backend shares: the column lists it selects and
//! the checks that turn the raw values of a row into the engine's types.
//! Column names are the same on every backend; each backend reads its rows
//! into the raw types here and decodes them with these functions.

use crate::catalog::{Activation, ActivationMode, ComponentRecord};
use crate::flow::store::StoreError;
use crate::flow::types::{ClaimedTask, FlowInfo, FlowStatus, Json, RetryPolicy};

/// A stored value that does not decode.
pub(crate) fn corrupt(what: &str, err: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {err}"))
}

pub(crate) fn parse_json(what: &str, text: &str) -> Result<Json, StoreError> {
    serde_json::from_str(text).map_err(|err| corrupt(what, err))
}

pub(crate) const FLOW_COLUMNS: &str =
    "flow_id, flow_type, status, created_at_ms, updated_at_ms, error";

/// A flow's row, in [`FLOW_COLUMNS`] order.
pub(crate) type FlowRowRaw = (String, String, String, i64, i64, Option<String>);

pub(crate) fn to_flow_info(
    (flow_id, flow_type, status, created_at, updated_at, error): FlowRowRaw,
) -> Result<FlowInfo, StoreError> {
    let status = FlowStatus::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("flow {flow_id} has status {status:?}")))?;
    Ok(FlowInfo {
        flow_id,
        flow_type,
        status,
        created_at,
        updated_at,
        error,
    })
}

pub(crate) const TASK_COLUMNS: &str =
    "task_id, flow_id, flow_type, step_type, input, attempt, lease_token,
    policy, failure_route, failure, locks, timer_fired, first_attempt_at_ms, attempt_started_at_ms,
    wait_channel, wait_key, wait_count, output_recorded";

/// A task's row, in [`TASK_COLUMNS`] order, before its JSON is decoded.
pub(crate) struct TaskRowRaw {
    pub task_id: i64,
    pub flow_id: String,
    pub flow_type: String,
    pub step_type: String,
    pub input: String,
    pub attempt: u32,
    pub lease_token: i64,
    pub policy: String,
    pub failure_route: Option<String>,
    pub failure: Option<String>,
    pub locks: String,
    pub timer_fired: bool,
    pub first_attempt_at: i64,
    pub attempt_started_at: i64,
    pub wait: Option<(String, String, u32)>,
    pub output_recorded: bool,
}

/// A decoded task row.
pub(crate) struct TaskRow {
    pub task: ClaimedTask,
    pub wait: Option<(String, String, u32)>,
    pub output_recorded: bool,
}

pub(crate) fn decode_task(raw: TaskRowRaw) -> Result<TaskRow, StoreError> {
    let what = format!("task {}", raw.task_id);
    let policy: RetryPolicy =
        serde_json::from_str(&raw.policy).map_err(|err| corrupt(&what, err))?;
    let locks: Vec<String> = serde_json::from_str(&raw.locks).map_err(|err| corrupt(&what, err))?;
    Ok(TaskRow {
        task: ClaimedTask {
            task_id: raw.task_id,
            step_execution_id: format!("sx-{}", raw.task_id),
            input: parse_json(&what, &raw.input)?,
            flow_id: raw.flow_id,
            flow_type: raw.flow_type,
            step_type: raw.step_type,
            attempt: raw.attempt,
            lease_token: raw.lease_token,
            policy,
            failure_route: raw.failure_route,
            failure: raw.failure,
            locks,
            messages: Vec::new(),
            timer_fired: raw.timer_fired,
            first_attempt_at: raw.first_attempt_at,
            attempt_started_at: raw.attempt_started_at,
        },
        wait: raw.wait,
        output_recorded: raw.output_recorded,
    })
}

pub(crate) const ACTIVATION_COLUMNS: &str =
    "seq, agent, role, digest, mode, percent, upgrade_in_flight, actor, reason, at_ms";

/// Completes `activation` (read with a placeholder mode) with its stored
/// `mode` and `percent`.
pub(crate) fn to_activation(
    mut activation: Activation,
    mode: String,
    percent: Option<u8>,
) -> Result<Activation, StoreError> {
    activation.mode = match (mode.as_str(), percent) {
        ("current", _) => ActivationMode::Current,
        ("ramp", Some(percent)) => ActivationMode::Ramp(percent),
        _ => {
            return Err(StoreError::Corrupt(format!(
                "activation {} has mode {mode:?} ({percent:?} %)",
                activation.seq
            )))
        }
    };
    Ok(activation)
}

pub(crate) fn to_record(digest: &str, text: String) -> Result<ComponentRecord, StoreError> {
    serde_json::from_str(&text)
        .map_err(|err| corrupt(&format!("the record of component {digest}"), err))
}

/// The refusal of a live append to a flow that has ended (both backends).
pub(crate) fn stream_closed(flow_id: &str, status: &str) -> StoreError {
    StoreError::FlowEnded {
        flow_id: flow_id.to_string(),
        status: status.to_string(),
    }
}
