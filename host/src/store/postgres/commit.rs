//! A Step's commit on PostgreSQL, in as few round trips as its shape
//! allows.
//!
//! A commit is several statements, and on a busy database each round trip
//! costs more than its statement: a wake-up of the server's process and of
//! the worker's on every one. So they are pipelined (sent together, run in
//! order): a commit without state writes is `BEGIN`, one pipeline (lock the
//! flow, fence, record and remove in one statement, then insert the next
//! tasks, claim the next) and `COMMIT`. State writes, which read what they write, run one at a
//! time between the two halves: the Step's other writes in its order, then
//! each stream's appends as one batch (see `crate::store::write_plan`).
//!
//! A sequential flow's next Step is inserted already leased to the
//! committing worker when nothing else of the flow is running or due: what
//! a claim right after would have leased, without a second write of the
//! row (and of its indexes).
//!
//! The answers are read in the order the statements ran, and the first
//! refusal wins (a lost lease before a message consumed twice), as when
//! they ran one at a time. A refused commit rolls back whole, including
//! the statements after the refusal.

use std::sync::LazyLock;

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::claims::{finish_claim, in_flow_rows, CLAIM_IN_FLOW};
use super::sql::{pipeline, Piped, TxResult};
use super::tasks::{task_row, TaskValues, DROP_LOCKS, DROP_TASKS, INSERT_TASK, WAKE_WAITERS};
use crate::flow::store::{StepCommit, StoreError};
use crate::flow::types::{ClaimedTask, StoreMillis};
use crate::store::rows::{decode_task, TASK_COLUMNS};
use crate::store::write_plan::WritePlan;

/// What a commit did.
pub(super) struct Committed {
    /// The ids of the next tasks it inserted.
    pub inserted: Vec<i64>,
    /// The tasks it leased to the committing worker (`claim_next`).
    pub claimed: Vec<ClaimedTask>,
}

/// Locks the flow's row (every writer of a flow takes it first), fences
/// (the task is still leased under this token), removes the task, records
/// its history entry and releases the state locks it held, in one
/// statement; a row only when the fence held.
///
/// The flow's row is locked before the task's: the `EXISTS` on `locked` is
/// a one-time filter the task's scan waits behind, the order every writer
/// of a flow follows. A commit that waited there for another writer sees
/// what it committed: a task it removed meanwhile fails the fence.
const FENCE: &str = "WITH locked AS (SELECT 1 FROM flows WHERE flow_id = $3 FOR UPDATE),
     fenced AS (
       DELETE FROM tasks WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'
         AND flow_id = $3 AND EXISTS (SELECT 1 FROM locked)
       RETURNING locks),
     recorded AS (
       INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id,
           attempt, at_ms, detail, started_at_ms, component)
       SELECT $3::text, $4::text, $5::text, $6::text, $7::bigint, $8::bigint, $9::text,
              $10::bigint, $11::text
       FROM fenced
       RETURNING 1),
     released AS (
       DELETE FROM state_locks
       WHERE task_id = $1 AND EXISTS (SELECT 1 FROM fenced WHERE locks <> '[]')
       RETURNING 1)
     SELECT (SELECT COUNT(*) FROM recorded), (SELECT COUNT(*) FROM released) FROM fenced";

const CONSUME: &str = "DELETE FROM channel_messages WHERE message_id = $1 RETURNING 1";

/// Completes the flow ($1) at $2.
const COMPLETE: &str = "UPDATE flows SET status = 'completed', updated_at_ms = $2
     WHERE flow_id = $1 AND status = 'running'";

/// Completes the flow ($1) at $2 when it has no task left.
const COMPLETE_IF_DONE: &str = "UPDATE flows SET status = 'completed', updated_at_ms = $2
     WHERE flow_id = $1 AND status = 'running'
       AND NOT EXISTS (SELECT 1 FROM tasks WHERE flow_id = $1)";

