//! SQL for tasks, state, channels, streams and history, shared by the
//! store's operations and its RPC transactions.

use rusqlite::{params, params_from_iter, Connection, OptionalExtension, Row};

use super::{backend, cached_execute, cached_query_row, exists, in_list};
use crate::flow::store::{ExpiredLease, RpcError, StateTx, StepCommit, StoreError};
use crate::flow::types::{
    ChannelMessage, ClaimedTask, FlowInfo, Json, MapQuery, NewTask, RetryPolicy, StateWrite,
    StepHistoryEntry, StoreMillis, Versioned,
};

fn corrupt(what: &str, err: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {err}"))
}

pub(super) fn parse_json(what: &str, text: &str) -> Result<Json, StoreError> {
    serde_json::from_str(text).map_err(|err| corrupt(what, err))
}

pub(super) fn flow_info(conn: &Connection, flow_id: &str) -> Result<Option<FlowInfo>, StoreError> {
    let row = cached_query_row(
        conn,
        &format!(
            "SELECT {} FROM flows WHERE flow_id = ?1",
            super::FLOW_COLUMNS
        ),
        params![flow_id],
        super::flow_row,
    )
    .optional()
    .map_err(backend)?;
    row.map(super::to_flow_info).transpose()
}

/// Inserts a task; a task whose channel condition already holds is ready.
pub(super) fn insert_task(
    conn: &Connection,
    flow_id: &str,
    flow_type: &str,
    task: &NewTask,
) -> Result<i64, StoreError> {
    let channel = task.wait.as_ref().and_then(|w| w.channel.as_ref());
    let wake_at = task.wait.as_ref().and_then(|w| w.timer_at);
    let state = if task.wait.is_some() {
        "waiting"
    } else {
        "ready"
    };
    let policy = serde_json::to_string(&task.policy).map_err(backend)?;
    let locks = serde_json::to_string(&task.locks).map_err(backend)?;
    cached_execute(
        conn,
        "INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt, not_before_ms,
            wait_channel, wait_key, wait_count, wake_at_ms, policy, failure_route, failure, locks)
         VALUES (?1, ?2, ?3, ?4, ?5, 1, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        params![
            flow_id,
            flow_type,
            task.step_type,
            task.input.to_string(),
            state,
            task.not_before,
            channel.map(|c| c.channel.as_str()),
            channel.map(|c| c.key.as_str()),
            channel.map(|c| c.count),
            wake_at,
            policy,
            task.failure_route,
            task.failure,
            locks,
        ],
    )
    .map_err(backend)?;
    let task_id = conn.last_insert_rowid();
    if let Some(channel) = channel {
        wake_waiters(conn, flow_id, &channel.channel, &channel.key)?;
    }
    Ok(task_id)
}

/// Marks waiting tasks ready whose channel condition now holds.
fn wake_waiters(
    conn: &Connection,
    flow_id: &str,
    channel: &str,
    key: &str,
) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "UPDATE tasks SET state = 'ready'
         WHERE flow_id = ?1 AND state = 'waiting' AND wait_channel = ?2 AND wait_key = ?3
           AND wait_count <= (SELECT COUNT(*) FROM channel_messages
                              WHERE flow_id = ?1 AND channel = ?2 AND key = ?3)",
        params![flow_id, channel, key],
    )
    .map_err(backend)?;
    Ok(())
}

pub(super) fn drop_tasks(conn: &Connection, flow_id: &str) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "DELETE FROM state_locks WHERE flow_id = ?1",
        params![flow_id],
    )
    .map_err(backend)?;
    cached_execute(
        conn,
        "DELETE FROM tasks WHERE flow_id = ?1",
        params![flow_id],
    )
    .map_err(backend)?;
    Ok(())
}

const TASK_COLUMNS: &str = "task_id, flow_id, flow_type, step_type, input, attempt, lease_token,
    policy, failure_route, failure, locks, timer_fired, first_attempt_at_ms, attempt_started_at_ms,
    wait_channel, wait_key, wait_count, output_recorded";

struct TaskRow {
    task: ClaimedTask,
    wait: Option<(String, String, u32)>,
    output_recorded: bool,
}

