//! The `attributes` and `channel_messages` tables: a flow's named maps
//! (get, set, delete, read in key order) and its channels (publish, count,
//! read, and waking the tasks that wait on a channel), the writes a Step
//! commits, and the snapshot reads of a flow's state.

use rusqlite::{params, Connection, OptionalExtension};

use super::sql::{cached_execute, cached_query_row};
use super::streams;
use crate::flow::store::{StateAnswer, StateQuery, StoreError};
use crate::flow::types::{ChannelMessage, Json, MapQuery, StateWrite, StoreMillis, Versioned};
use crate::store::rows::parse_json;

/// Marks waiting tasks ready whose channel condition now holds.
///
/// Here rather than with the tasks: publishing calls it, and the tasks'
/// code calls into this file, not the other way round.
pub(super) fn wake_waiters(
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
    )?;
    Ok(())
}

pub(super) fn channel_messages(
    conn: &Connection,
    flow_id: &str,
    channel: &str,
    key: &str,
    limit: u32,
) -> Result<Vec<ChannelMessage>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT message_id, payload FROM channel_messages
         WHERE flow_id = ?1 AND channel = ?2 AND key = ?3 ORDER BY message_id LIMIT ?4",
    )?;
    let rows = stmt
        .query_map(params![flow_id, channel, key, limit], |row| {
            Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?))
        })?
        .collect::<Result<Vec<_>, _>>()?;
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
            )?;
        }
        StateWrite::Publish {
            channel,
            key,
            payload,
        } => publish(conn, now, flow_id, channel, key, payload)?,
        StateWrite::Append { stream, payload } => {
            streams::append_fitting(conn, now, flow_id, stream, std::slice::from_ref(payload))?;
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
    .optional()?;
    row.map(|(value, version)| {
        Ok(Versioned {
            value: parse_json(&format!("{name}/{key}"), &value)?,
            version,
        })
    })
    .transpose()
}

pub(super) fn set(
    conn: &Connection,
    flow_id: &str,
    name: &str,
    key: &str,
    value: &Json,
) -> Result<i64, StoreError> {
    Ok(cached_query_row(conn,
        "INSERT INTO attributes (flow_id, name, key, value, version) VALUES (?1, ?2, ?3, ?4, 1)
         ON CONFLICT (flow_id, name, key) DO UPDATE SET value = excluded.value, version = version + 1
         RETURNING version",
        params![flow_id, name, key, value.to_string()],
        |row| row.get(0),
    )?)
}

pub(super) fn delete(
    conn: &Connection,
    flow_id: &str,
    name: &str,
    key: &str,
) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "DELETE FROM attributes WHERE flow_id = ?1 AND name = ?2 AND key = ?3",
        params![flow_id, name, key],
    )?;
    Ok(())
}

pub(super) fn publish(
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
    )?;
    wake_waiters(conn, flow_id, channel, key)
}

