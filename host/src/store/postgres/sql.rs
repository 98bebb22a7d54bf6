//! Helpers every PostgreSQL file shares: error conversion, statements
//! through the connection's cache, pipelines, and retrying a transaction
//! that lost a deadlock or a serialization check.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use deadpool_postgres::GenericClient;
use futures_util::future::{maybe_done, poll_fn, try_join_all};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::flow::StoreError;

/// The parameters of a statement.
pub(super) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

impl From<tokio_postgres::Error> for StoreError {
    fn from(err: tokio_postgres::Error) -> Self {
        // The server's message is the useful part; the Display of a
        // `DbError` is only "db error".
        match err.as_db_error() {
            Some(db) => StoreError::Backend(format!(
                "PostgreSQL: {} ({})",
                db.message(),
                db.code().code()
            )),
            None => StoreError::Backend(format!("PostgreSQL: {}", chain(&err))),
        }
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    fn from(err: deadpool_postgres::PoolError) -> Self {
        StoreError::Backend(format!("PostgreSQL is unavailable: {}", chain(&err)))
    }
}

/// An error with every source it carries ("error performing TLS handshake:
/// invalid peer certificate: UnknownIssuer"), since the cause is what an
/// operator needs and the outer message rarely says it.
pub(super) fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

/// Whether a failed transaction may simply run again: it was chosen as a
/// deadlock's victim, failed a serialization check or waited out
/// `lock_timeout`, and rolled back.
pub(super) fn retryable(err: &tokio_postgres::Error) -> bool {
    matches!(
        err.code(),
        Some(code) if *code == SqlState::T_R_DEADLOCK_DETECTED
            || *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::LOCK_NOT_AVAILABLE
    )
}

/// An error that says whether its transaction may run again.
pub(super) trait MaybeRetry {
    fn may_retry(&self) -> bool;
}

/// A store error carrying the PostgreSQL error it came from, so that the
/// retry loop can tell a deadlock from a refusal.
pub(super) enum TxError<E> {
    Db(tokio_postgres::Error),
    Pool(deadpool_postgres::PoolError),
    Other(E),
}

impl<E> From<tokio_postgres::Error> for TxError<E> {
    fn from(err: tokio_postgres::Error) -> Self {
        TxError::Db(err)
    }
}

impl<E> From<deadpool_postgres::PoolError> for TxError<E> {
    fn from(err: deadpool_postgres::PoolError) -> Self {
        TxError::Pool(err)
    }
}

impl<E: From<StoreError>> From<StoreError> for TxError<E> {
    fn from(err: StoreError) -> Self {
        TxError::Other(E::from(err))
    }
}

/// What the SQL of one table family returns inside a transaction.
pub(super) type TxResult<T, E = StoreError> = Result<T, TxError<E>>;

impl<E> MaybeRetry for TxError<E> {
    fn may_retry(&self) -> bool {
        matches!(self, TxError::Db(err) if retryable(err))
    }
}

impl<E: From<StoreError>> TxError<E> {
    pub(super) fn into_error(self) -> E {
        match self {
            TxError::Db(err) => E::from(StoreError::from(err)),
            TxError::Pool(err) => E::from(StoreError::from(err)),
            TxError::Other(err) => err,
        }
    }
}

/// How often a transaction that lost a deadlock runs again.
const ATTEMPTS: u32 = 8;

/// Runs `attempt` until it succeeds, fails for a reason other than a
/// deadlock or a serialization failure, or has run [`ATTEMPTS`] times.
/// Every attempt is a whole transaction that rolled back, so running it
/// again is safe.
pub(super) async fn retrying<T, E, F, Fut>(mut attempt: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, TxError<E>>>,
    E: From<StoreError>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(err) if err.may_retry() && tries < ATTEMPTS => {
                // A short, growing pause lets the winner finish first.
                let pause = std::time::Duration::from_millis(u64::from(tries) * 2);
                tokio::time::sleep(pause).await;
            }
            Err(err) => return Err(err.into_error()),
        }
    }
}

/// Rows of a statement prepared through the connection's cache.
pub(super) async fn query<C: GenericClient>(
    client: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query(&statement, params).await
}

/// At most one row.
pub(super) async fn query_opt<C: GenericClient>(
    client: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<Option<Row>, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query_opt(&statement, params).await
}

/// Exactly one row.
pub(super) async fn query_one<C: GenericClient>(
    client: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<Row, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query_one(&statement, params).await
}

/// The number of rows a statement changed.
pub(super) async fn execute<C: GenericClient>(
    client: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<u64, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.execute(&statement, params).await
}

/// One statement of a [`pipeline`].
pub(super) struct Piped<'a> {
    pub sql: &'a str,
    pub params: Vec<&'a (dyn ToSql + Sync)>,
}

impl<'a> Piped<'a> {
    pub(super) fn new(sql: &'a str, params: Vec<&'a (dyn ToSql + Sync)>) -> Self {
        Piped { sql, params }
    }
}

/// Each statement's rows or error, in the order they ran.
pub(super) type PipedRows = Vec<Result<Vec<Row>, tokio_postgres::Error>>;

/// Runs `statements` in order, each sent without waiting for the answer to
/// the one before: one round trip for all of them instead of one each.
/// The server still runs them one after another, in this order.
///
/// Every statement's outcome comes back, in order. Inside a transaction a
/// failed statement aborts it and every later one fails too, so the caller
/// reads the outcomes in order and acts on the first it cannot accept
/// (which may be a row missing, not an error). Nothing is left in flight:
/// the answers are all read before this returns.
pub(super) async fn pipeline<C: GenericClient>(
    client: &C,
    statements: &[Piped<'_>],
) -> TxResult<PipedRows> {
    // Prepared first (a cache hit costs nothing): a statement prepared on
    // the way would be sent after the ones behind it that were cached.
    let prepared = try_join_all(
        statements
            .iter()
            .map(|piped| client.prepare_cached(piped.sql)),
    )
    .await?;
    // Each query is sent when first polled (tokio-postgres hands its
    // message to the connection before it first waits), so polling them in
    // order sends them in order. The conformance suite fails if they are
    // not (polled in reverse, four of its tests did: a waiter woken before
    // it is inserted, a claim before its task).
    let mut running: Vec<_> = statements
        .iter()
        .zip(&prepared)
        .map(|(piped, statement)| maybe_done(client.query(statement, &piped.params)))
        .collect();
    poll_fn(|cx| {
        let mut pending = false;
        for query in running.iter_mut() {
            pending |= Pin::new(query).poll(cx).is_pending();
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    running
        .iter_mut()
        .map(|query| Pin::new(query).take_output())
        .collect::<Option<PipedRows>>()
        .ok_or_else(|| StoreError::Backend("a pipelined statement gave no answer".into()).into())
}