fn task_row(row: &Row<'_>) -> rusqlite::Result<TaskRowRaw> {
    let channel: Option<String> = row.get(14)?;
    let wait = match channel {
        Some(channel) => Some((channel, row.get::<_, String>(15)?, row.get::<_, u32>(16)?)),
        None => None,
    };
    Ok(TaskRowRaw {
        task_id: row.get(0)?,
        flow_id: row.get(1)?,
        flow_type: row.get(2)?,
        step_type: row.get(3)?,
        input: row.get(4)?,
        attempt: row.get(5)?,
        lease_token: row.get(6)?,
        policy: row.get(7)?,
        failure_route: row.get(8)?,
        failure: row.get(9)?,
        locks: row.get(10)?,
        timer_fired: row.get::<_, i64>(11)? != 0,
        first_attempt_at: row.get::<_, Option<i64>>(12)?.unwrap_or(0),
        attempt_started_at: row.get::<_, Option<i64>>(13)?.unwrap_or(0),
        wait,
        output_recorded: row.get::<_, i64>(17)? != 0,
    })
}

struct TaskRowRaw {
    task_id: i64,
    flow_id: String,
    flow_type: String,
    step_type: String,
    input: String,
    attempt: u32,
    lease_token: i64,
    policy: String,
    failure_route: Option<String>,
    failure: Option<String>,
    locks: String,
    timer_fired: bool,
    first_attempt_at: i64,
    attempt_started_at: i64,
    wait: Option<(String, String, u32)>,
    output_recorded: bool,
}

fn load_task(conn: &Connection, task_id: i64) -> Result<TaskRow, StoreError> {
    let raw = cached_query_row(
        conn,
        &format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = ?1"),
        params![task_id],
        task_row,
    )
    .map_err(backend)?;
    decode_task(raw)
}

fn decode_task(raw: TaskRowRaw) -> Result<TaskRow, StoreError> {
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

fn channel_messages(
    conn: &Connection,
    flow_id: &str,
    channel: &str,
    key: &str,
    limit: u32,
) -> Result<Vec<ChannelMessage>, StoreError> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT message_id, payload FROM channel_messages
             WHERE flow_id = ?1 AND channel = ?2 AND key = ?3 ORDER BY message_id LIMIT ?4",
        )
        .map_err(backend)?;
    let rows = stmt
        .query_map(params![flow_id, channel, key, limit], |row| {
            Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?))
        })
        .map_err(backend)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(backend)?;
    rows.into_iter()
        .map(|(message_id, payload)| {
            Ok(ChannelMessage {
                message_id,
                channel: channel.to_string(),
                key: key.to_string(),
                payload: parse_json("channel message", &payload)?,
            })
        })
        .collect()
}

/// Marks that the leased attempt produced output, fenced by its token and by
/// a lease that has not run out: once it has, the reaper may be handing the
/// same attempt to another worker, and "output recorded" must then be
/// refused, never raced (the redelivery re-checks it in its own statement).
pub(super) fn record_output(
    conn: &Connection,
    now: StoreMillis,
    task_id: i64,
    lease_token: i64,
) -> Result<(), StoreError> {
    let updated = cached_execute(
        conn,
        "UPDATE tasks SET output_recorded = 1
             WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
               AND lease_expires_ms > ?3",
        params![task_id, lease_token, now],
    )
    .map_err(backend)?;
    if updated == 0 {
        return Err(StoreError::StaleLease { task_id });
    }
    Ok(())
}

/// Whether any task of `flow_types` could be claimed now (a cheap read that
/// spares the writer the claims that would find nothing).
pub(super) fn any_claimable(
    conn: &Connection,
    now: StoreMillis,
    flow_types: &[String],
) -> Result<bool, StoreError> {
    let sql = format!(
        "SELECT 1 FROM tasks
         WHERE flow_type IN ({})
           AND ((state = 'ready' AND not_before_ms <= ?) OR (state = 'waiting' AND wake_at_ms <= ?))
         LIMIT 1",
        in_list(flow_types.len())
    );
    let mut values: Vec<rusqlite::types::Value> =
        flow_types.iter().map(|t| t.clone().into()).collect();
    values.push(now.into());
    values.push(now.into());
    let mut stmt = conn.prepare_cached(&sql).map_err(backend)?;
    let found = stmt.exists(params_from_iter(values)).map_err(backend)?;
    Ok(found)
}

