//! Wake-ups across machines and the database's clock, on one connection of
//! their own.
//!
//! - Every commit that may make work ready sends `NOTIFY` on the store's
//!   channel (PostgreSQL coalesces them within a transaction and delivers
//!   them at commit). This connection `LISTEN`s and wakes the process's
//!   workers; notifications that arrive together wake them once.
//! - The store's clock is the database's: the connection reads
//!   `clock_timestamp()` every [`CLOCK_SYNC`], and between reads the time
//!   advances by this machine's monotonic clock, so workers whose wall
//!   clocks disagree still agree on every deadline, with no round trip per
//!   transaction.
//! - Appends to a flow's streams `NOTIFY` the events channel with the flow
//!   id; the listener wakes that flow's readers ([`Signals::streams`]), so an
//!   event stream on one machine sees a commit made on another at once. A
//!   take of a flow's tasks (the revoke channel) wakes them too, since a
//!   stop appends nothing.
//! - When the connection breaks (a restart, a failover) it reconnects with
//!   a growing pause, and wakes the workers once it is back, since a
//!   notification may have been missed meanwhile.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::{mpsc, Notify};
use tokio_postgres::AsyncMessage;

use super::url::PostgresUrl;
use crate::flow::{StoreError, StoreMillis};
use crate::store::stream_signals::StreamSignals;

/// How often the clock is read from the database.
pub const CLOCK_SYNC: Duration = Duration::from_secs(2);

/// A reading whose round trip took longer than twice this is not used.
const MAX_CLOCK_HALF_TRIP: Duration = Duration::from_millis(100);

/// The database's clock, carried forward by the local monotonic clock.
///
/// Each reading replaces the base, so an error never accumulates (a local
/// clock that runs fast, a failover to a server whose clock is behind);
/// what this process hands out still never goes backwards (`floor`), so a
/// task created "now" is never not yet due a moment later.
#[derive(Debug)]
pub struct DbClock {
    base: Mutex<(StoreMillis, Instant)>,
    floor: AtomicI64,
}

impl DbClock {
    fn new(db_ms: StoreMillis, at: Instant) -> Self {
        Self {
            base: Mutex::new((db_ms, at)),
            floor: AtomicI64::new(db_ms),
        }
    }

    /// The database's time now, in milliseconds since the epoch.
    pub fn now(&self) -> StoreMillis {
        let (db_ms, at) = match self.base.lock() {
            Ok(base) => *base,
            Err(poisoned) => *poisoned.into_inner(),
        };
        let estimate = db_ms + at.elapsed().as_millis() as i64;
        let floor = self.floor.fetch_max(estimate, Ordering::AcqRel);
        floor.max(estimate)
    }

    /// Takes a new reading as the base.
    fn set(&self, db_ms: StoreMillis, at: Instant) {
        let mut base = match self.base.lock() {
            Ok(base) => base,
            Err(poisoned) => poisoned.into_inner(),
        };
        *base = (db_ms, at);
    }
}

/// Whom the listener wakes, and on which channels.
#[derive(Debug)]
pub struct Signals {
    /// Commits that may make work ready.
    pub work_channel: String,
    /// Stream appends; the payload is the flow id.
    pub events_channel: String,
    /// Takes of a flow's tasks (a cancel, a stop); the payload is the flow
    /// id.
    pub revoke_channel: String,
    pub work: Arc<Notify>,
    /// One per flow some reader waits on; gone with its last reader.
    pub streams: StreamSignals,
    /// One per flow this process runs Steps of; gone with the last.
    pub revocations: StreamSignals,
}

impl Signals {
    /// The channels of the store in `schema`.
    pub fn for_schema(schema: &str) -> Self {
        Self {
            work_channel: format!("dexa_work_{schema}"),
            events_channel: format!("dexa_events_{schema}"),
            revoke_channel: format!("dexa_revoke_{schema}"),
            work: Arc::new(Notify::new()),
            streams: StreamSignals::default(),
            revocations: StreamSignals::default(),
        }
    }

    /// Wakes every waiter (a notification may have been missed).
    fn wake_all(&self) {
        self.work.notify_waiters();
        self.streams.wake_all();
        self.revocations.wake_all();
    }
}

/// A notification: work may be ready, a flow's stream grew, or a flow's
/// tasks were taken.
enum Note {
    Work,
    Stream(String),
    Revoked(String),
}

/// Reads the database's clock; the instant is the middle of the round trip.
async fn read_clock(client: &tokio_postgres::Client) -> Result<(StoreMillis, Instant), StoreError> {
    let sent = Instant::now();
    let row = client
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await?;
    let round_trip = sent.elapsed();
    Ok((row.get(0), sent + round_trip / 2))
}

