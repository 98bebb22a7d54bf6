//! Streams: capped, append-only logs of a flow (its live events), read by
//! cursor; the oldest entries are trimmed to the stream's capacity.

use rusqlite::{params, Connection, OptionalExtension};

use super::sql::{cached_execute, cached_query_row};
use super::DEFAULT_STREAM_CAPACITY;
use crate::flow::store::StoreError;
use crate::flow::types::{Json, StoreMillis, StreamEntry, StreamPage};
use crate::store::rows::{parse_json, stream_closed};

fn stream_meta(
    conn: &Connection,
    flow_id: &str,
    stream: &str,
) -> Result<(i64, u64, u64), StoreError> {
    let meta = cached_query_row(conn,
            "SELECT next_seq, total_bytes, capacity_bytes FROM streams WHERE flow_id = ?1 AND stream = ?2",
            params![flow_id, stream],
            |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)? as u64, row.get::<_, i64>(2)? as u64)),
        )
        .optional()?;
    Ok(meta.unwrap_or((1, 0, DEFAULT_STREAM_CAPACITY)))
}

fn save_stream_meta(
    conn: &Connection,
    flow_id: &str,
    stream: &str,
    meta: (i64, u64, u64),
) -> Result<(), StoreError> {
    cached_execute(conn,
        "INSERT INTO streams (flow_id, stream, next_seq, total_bytes, capacity_bytes) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (flow_id, stream) DO UPDATE SET next_seq = excluded.next_seq,
            total_bytes = excluded.total_bytes, capacity_bytes = excluded.capacity_bytes",
        params![flow_id, stream, meta.0, meta.1 as i64, meta.2 as i64],
    )?;
    Ok(())
}

/// Drops the oldest entries until the stream fits its capacity.
fn trim_stream(
    conn: &Connection,
    flow_id: &str,
    stream: &str,
    total: &mut u64,
    capacity: u64,
) -> Result<(), StoreError> {
    while *total > capacity {
        let oldest = cached_query_row(conn,
                "SELECT seq, bytes FROM stream_entries WHERE flow_id = ?1 AND stream = ?2 ORDER BY seq LIMIT 1",
                params![flow_id, stream],
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)? as u64)),
            )
            .optional()?;
        let Some((seq, bytes)) = oldest else {
            *total = 0;
            break;
        };
        cached_execute(
            conn,
            "DELETE FROM stream_entries WHERE flow_id = ?1 AND stream = ?2 AND seq = ?3",
            params![flow_id, stream, seq],
        )?;
        *total = total.saturating_sub(bytes);
    }
    Ok(())
}

/// What an append does with an entry larger than the stream's capacity.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Oversized {
    /// Refuses the whole write (an explicit append).
    Refuse,
    /// Drops the entry with a warning (a Step's commit, its "started" marker).
    Drop,
}

/// Appends what fits the stream, judged by the stream's own capacity (which
/// may be smaller than what the writer was configured with when the stream
/// was created): an entry that can never fit is dropped with a warning,
/// never a reason to refuse the write it rides in (a Step's commit, its
/// "started" marker), which would fail again on every retry.
pub(super) fn append_fitting(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
) -> Result<Vec<i64>, StoreError> {
    append(conn, now, flow_id, stream, payloads, Oversized::Drop)
}

/// Appends every entry, or refuses the write when one can never fit, or
/// when the flow no longer runs: a reader that saw the flow end and then
/// read the stream to its end has every entry there will be.
pub(super) fn append_stream(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
) -> Result<Vec<i64>, StoreError> {
    let status: Option<String> = cached_query_row(
        conn,
        "SELECT status FROM flows WHERE flow_id = ?1",
        params![flow_id],
        |row| row.get(0),
    )
    .optional()?;
    match status.as_deref() {
        Some("running") => {}
        Some(status) => return Err(stream_closed(flow_id, status)),
        None => {
            return Err(StoreError::NoSuchFlow {
                flow_id: flow_id.to_string(),
            })
        }
    }
    append(conn, now, flow_id, stream, payloads, Oversized::Refuse)
}

fn append(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
    oversized: Oversized,
) -> Result<Vec<i64>, StoreError> {
    let (mut next_seq, mut total, capacity) = stream_meta(conn, flow_id, stream)?;
    let mut seqs = Vec::with_capacity(payloads.len());
    for payload in payloads {
        let text = payload.to_string();
        let bytes = text.len() as u64;
        if bytes > capacity {
            if oversized == Oversized::Drop {
                tracing::warn!(
                    flow_id,
                    stream,
                    bytes,
                    capacity,
                    "dropping a stream entry larger than the stream's capacity"
                );
                continue;
            }
            return Err(StoreError::Conflict(format!(
                "a {bytes}-byte entry does not fit stream {stream} (capacity {capacity} bytes)"
            )));
        }
        cached_execute(conn,
            "INSERT INTO stream_entries (flow_id, stream, seq, payload, bytes, at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![flow_id, stream, next_seq, text, bytes as i64, now],
        )?;
        seqs.push(next_seq);
        next_seq += 1;
        total += bytes;
    }
    trim_stream(conn, flow_id, stream, &mut total, capacity)?;
    save_stream_meta(conn, flow_id, stream, (next_seq, total, capacity))?;
    Ok(seqs)
}

/// The flow's head: the sum of its streams' next sequence numbers, as the
/// stream watch reads it (`stream_watch::HEADS`). It grows with every
/// append to any of them and never shrinks (no stream row is deleted).
pub(super) fn flow_head(conn: &Connection, flow_id: &str) -> Result<i64, StoreError> {
    Ok(cached_query_row(
        conn,
        "SELECT COALESCE(SUM(next_seq), 0) FROM streams WHERE flow_id = ?1",
        params![flow_id],
        |row| row.get(0),
    )?)
}

pub(super) fn set_stream_capacity(
    conn: &Connection,
    flow_id: &str,
    stream: &str,
    capacity: u64,
) -> Result<(), StoreError> {
    let (next_seq, mut total, _) = stream_meta(conn, flow_id, stream)?;
    trim_stream(conn, flow_id, stream, &mut total, capacity)?;
    save_stream_meta(conn, flow_id, stream, (next_seq, total, capacity))
}

pub(super) fn read_stream(
    conn: &Connection,
    flow_id: &str,
    stream: &str,
    after_seq: i64,
    limit: usize,
) -> Result<StreamPage, StoreError> {
    let (next_seq, _, _) = stream_meta(conn, flow_id, stream)?;
    let first_seq: Option<i64> = cached_query_row(
        conn,
        "SELECT MIN(seq) FROM stream_entries WHERE flow_id = ?1 AND stream = ?2",
        params![flow_id, stream],
        |row| row.get(0),
    )?;
    let mut stmt = conn.prepare_cached(
        "SELECT seq, payload, at_ms FROM stream_entries
             WHERE flow_id = ?1 AND stream = ?2 AND seq > ?3 ORDER BY seq LIMIT ?4",
    )?;
    let rows = stmt
        .query_map(params![flow_id, stream, after_seq, limit as i64], |row| {
            Ok((
                row.get::<_, i64>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, i64>(2)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let entries = rows
        .into_iter()
        .map(|(seq, payload, at)| {
            Ok(StreamEntry {
                seq,
                payload: parse_json("stream entry", &payload)?,
                at,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(StreamPage {
        entries,
        first_seq: first_seq.unwrap_or(next_seq),
        next_seq,
    })
}
