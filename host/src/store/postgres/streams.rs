//! Streams on PostgreSQL: capped, append-only logs read by cursor. An
//! append locks the stream's row, so sequence numbers commit in order and a
//! reader past seq N never misses an entry committed later below it.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, query_one, query_opt, TxResult};
use crate::flow::store::StoreError;
use crate::flow::types::{Json, StoreMillis, StreamEntry, StreamPage};
use crate::store::rows::{parse_json, stream_closed};
use crate::store::sqlite::DEFAULT_STREAM_CAPACITY;

/// The stream's `(next_seq, total_bytes, capacity)`, its row locked (and
/// created when new).
async fn lock_meta<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    stream: &str,
) -> TxResult<(i64, u64, u64)> {
    execute(
        tx,
        "INSERT INTO streams (flow_id, stream, next_seq, total_bytes, capacity_bytes)
         VALUES ($1, $2, 1, 0, $3) ON CONFLICT (flow_id, stream) DO NOTHING",
        &[&flow_id, &stream, &(DEFAULT_STREAM_CAPACITY as i64)],
    )
    .await?;
    let row = query_one(
        tx,
        "SELECT next_seq, total_bytes, capacity_bytes FROM streams
         WHERE flow_id = $1 AND stream = $2 FOR UPDATE",
        &[&flow_id, &stream],
    )
    .await?;
    Ok((
        row.get(0),
        row.get::<_, i64>(1) as u64,
        row.get::<_, i64>(2) as u64,
    ))
}

async fn save_meta<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    stream: &str,
    (next_seq, total, capacity): (i64, u64, u64),
) -> TxResult<()> {
    execute(
        tx,
        "UPDATE streams SET next_seq = $3, total_bytes = $4, capacity_bytes = $5
         WHERE flow_id = $1 AND stream = $2",
        &[
            &flow_id,
            &stream,
            &next_seq,
            &(total as i64),
            &(capacity as i64),
        ],
    )
    .await?;
    Ok(())
}

/// Drops the oldest entries until the stream fits its capacity.
async fn trim<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    stream: &str,
    total: &mut u64,
    capacity: u64,
) -> TxResult<()> {
    while *total > capacity {
        // Many small entries go in one statement: the oldest whose running
        // sum covers the excess.
        let excess = (*total - capacity) as i64;
        let rows = query(
            tx,
            "DELETE FROM stream_entries WHERE flow_id = $1 AND stream = $2 AND seq <= COALESCE(
               (SELECT MIN(seq) FROM (
                  SELECT seq, SUM(bytes) OVER (ORDER BY seq) AS running
                  FROM stream_entries WHERE flow_id = $1 AND stream = $2) AS r
                WHERE running >= $3::bigint),
               (SELECT MAX(seq) FROM stream_entries WHERE flow_id = $1 AND stream = $2))
             RETURNING bytes",
            &[&flow_id, &stream, &excess],
        )
        .await?;
        if rows.is_empty() {
            *total = 0;
            break;
        }
        let freed: i64 = rows.iter().map(|row| row.get::<_, i64>(0)).sum();
        *total = total.saturating_sub(freed as u64);
    }
    Ok(())
}

/// What an append does with an entry larger than the stream's capacity.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Oversized {
    Refuse,
    Drop,
}

/// Appends what fits, dropping an entry that can never fit with a warning
/// (a Step's commit, its "started" marker).
pub(super) async fn append_fitting<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
) -> TxResult<Vec<i64>> {
    append(tx, now, flow_id, stream, payloads, Oversized::Drop).await
}

/// Appends every entry, or refuses the write when one can never fit, or
/// when the flow no longer runs. The flow's row is share-locked, so a stop
/// commits before the check or after the append: a reader that saw the flow
/// end and then read the stream to its end has every entry there will be.
pub(super) async fn append_stream<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
) -> TxResult<Vec<i64>> {
    let status = query_opt(
        tx,
        "SELECT status FROM flows WHERE flow_id = $1 FOR SHARE",
        &[&flow_id],
    )
    .await?
    .map(|row| row.get::<_, String>(0));
    match status.as_deref() {
        Some("running") => {}
        Some(status) => Err(stream_closed(flow_id, status))?,
        None => Err(StoreError::NoSuchFlow {
            flow_id: flow_id.to_string(),
        })?,
    }
    append(tx, now, flow_id, stream, payloads, Oversized::Refuse).await
}

async fn append<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    stream: &str,
    payloads: &[Json],
    oversized: Oversized,
) -> TxResult<Vec<i64>> {
    let (mut next_seq, mut total, capacity) = lock_meta(tx, flow_id, stream).await?;
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
            ))
            .into());
        }
        execute(
            tx,
            "INSERT INTO stream_entries (flow_id, stream, seq, payload, bytes, at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[&flow_id, &stream, &next_seq, &text, &(bytes as i64), &now],
        )
        .await?;
        seqs.push(next_seq);
        next_seq += 1;
        total += bytes;
    }
    trim(tx, flow_id, stream, &mut total, capacity).await?;
    save_meta(tx, flow_id, stream, (next_seq, total, capacity)).await?;
    Ok(seqs)
}

pub(super) async fn set_stream_capacity<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    stream: &str,
    capacity: u64,
) -> TxResult<()> {
    let (next_seq, mut total, _) = lock_meta(tx, flow_id, stream).await?;
    trim(tx, flow_id, stream, &mut total, capacity).await?;
    save_meta(tx, flow_id, stream, (next_seq, total, capacity)).await
}

/// A page of a stream. Run in one transaction, so that the page and the
/// stream's bounds come from one snapshot.
pub(super) async fn read_stream<C: GenericClient>(
    client: &C,
    flow_id: &str,
    stream: &str,
    after_seq: i64,
    limit: usize,
) -> TxResult<StreamPage> {
    let bounds = query_one(
        client,
        "SELECT (SELECT next_seq FROM streams WHERE flow_id = $1 AND stream = $2),
                (SELECT MIN(seq) FROM stream_entries WHERE flow_id = $1 AND stream = $2)",
        &[&flow_id, &stream],
    )
    .await?;
    let next_seq: i64 = bounds.get::<_, Option<i64>>(0).unwrap_or(1);
    let first_seq: Option<i64> = bounds.get(1);
    let rows = query(
        client,
        "SELECT seq, payload, at_ms FROM stream_entries
         WHERE flow_id = $1 AND stream = $2 AND seq > $3 ORDER BY seq LIMIT $4",
        &[&flow_id, &stream, &after_seq, &(limit as i64)],
    )
    .await?;
    let mut entries = Vec::with_capacity(rows.len());
    for row in rows {
        let payload: String = row.get(1);
        entries.push(StreamEntry {
            seq: row.get(0),
            payload: parse_json("stream entry", &payload)?,
            at: row.get(2),
        });
    }
    Ok(StreamPage {
        entries,
        first_seq: first_seq.unwrap_or(next_seq),
        next_seq,
    })
}