/// [`INSERT_TASK`], leasing the task ($14 the owner, $15 the lease's end,
/// $16 now) when the flow has no task running or due: the task a claim of
/// the flow made next would take. Its last column says whether it did.
static INSERT_LEASED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt, not_before_ms,
            wait_channel, wait_key, wait_count, wake_at_ms, policy, failure_route, failure, locks,
            lease_owner, lease_token, lease_expires_ms, attempt_started_at_ms, first_attempt_at_ms)
         SELECT $1, (SELECT flow_type FROM flows WHERE flow_id = $1), $2, $3,
                CASE WHEN free THEN 'leased' ELSE $4 END, 1, $5, $6, $7, $8, $9, $10, $11, $12, $13,
                CASE WHEN free THEN $14 END, CASE WHEN free THEN 1 ELSE 0 END,
                CASE WHEN free THEN $15::bigint END, CASE WHEN free THEN $16::bigint END,
                CASE WHEN free THEN $16::bigint END
         FROM (SELECT NOT EXISTS (
                 SELECT 1 FROM tasks WHERE flow_id = $1
                   AND CASE state WHEN 'leased' THEN TRUE
                                  WHEN 'ready' THEN not_before_ms <= $16
                                  WHEN 'waiting' THEN wake_at_ms <= $16
                                  ELSE FALSE END) AS free) AS flow
         RETURNING {TASK_COLUMNS}, state = 'leased'"
    )
});