/// Which tasks a claim may take.
pub(super) enum ClaimScope<'a> {
    /// Any flow of these types (the worker's poll).
    FlowTypes(&'a [String]),
    /// This flow only (a claim made with a commit).
    Flow(&'a str),
}

/// How many of the oldest due tasks a claim weighs for fairness (at least).
const FAIR_CLAIM_WINDOW: usize = 256;

pub(super) fn claim(
    conn: &Connection,
    now: StoreMillis,
    worker_id: &str,
    scope: ClaimScope<'_>,
    max: usize,
    lease_ms: i64,
) -> Result<Vec<ClaimedTask>, StoreError> {
    let (filter, mut values): (String, Vec<rusqlite::types::Value>) = match scope {
        ClaimScope::FlowTypes(flow_types) => (
            format!("flow_type IN ({})", in_list(flow_types.len())),
            flow_types.iter().map(|t| t.clone().into()).collect(),
        ),
        // A flow's next Step rides with its commit only on a sequential
        // path: a flow already running others (a fan-out) gets its next one
        // through the fair claim below, so that it cannot keep a worker's
        // slots from other flows by committing into them.
        ClaimScope::Flow(flow_id) => (
            "flow_id = ? AND NOT EXISTS (SELECT 1 FROM tasks AS l
                WHERE l.flow_id = t.flow_id AND l.state = 'leased')"
                .to_string(),
            vec![flow_id.to_string().into()],
        ),
    };
    // Fair between flows: among the oldest due tasks (a window of at least
    // FAIR_CLAIM_WINDOW), a task goes first when its flow runs fewer Steps,
    // counting those this claim takes before it (its rank within its flow),
    // so that one flow's backlog (a fan-out of hundreds of tool calls)
    // delays another flow's next Step by a free slot, not by the backlog.
    let sql = format!(
        "SELECT task_id FROM (
           SELECT task_id, flow_id, not_before_ms,
                  ROW_NUMBER() OVER (PARTITION BY flow_id ORDER BY not_before_ms, task_id) AS rank
           FROM (
             SELECT task_id, flow_id, not_before_ms FROM tasks AS t
             WHERE {filter}
               AND ((state = 'ready' AND not_before_ms <= ?) OR (state = 'waiting' AND wake_at_ms <= ?))
             ORDER BY not_before_ms, task_id LIMIT ?)) AS due
         ORDER BY rank + (SELECT COUNT(*) FROM tasks AS l WHERE l.flow_id = due.flow_id AND l.state = 'leased'),
                  not_before_ms, task_id
         LIMIT ?"
    );
    values.push(now.into());
    values.push(now.into());
    values.push((max.saturating_mul(4).max(FAIR_CLAIM_WINDOW) as i64).into());
    values.push((max as i64).into());
    let ids = {
        let mut stmt = conn.prepare_cached(&sql).map_err(backend)?;
        let ids = stmt
            .query_map(params_from_iter(values), |row| row.get::<_, i64>(0))
            .map_err(backend)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(backend)?;
        ids
    };
    let mut claimed = Vec::with_capacity(ids.len());
    for task_id in ids {
        let raw = cached_query_row(
            conn,
            &format!(
                "UPDATE tasks SET state = 'leased', lease_owner = ?2, lease_token = lease_token + 1,
                    lease_expires_ms = ?3, attempt_started_at_ms = ?4,
                    first_attempt_at_ms = COALESCE(first_attempt_at_ms, ?4), output_recorded = 0,
                    timer_fired = CASE WHEN wake_at_ms IS NOT NULL AND wake_at_ms <= ?4 THEN 1 ELSE 0 END
                 WHERE task_id = ?1 RETURNING {TASK_COLUMNS}"
            ),
            params![task_id, worker_id, now + lease_ms, now],
            task_row,
        )
        .map_err(backend)?;
        let TaskRow { mut task, wait, .. } = decode_task(raw)?;
        if let Some((channel, key, count)) = wait {
            let messages = channel_messages(conn, &task.flow_id, &channel, &key, count)?;
            // A timer can wake the task before the condition holds; then it
            // gets no messages.
            if messages.len() as u32 >= count {
                task.messages = messages;
            }
        }
        for name in &task.locks {
            cached_execute(
                conn,
                "INSERT OR IGNORE INTO state_locks (flow_id, name, task_id) VALUES (?1, ?2, ?3)",
                params![task.flow_id, name, task_id],
            )
            .map_err(backend)?;
        }
        claimed.push(task);
    }
    Ok(claimed)
}