/// The connection a listener runs on, with its notifications.
async fn connect(
    url: &PostgresUrl,
    signals: &Signals,
) -> Result<(tokio_postgres::Client, mpsc::UnboundedReceiver<Note>), StoreError> {
    let tls = url.tls().map_err(StoreError::Backend)?;
    let (client, mut connection) = url.config.connect(tls).await?;
    let (sender, notes) = mpsc::unbounded_channel();
    let work_channel = signals.work_channel.clone();
    let revoke_channel = signals.revoke_channel.clone();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(note)) => {
                    let note = if note.channel() == work_channel {
                        Note::Work
                    } else if note.channel() == revoke_channel {
                        Note::Revoked(note.payload().to_string())
                    } else {
                        Note::Stream(note.payload().to_string())
                    };
                    if sender.send(note).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(error = %err, "the PostgreSQL listener connection ended");
                    break;
                }
            }
        }
    });
    client
        .batch_execute(&format!(
            "LISTEN \"{}\"; LISTEN \"{}\"; LISTEN \"{}\"",
            signals.work_channel, signals.events_channel, signals.revoke_channel
        ))
        .await?;
    Ok((client, notes))
}

/// Starts the listener; returns the clock, read once before this returns.
pub async fn start(
    url: PostgresUrl,
    signals: Arc<Signals>,
) -> Result<(Arc<DbClock>, tokio::task::JoinHandle<()>), StoreError> {
    let (client, notes) = connect(&url, &signals).await?;
    let (db_ms, at) = read_clock(&client).await?;
    let clock = Arc::new(DbClock::new(db_ms, at));
    let task = tokio::spawn(run(url, signals, clock.clone(), client, notes));
    Ok((clock, task))
}

async fn run(
    url: PostgresUrl,
    signals: Arc<Signals>,
    clock: Arc<DbClock>,
    mut client: tokio_postgres::Client,
    mut notes: mpsc::UnboundedReceiver<Note>,
) {
    let mut sync = tokio::time::interval(CLOCK_SYNC);
    sync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Serve this connection until it breaks.
        loop {
            tokio::select! {
                note = notes.recv() => {
                    let Some(note) = note else {
                        break;
                    };
                    // Coalesce: whatever else arrived wakes each waiter once.
                    let mut work = false;
                    let mut flows = HashSet::new();
                    let mut revoked = HashSet::new();
                    let mut next = Some(note);
                    while let Some(note) = next {
                        match note {
                            Note::Work => work = true,
                            Note::Stream(flow_id) => {
                                flows.insert(flow_id);
                            }
                            Note::Revoked(flow_id) => {
                                revoked.insert(flow_id);
                            }
                        }
                        next = notes.try_recv().ok();
                    }
                    if work {
                        signals.work.notify_waiters();
                    }
                    for flow_id in flows {
                        signals.streams.wake(&flow_id);
                    }
                    // A take of a flow's tasks may be a stop, which appends
                    // nothing: its readers look again too.
                    for flow_id in revoked {
                        signals.revocations.wake(&flow_id);
                        signals.streams.wake_stopped(&flow_id);
                    }
                }
                // Bounded: a connection that went quiet (half-open TCP) is
                // replaced rather than waited on.
                _ = sync.tick() => match tokio::time::timeout(CLOCK_SYNC * 3, read_clock(&client)).await {
                    // A slow answer cannot say when the server read its
                    // clock (up to half the round trip off), and the floor
                    // would keep a reading that ran ahead: keep the last.
                    Ok(Ok((_, at))) if at.elapsed() > MAX_CLOCK_HALF_TRIP => {
                        tracing::debug!("a slow PostgreSQL clock reading was not used");
                    }
                    Ok(Ok((db_ms, at))) => clock.set(db_ms, at),
                    Ok(Err(err)) => {
                        tracing::debug!(error = %err, "cannot read the PostgreSQL clock");
                        if client.is_closed() {
                            break;
                        }
                    }
                    Err(_) => break,
                },
            }
        }
        let down = Instant::now();
        tracing::warn!("the PostgreSQL listener lost its connection; reconnecting");
        let mut pause = Duration::from_millis(100);
        loop {
            tokio::time::sleep(pause).await;
            match connect(&url, &signals).await {
                Ok((new_client, new_notes)) => {
                    client = new_client;
                    notes = new_notes;
                    break;
                }
                Err(err) => {
                    tracing::debug!(error = %err, "PostgreSQL is still unavailable");
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
        if let Ok((db_ms, at)) = read_clock(&client).await {
            clock.set(db_ms, at);
        }
        tracing::warn!(
            after_ms = down.elapsed().as_millis() as u64,
            "the PostgreSQL listener is back"
        );
        // A notification may have been sent while it was away.
        signals.wake_all();
    }
}

/// Sends `payload` on `channel` when the transaction commits (duplicates
/// within one transaction are sent once).
pub(super) async fn notify<C: deadpool_postgres::GenericClient>(
    tx: &C,
    channel: &str,
    payload: &str,
) -> super::sql::TxResult<()> {
    super::sql::execute(tx, "SELECT pg_notify($1, $2)", &[&channel, &payload]).await?;
    Ok(())
}