/// Applies `commit`; the caller runs it in a transaction.
pub(super) async fn commit_step<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    commit: &StepCommit,
) -> TxResult<Committed> {
    let flow_id = commit.flow_id.as_str();
    let entry = &commit.history;
    let detail = entry.detail.as_deref().filter(|d| !d.is_empty());
    let attempt = i64::from(entry.final_attempt);
    let fence: Vec<&(dyn ToSql + Sync)> = vec![
        &commit.task_id,
        &commit.lease_token,
        &flow_id,
        &entry.event_type,
        &entry.step_type,
        &entry.step_execution_id,
        &attempt,
        &entry.at,
        &detail,
        &entry.started_at,
        &entry.component,
    ];
    // First half: everything a state write may come after.
    let mut first = vec![Piped::new(FENCE, fence)];
    if commit.complete_flow {
        // Before any stream or channel row is locked: the flow's other
        // tasks go while this transaction holds nothing another writer
        // waits on.
        first.push(Piped::new(DROP_LOCKS, vec![&flow_id]));
        first.push(Piped::new(DROP_TASKS, vec![&flow_id]));
    }
    for message_id in &commit.consumed {
        first.push(Piped::new(CONSUME, vec![message_id]));
    }

    // Second half: the next tasks, the flow's completion, the claim.
    let values = if commit.complete_flow {
        Vec::new()
    } else {
        commit
            .next
            .iter()
            .map(TaskValues::new)
            .collect::<Result<Vec<_>, StoreError>>()?
    };
    let params: Vec<[&(dyn ToSql + Sync); 12]> = values.iter().map(TaskValues::params).collect();
    let claim = commit.claim_next.as_ref().filter(|next| next.max > 0);
    let lease_end = claim.map(|next| now + next.lease_ms);
    let max = claim.map(|next| next.max as i64);
    // One next task, due now, on a claim: it may be leased as it is
    // inserted. Otherwise (or when the flow has another due or running
    // task) the claim below decides.
    let lease_as_inserted = match (claim, commit.next.as_slice()) {
        (Some(_), [only]) => !commit.complete_flow && only.wait.is_none() && only.not_before <= now,
        _ => false,
    };
    let mut second = Vec::new();
    for (values, params) in values.iter().zip(&params) {
        let mut insert: Vec<&(dyn ToSql + Sync)> = vec![&flow_id];
        insert.extend_from_slice(params);
        match (claim, &lease_end) {
            (Some(next), Some(lease_end)) if lease_as_inserted => {
                insert.extend([&next.worker_id as &(dyn ToSql + Sync), lease_end, &now]);
                second.push(Piped::new(&INSERT_LEASED, insert));
            }
            _ => second.push(Piped::new(INSERT_TASK, insert)),
        }
        if let Some([channel, key]) = values.channel_params() {
            // A task whose channel condition already holds is ready.
            second.push(Piped::new(WAKE_WAITERS, vec![&flow_id, channel, key]));
        }
    }
    if commit.complete_flow {
        second.push(Piped::new(COMPLETE, vec![&flow_id, &now]));
    } else if commit.next.is_empty() {
        second.push(Piped::new(COMPLETE_IF_DONE, vec![&flow_id, &now]));
    }
    let claim_params: Option<Vec<&(dyn ToSql + Sync)>> = match (claim, &lease_end, &max) {
        (Some(next), Some(lease_end), Some(max)) => {
            Some(vec![&flow_id, &next.worker_id, lease_end, &now, max])
        }
        _ => None,
    };
    if let Some(params) = claim_params.as_ref().filter(|_| !lease_as_inserted) {
        second.push(Piped::new(&CLAIM_IN_FLOW, params.clone()));
    }

    let mut answers = if commit.writes.is_empty() {
        first.append(&mut second);
        let mut answers = pipeline(tx, &first).await?.into_iter();
        check_first_half(commit, &mut answers)?;
        answers
    } else {
        // Refused before the writes run: a stale commit writes nothing.
        check_first_half(commit, &mut pipeline(tx, &first).await?.into_iter())?;
        let plan = WritePlan::of(&commit.writes);
        for write in plan.others {
            super::state::apply_write(tx, now, flow_id, write).await?;
        }
        for (stream, entries) in &plan.appends {
            super::streams::append_fitting(tx, now, flow_id, stream, entries).await?;
        }
        pipeline(tx, &second).await?.into_iter()
    };
    let mut inserted = Vec::with_capacity(values.len());
    let mut leased = Vec::new();
    for values in &values {
        let rows = next_answer(&mut answers)?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::Backend("inserting a task returned no id".into()))?;
        inserted.push(row.get::<_, i64>(0));
        if lease_as_inserted && row.get::<_, bool>(18) {
            leased.push(decode_task(task_row(row)?)?);
        }
        if values.channel().is_some() {
            next_answer(&mut answers)?;
        }
    }
    if commit.complete_flow || commit.next.is_empty() {
        next_answer(&mut answers)?;
    }
    let leased = match claim_params {
        None => Vec::new(),
        Some(_) if !leased.is_empty() => leased,
        // Inserted ready after all: another task of the flow is running
        // or due, and the claim decides, as it would have.
        Some(params) if lease_as_inserted => {
            in_flow_rows(&super::sql::query(tx, &CLAIM_IN_FLOW, &params).await?)?
        }
        Some(_) => in_flow_rows(&next_answer(&mut answers)?)?,
    };
    let claimed = finish_claim(tx, leased).await?;
    Ok(Committed { inserted, claimed })
}

/// The answers of a pipeline, read in order.
type Answers = std::vec::IntoIter<Result<Vec<Row>, tokio_postgres::Error>>;

/// Reads the first half's answers, in order; refuses at the first it
/// cannot accept.
fn check_first_half(commit: &StepCommit, answers: &mut Answers) -> TxResult<()> {
    if next_answer(answers)?.is_empty() {
        return Err(StoreError::StaleLease {
            task_id: commit.task_id,
        }
        .into());
    }
    if commit.complete_flow {
        next_answer(answers)?;
        next_answer(answers)?;
    }
    for message_id in &commit.consumed {
        if next_answer(answers)?.is_empty() {
            return Err(StoreError::Conflict(format!(
                "channel message {message_id} was already consumed"
            ))
            .into());
        }
    }
    Ok(())
}

/// The next statement's rows, or its error.
fn next_answer(answers: &mut Answers) -> TxResult<Vec<Row>> {
    match answers.next() {
        Some(Ok(rows)) => Ok(rows),
        Some(Err(err)) => Err(err.into()),
        None => Err(StoreError::Backend("a commit's statement gave no answer".into()).into()),
    }
}
