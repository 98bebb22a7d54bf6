//! Attributes and channels on PostgreSQL. Writes run under the flow's lock
//! (see `tasks.rs`).

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, query_one, query_opt, TxResult};
use crate::flow::types::{ChannelMessage, Json, MapQuery, StateWrite, StoreMillis, Versioned};
use crate::store::rows::parse_json;

pub(super) async fn channel_messages<C: GenericClient>(
    client: &C,
    flow_id: &str,
    channel: &str,
    key: &str,
    limit: u32,
) -> TxResult<Vec<ChannelMessage>> {
    let rows = query(
        client,
        "SELECT message_id, payload FROM channel_messages
         WHERE flow_id = $1 AND channel = $2 AND key = $3 ORDER BY message_id LIMIT $4",
        &[&flow_id, &channel, &key, &i64::from(limit)],
    )
    .await?;
    let mut messages = Vec::with_capacity(rows.len());
    for row in rows {
        let payload: String = row.get(1);
        messages.push(ChannelMessage {
            message_id: row.get(0),
            channel: channel.to_string(),
            key: key.to_string(),
            payload: parse_json("channel message", &payload)?,
        });
    }
    Ok(messages)
}

pub(super) async fn apply_write<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    write: &StateWrite,
) -> TxResult<()> {
    match write {
        StateWrite::Set { name, key, value } => {
            set(tx, flow_id, name, key, value).await?;
        }
        StateWrite::Delete { name, key } => delete(tx, flow_id, name, key).await?,
        StateWrite::Clear { name } => {
            execute(
                tx,
                "DELETE FROM attributes WHERE flow_id = $1 AND name = $2",
                &[&flow_id, name],
            )
            .await?;
        }
        StateWrite::Publish {
            channel,
            key,
            payload,
        } => publish(tx, now, flow_id, channel, key, payload).await?,
        StateWrite::Append { stream, payload } => {
            super::streams::append_fitting(tx, now, flow_id, stream, std::slice::from_ref(payload))
                .await?;
        }
    }
    Ok(())
}

pub(super) async fn get<C: GenericClient>(
    client: &C,
    flow_id: &str,
    name: &str,
    key: &str,
) -> TxResult<Option<Versioned>> {
    let row = query_opt(
        client,
        "SELECT value, version FROM attributes WHERE flow_id = $1 AND name = $2 AND key = $3",
        &[&flow_id, &name, &key],
    )
    .await?;
    match row {
        Some(row) => {
            let value: String = row.get(0);
            Ok(Some(Versioned {
                value: parse_json(&format!("{name}/{key}"), &value)?,
                version: row.get(1),
            }))
        }
        None => Ok(None),
    }
}

pub(super) async fn set<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    name: &str,
    key: &str,
    value: &Json,
) -> TxResult<i64> {
    let text = value.to_string();
    let row = query_one(
        tx,
        "INSERT INTO attributes (flow_id, name, key, value, version) VALUES ($1, $2, $3, $4, 1)
         ON CONFLICT (flow_id, name, key)
            DO UPDATE SET value = excluded.value, version = attributes.version + 1
         RETURNING version",
        &[&flow_id, &name, &key, &text],
    )
    .await?;
    Ok(row.get(0))
}

pub(super) async fn delete<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    name: &str,
    key: &str,
) -> TxResult<()> {
    execute(
        tx,
        "DELETE FROM attributes WHERE flow_id = $1 AND name = $2 AND key = $3",
        &[&flow_id, &name, &key],
    )
    .await?;
    Ok(())
}

pub(super) async fn publish<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    channel: &str,
    key: &str,
    payload: &Json,
) -> TxResult<()> {
    let text = payload.to_string();
    execute(
        tx,
        "INSERT INTO channel_messages (flow_id, channel, key, payload, published_at_ms)
         VALUES ($1, $2, $3, $4, $5)",
        &[&flow_id, &channel, &key, &text, &now],
    )
    .await?;
    super::tasks::wake_waiters(tx, flow_id, channel, key).await
}

pub(super) async fn read_map<C: GenericClient>(
    client: &C,
    flow_id: &str,
    name: &str,
    query_spec: &MapQuery,
) -> TxResult<Vec<(String, Versioned)>> {
    let order = if query_spec.descending { "DESC" } else { "ASC" };
    let limit = if query_spec.limit == 0 {
        i64::MAX
    } else {
        query_spec.limit as i64
    };
    // Keys compare bytewise (the column's collation), as in SQLite. Only
    // the bounds given are in the statement, so that a generic plan still
    // seeks the index to them.
    let mut bounds = String::new();
    let mut values: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&flow_id, &name, &limit];
    if let Some(after) = &query_spec.after {
        values.push(after);
        bounds.push_str(&format!(" AND key > ${}", values.len()));
    }
    if let Some(before) = &query_spec.before {
        values.push(before);
        bounds.push_str(&format!(" AND key < ${}", values.len()));
    }
    // With a byte cap, a running sum over the rows in order (measured in
    // the server) keeps every row whose predecessors hold fewer bytes.
    let max_bytes = query_spec
        .max_bytes
        .map(|b| i64::try_from(b).unwrap_or(i64::MAX));
    let sql = match &max_bytes {
        None => format!(
            "SELECT key, value, version FROM attributes
             WHERE flow_id = $1 AND name = $2{bounds}
             ORDER BY key {order} LIMIT $3"
        ),
        Some(cap) => {
            values.push(cap);
            format!(
                "SELECT key, value, version FROM (
                   SELECT key, value, version,
                          SUM(octet_length(value)) OVER (ORDER BY key {order}
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_bytes
                   FROM attributes
                   WHERE flow_id = $1 AND name = $2{bounds}
                   ORDER BY key {order} LIMIT $3) AS page
                 WHERE before_bytes IS NULL OR before_bytes < ${}
                 ORDER BY key {order}",
                values.len()
            )
        }
    };
    let rows = query(client, &sql, &values).await?;
    let mut entries = Vec::with_capacity(rows.len());
    for row in rows {
        let key: String = row.get(0);
        let value: String = row.get(1);
        let value = parse_json(&format!("{name}/{key}"), &value)?;
        entries.push((
            key,
            Versioned {
                value,
                version: row.get(2),
            },
        ));
    }
    Ok(entries)
}

pub(super) async fn channel_len<C: GenericClient>(
    client: &C,
    flow_id: &str,
    channel: &str,
    key: &str,
) -> TxResult<u64> {
    let row = query_one(
        client,
        "SELECT COUNT(*) FROM channel_messages WHERE flow_id = $1 AND channel = $2 AND key = $3",
        &[&flow_id, &channel, &key],
    )
    .await?;
    Ok(row.get::<_, i64>(0) as u64)
}