/// Whether `flow_id`'s maps `names` hold at most `rows` keys and `bytes`
/// bytes of keys and values between them: what a commit that clears them
/// deletes (see `small.rs`). Visits at most `rows` keys in all, plus one a
/// map, whatever the maps hold. `attributes` is a WITHOUT ROWID table, so
/// each row visited is read whole, a large value included (and the row
/// next to an empty map's place): the read costs what reading those rows
/// costs. The maps a turn clears are ones its RunModel just read whole on
/// its own runtime thread, so this is a like cost, not a stall of a new
/// kind.
pub(super) fn maps_fit(
    conn: &Connection,
    flow_id: &str,
    names: &[String],
    rows: usize,
    bytes: usize,
) -> Result<bool, StoreError> {
    let (mut rows_left, mut bytes_left) = (rows, bytes);
    let mut stmt = conn.prepare_cached(
        "SELECT octet_length(key) + octet_length(value) FROM attributes
         WHERE flow_id = ?1 AND name = ?2 LIMIT ?3",
    )?;
    for name in names {
        let limit = i64::try_from(rows_left.saturating_add(1)).unwrap_or(i64::MAX);
        let mut sizes = stmt.query(params![flow_id, name, limit])?;
        while let Some(row) = sizes.next()? {
            let size = usize::try_from(row.get::<_, i64>(0)?).unwrap_or(usize::MAX);
            let (Some(rows), Some(bytes)) =
                (rows_left.checked_sub(1), bytes_left.checked_sub(size))
            else {
                return Ok(false);
            };
            (rows_left, bytes_left) = (rows, bytes);
        }
    }
    Ok(true)
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
    // Only the bounds given are in the statement: `(?3 IS NULL OR key > ?3)`
    // would keep SQLite from seeking the index to the bound, and a page at
    // the end of a 10,000-message history would scan all of it.
    let mut bounds = String::new();
    let mut values: Vec<&dyn rusqlite::ToSql> = vec![&flow_id, &name, &limit];
    if let Some(after) = &query.after {
        values.push(after);
        bounds.push_str(&format!(" AND key > ?{}", values.len()));
    }
    if let Some(before) = &query.before {
        values.push(before);
        bounds.push_str(&format!(" AND key < ?{}", values.len()));
    }
    // With a byte cap, a running sum over the rows in order (SQLite
    // measures each value in place) keeps every row whose predecessors
    // hold fewer bytes than the cap.
    let max_bytes = query
        .max_bytes
        .map(|b| i64::try_from(b).unwrap_or(i64::MAX));
    let sql = match &max_bytes {
        None => format!(
            "SELECT key, value, version FROM attributes
             WHERE flow_id = ?1 AND name = ?2{bounds}
             ORDER BY key {order} LIMIT ?3"
        ),
        Some(cap) => {
            values.push(cap);
            format!(
                "SELECT key, value, version FROM (
                   SELECT key, value, version,
                          SUM(length(CAST(value AS BLOB))) OVER (ORDER BY key {order}
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before_bytes
                   FROM attributes
                   WHERE flow_id = ?1 AND name = ?2{bounds}
                   ORDER BY key {order} LIMIT ?3)
                 WHERE before_bytes IS NULL OR before_bytes < ?{}
                 ORDER BY key {order}",
                values.len()
            )
        }
    };
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt
        .query_map(values.as_slice(), |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, i64>(2)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
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
    let count = cached_query_row(
        conn,
        "SELECT COUNT(*) FROM channel_messages WHERE flow_id = ?1 AND channel = ?2 AND key = ?3",
        params![flow_id, channel, key],
        |row| row.get::<_, i64>(0),
    )?;
    Ok(count as u64)
}

/// Answers `queries` about one flow's state.
pub(super) fn read_state(
    conn: &Connection,
    flow_id: &str,
    queries: &[StateQuery],
) -> Result<Vec<StateAnswer>, StoreError> {
    // One transaction, so that every answer comes from one snapshot.
    let tx = conn.unchecked_transaction()?;
    let answers = queries
        .iter()
        .map(|query| match query {
            StateQuery::Get { name, key } => get(&tx, flow_id, name, key).map(StateAnswer::Value),
            StateQuery::Map { name, query } => {
                read_map(&tx, flow_id, name, query).map(StateAnswer::Entries)
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    tx.finish()?;
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Connection {
        let mut conn = Connection::open_in_memory().expect("in memory");
        super::super::schema::migrate(&mut conn).expect("schema");
        conn
    }

    fn put(conn: &Connection, flow: &str, name: &str, keys: usize, value: &str) {
        for n in 0..keys {
            set(
                conn,
                flow,
                name,
                &format!("k{n:03}"),
                &Json::String(value.to_string()),
            )
            .expect("set");
        }
    }

    /// What a clear deletes is counted over every map it clears, in rows
    /// and in bytes of keys and values, and only the flow's own rows.
    #[test]
    fn maps_fit_counts_the_rows_and_bytes_of_every_cleared_map() {
        let conn = store();
        put(&conn, "f", "calls", 3, "abc");
        put(&conn, "f", "asks", 2, "abc");
        put(&conn, "other", "calls", 50, "abc");
        let maps = ["calls".to_string(), "asks".to_string()];
        // Five keys of 4 bytes, five values of 5 (JSON quotes included).
        assert!(maps_fit(&conn, "f", &maps, 5, 45).expect("read"));
        assert!(!maps_fit(&conn, "f", &maps, 4, 45).expect("read"));
        assert!(!maps_fit(&conn, "f", &maps, 5, 44).expect("read"));
        assert!(maps_fit(&conn, "f", &["none".to_string()], 0, 0).expect("read"));
        // A huge map costs the read `rows + 1` keys, not all of them.
        put(&conn, "big", "calls", 500, "");
        assert!(!maps_fit(&conn, "big", &maps, 64, 1 << 20).expect("read"));
    }
}