/// Refuses unless `task_id` is leased under `lease_token` (and, for the
/// reaper, its lease has run out by `expired_by`).
pub(super) fn check_lease(
    conn: &Connection,
    task_id: i64,
    lease_token: i64,
    expired_by: Option<StoreMillis>,
) -> Result<(), StoreError> {
    let held = match expired_by {
        None => exists(
            conn,
            "SELECT 1 FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'",
            params![task_id, lease_token],
        )?,
        Some(now) => exists(
            conn,
            "SELECT 1 FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
               AND lease_expires_ms <= ?3",
            params![task_id, lease_token, now],
        )?,
    };
    if held {
        Ok(())
    } else {
        Err(StoreError::StaleLease { task_id })
    }
}

pub(super) fn insert_history(
    conn: &Connection,
    flow_id: &str,
    entry: &StepHistoryEntry,
) -> Result<(), StoreError> {
    cached_execute(conn,
        "INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms, component)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            flow_id,
            entry.event_type,
            entry.step_type,
            entry.step_execution_id,
            entry.final_attempt,
            entry.at,
            entry.detail.as_deref().filter(|d| !d.is_empty()),
            entry.started_at,
            entry.component,
        ],
    )
    .map_err(backend)?;
    Ok(())
}

pub(super) fn commit_step(
    conn: &Connection,
    now: StoreMillis,
    commit: StepCommit,
) -> Result<(), StoreError> {
    let flow_id = &commit.flow_id;
    // Fences, finds the flow type and removes the task in one statement.
    let flow_type: Option<String> = cached_query_row(
        conn,
        "DELETE FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
         RETURNING flow_type",
        params![commit.task_id, commit.lease_token],
        |row| row.get(0),
    )
    .optional()
    .map_err(backend)?;
    let Some(flow_type) = flow_type else {
        return Err(StoreError::StaleLease {
            task_id: commit.task_id,
        });
    };
    for message_id in &commit.consumed {
        let deleted = cached_execute(
            conn,
            "DELETE FROM channel_messages WHERE message_id = ?1",
            params![message_id],
        )
        .map_err(backend)?;
        if deleted == 0 {
            return Err(StoreError::Conflict(format!(
                "channel message {message_id} was already consumed"
            )));
        }
    }
    for write in &commit.writes {
        apply_write(conn, now, flow_id, write)?;
    }
    insert_history(conn, flow_id, &commit.history)?;
    cached_execute(
        conn,
        "DELETE FROM state_locks WHERE task_id = ?1",
        params![commit.task_id],
    )
    .map_err(backend)?;
    if commit.complete_flow {
        drop_tasks(conn, flow_id)?;
    } else {
        for task in &commit.next {
            insert_task(conn, flow_id, &flow_type, task)?;
        }
    }
    // A flow with a next Step is still running; only check when it may be done.
    let done = commit.complete_flow
        || (commit.next.is_empty()
            && !exists(
                conn,
                "SELECT 1 FROM tasks WHERE flow_id = ?1",
                params![flow_id],
            )?);
    if done {
        cached_execute(
            conn,
            "UPDATE flows SET status = 'completed', updated_at_ms = ?2
             WHERE flow_id = ?1 AND status = 'running'",
            params![flow_id, now],
        )
        .map_err(backend)?;
    }
    Ok(())
}

pub(super) fn apply_write(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    write: &StateWrite,
) -> Result<(), StoreError> {
    match write {
        StateWrite::Set { name, key, value } => {
            set(conn, flow_id, name, key, value)?;
        }
        StateWrite::Delete { name, key } => delete(conn, flow_id, name, key)?,
        StateWrite::Clear { name } => {
            cached_execute(
                conn,
                "DELETE FROM attributes WHERE flow_id = ?1 AND name = ?2",
                params![flow_id, name],
            )
            .map_err(backend)?;
        }
        StateWrite::Publish {
            channel,
            key,
            payload,
        } => publish(conn, now, flow_id, channel, key, payload)?,
        StateWrite::Append { stream, payload } => {
            super::streams::append_fitting(
                conn,
                now,
                flow_id,
                stream,
                std::slice::from_ref(payload),
            )?;
        }
    }
    Ok(())
}

pub(super) fn get(
    conn: &Connection,
    flow_id: &str,
    name: &str,
    key: &str,
) -> Result<Option<Versioned>, StoreError> {
    let row = cached_query_row(
        conn,
        "SELECT value, version FROM attributes WHERE flow_id = ?1 AND name = ?2 AND key = ?3",
        params![flow_id, name, key],
        |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
    )
    .optional()
    .map_err(backend)?;
    row.map(|(value, version)| {
        Ok(Versioned {
            value: parse_json(&format!("{name}/{key}"), &value)?,
            version,
        })
    })
    .transpose()
}

fn set(
    conn: &Connection,
    flow_id: &str,
    name: &str,
    key: &str,
    value: &Json,
) -> Result<i64, StoreError> {
    cached_query_row(conn,
        "INSERT INTO attributes (flow_id, name, key, value, version) VALUES (?1, ?2, ?3, ?4, 1)
         ON CONFLICT (flow_id, name, key) DO UPDATE SET value = excluded.value, version = version + 1
         RETURNING version",
        params![flow_id, name, key, value.to_string()],
        |row| row.get(0),
    )
    .map_err(backend)
}

fn delete(conn: &Connection, flow_id: &str, name: &str, key: &str) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "DELETE FROM attributes WHERE flow_id = ?1 AND name = ?2 AND key = ?3",
        params![flow_id, name, key],
    )
    .map_err(backend)?;
    Ok(())
}

fn publish(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    channel: &str,
    key: &str,
    payload: &Json,
) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "INSERT INTO channel_messages (flow_id, channel, key, payload, published_at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![flow_id, channel, key, payload.to_string(), now],
    )
    .map_err(backend)?;
    wake_waiters(conn, flow_id, channel, key)
}

pub(super) fn read_map(
    conn: &Connection,
    flow_id: &str,
    name: &str,
    query: &MapQuery,
) -> Result<Vec<(String, Versioned)>, StoreError> {
    let order = if query.descending { "DESC" } else { "ASC" };
    let limit = if query.limit == 0 {
        i64::MAX
    } else {
        query.limit as i64
    };
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT key, value, version FROM attributes
             WHERE flow_id = ?1 AND name = ?2 AND (?3 IS NULL OR key > ?3) AND (?4 IS NULL OR key < ?4)
             ORDER BY key {order} LIMIT ?5"
        ))
        .map_err(backend)?;
    let rows = stmt
        .query_map(
            params![flow_id, name, query.after, query.before, limit],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                ))
            },
        )
        .map_err(backend)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(backend)?;
    rows.into_iter()
        .map(|(key, value, version)| {
            let value = parse_json(&format!("{name}/{key}"), &value)?;
            Ok((key, Versioned { value, version }))
        })
        .collect()
}

pub(super) fn channel_len(
    conn: &Connection,
    flow_id: &str,
    channel: &str,
    key: &str,
) -> Result<u64, StoreError> {
    cached_query_row(
        conn,
        "SELECT COUNT(*) FROM channel_messages WHERE flow_id = ?1 AND channel = ?2 AND key = ?3",
        params![flow_id, channel, key],
        |row| row.get::<_, i64>(0),
    )
    .map(|n| n as u64)
    .map_err(backend)
}

pub(super) fn expired_leases(
    conn: &Connection,
    now: StoreMillis,
    flow_types: &[String],
    limit: usize,
) -> Result<Vec<ExpiredLease>, StoreError> {
    let sql = format!(
        "SELECT task_id FROM tasks WHERE state = 'leased' AND lease_expires_ms <= ?
           AND flow_type IN ({}) ORDER BY lease_expires_ms LIMIT ?",
        in_list(flow_types.len())
    );
    let mut values: Vec<rusqlite::types::Value> = vec![now.into()];
    values.extend(
        flow_types
            .iter()
            .map(|t| rusqlite::types::Value::from(t.clone())),
    );
    values.push((limit as i64).into());
    let ids = {
        let mut stmt = conn.prepare(&sql).map_err(backend)?;
        let ids = stmt
            .query_map(params_from_iter(values), |row| row.get::<_, i64>(0))
            .map_err(backend)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(backend)?;
        ids
    };
    ids.into_iter()
        .map(|task_id| {
            let row = load_task(conn, task_id)?;
            Ok(ExpiredLease {
                task: row.task,
                output_recorded: row.output_recorded,
            })
        })
        .collect()
}

/// The state an RPC works on: one flow, inside one write transaction, or,
/// for a read-only RPC, one read transaction on a read connection, where
/// every write is refused instead of going through a connection that is not
/// the writer.
pub(super) struct SqliteStateTx<'c> {
    conn: &'c Connection,
    flow_id: String,
    now: StoreMillis,
    read_only: bool,
}

impl<'c> SqliteStateTx<'c> {
    pub(super) fn new(conn: &'c Connection, flow_id: String, now: StoreMillis) -> Self {
        Self {
            conn,
            flow_id,
            now,
            read_only: false,
        }
    }

    pub(super) fn read_only(conn: &'c Connection, flow_id: String, now: StoreMillis) -> Self {
        Self {
            read_only: true,
            ..Self::new(conn, flow_id, now)
        }
    }

    /// Refuses `what` in a read-only transaction.
    fn writable(&self, what: &str) -> Result<(), StoreError> {
        if self.read_only {
            return Err(StoreError::Backend(format!(
                "{what} on flow {} in a read-only transaction",
                self.flow_id
            )));
        }
        Ok(())
    }
}

impl StateTx for SqliteStateTx<'_> {
    fn now(&self) -> StoreMillis {
        self.now
    }

    fn flow(&mut self) -> Result<Option<FlowInfo>, StoreError> {
        flow_info(self.conn, &self.flow_id)
    }

    fn get(&mut self, name: &str, key: &str) -> Result<Option<Versioned>, StoreError> {
        get(self.conn, &self.flow_id, name, key)
    }

    fn set(&mut self, name: &str, key: &str, value: Json) -> Result<i64, StoreError> {
        self.writable(&format!("set {name}"))?;
        set(self.conn, &self.flow_id, name, key, &value)
    }

    fn delete(&mut self, name: &str, key: &str) -> Result<(), StoreError> {
        self.writable(&format!("delete {name}"))?;
        delete(self.conn, &self.flow_id, name, key)
    }

    fn lock(&mut self, name: &str) -> Result<(), RpcError> {
        if self.read_only {
            return Err(RpcError::Rejected(format!(
                "lock {name} on flow {} in a read-only transaction",
                self.flow_id
            )));
        }
        let held = exists(
            self.conn,
            "SELECT 1 FROM state_locks l JOIN tasks t ON t.task_id = l.task_id
             WHERE l.flow_id = ?1 AND l.name = ?2 AND t.state = 'leased' AND t.lease_expires_ms > ?3",
            params![self.flow_id, name, self.now],
        )?;
        if held {
            return Err(RpcError::LockConflict {
                flow_id: self.flow_id.clone(),
                name: name.to_string(),
            });
        }
        Ok(())
    }

    fn publish(&mut self, channel: &str, key: &str, payload: Json) -> Result<(), StoreError> {
        self.writable(&format!("publish to {channel}"))?;
        publish(self.conn, self.now, &self.flow_id, channel, key, &payload)
    }

    fn channel_len(&mut self, channel: &str, key: &str) -> Result<u64, StoreError> {
        channel_len(self.conn, &self.flow_id, channel, key)
    }

    fn read_map(
        &mut self,
        name: &str,
        query: &MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        read_map(self.conn, &self.flow_id, name, query)
    }
}
