//! Stream readers are pushed to on the embedded store, not left to poll:
//! an append by this process wakes them at once, and one by another
//! process (here a second store handle on the same file, which has its own
//! writer connection, as another process would) wakes the readers of that
//! flow only, through the stream watch on `data_version`. Without the push
//! no reader is ever woken, and these tests time out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dexa::flow::FlowStore;
use dexa::store::sqlite::SqliteStore;
use dexa_tests::toy::create_running_flow;
use serde_json::json;
use tokio::sync::Notify;

/// Patience, not an expectation: the watch looks every 10 ms.
const PATIENCE: Duration = Duration::from_secs(5);

fn open(dir: &std::path::Path) -> Arc<dyn FlowStore> {
    Arc::new(
        SqliteStore::open(dir.join("store.sqlite"), Default::default())
            .unwrap_or_else(|err| panic!("{err}")),
    )
}

/// Waits for `signal`, armed before the append, at most `within`.
async fn woken(
    signal: &Notify,
    append: impl std::future::Future<Output = ()>,
    within: Duration,
) -> bool {
    let notified = signal.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    append.await;
    tokio::time::timeout(within, notified).await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_wakes_this_process_readers_of_that_flow_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    create_running_flow(store.as_ref(), "f").await;
    let signal = store
        .stream_signal("f")
        .expect("SQLite pushes stream appends");
    let started = Instant::now();
    let append = async {
        store
            .append_stream("f", "events", vec![json!({"n": 1})])
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    };
    assert!(
        woken(&signal, append, PATIENCE).await,
        "the reader was woken"
    );
    eprintln!("woken in-process after {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_append_wakes_the_readers_of_that_flow_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (writer, reader) = (open(dir.path()), open(dir.path()));
    create_running_flow(writer.as_ref(), "f").await;
    let f = reader
        .stream_signal("f")
        .expect("SQLite pushes stream appends");
    let g = reader
        .stream_signal("g")
        .expect("SQLite pushes stream appends");
    let append = |n: i64| {
        let writer = writer.clone();
        async move {
            writer
                .append_stream("f", "events", vec![json!({ "n": n })])
                .await
                .unwrap_or_else(|err| panic!("{err}"));
        }
    };

    let started = Instant::now();
    assert!(woken(&f, append(1), PATIENCE).await, "f's reader was woken");
    eprintln!("woken across store handles after {:?}", started.elapsed());
    // The first look may wake g too (its head was not known yet); from
    // then on only a flow whose streams grew is woken.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let g_woken = {
        let notified = g.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        assert!(woken(&f, append(2), PATIENCE).await, "f's reader again");
        tokio::time::timeout(Duration::from_millis(200), notified)
            .await
            .is_ok()
    };
    assert!(!g_woken, "g's streams did not grow: its reader sleeps on");
    // Ten appends in a row: the reader is woken each time it waits.
    for n in 3..13 {
        assert!(woken(&f, append(n), PATIENCE).await, "append {n}");
    }
}

/// An append whose caller went away once it was queued (a Step aborted at
/// its timeout while appending) still commits, and its readers are still
/// woken: by the stream watch, which sees this process's commits too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_whose_caller_went_away_still_wakes_its_readers() {
    use futures_util::FutureExt;

    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = Arc::new(
        SqliteStore::open(dir.path().join("store.sqlite"), Default::default())
            .unwrap_or_else(|err| panic!("{err}")),
    );
    let store: Arc<dyn FlowStore> = sqlite.clone();
    create_running_flow(store.as_ref(), "f").await;
    let signal = store
        .stream_signal("f")
        .expect("SQLite pushes stream appends");
    // The writer is held, so the append queued below cannot have been
    // answered by the time it is dropped: without the hold a fast writer
    // thread sometimes answered within the one poll.
    sqlite
        .hold_writer_for_test(Duration::from_millis(200))
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let started = Instant::now();
    // Polled once, which queues the write, then dropped before its answer:
    // the caller never gets to wake anyone.
    let pending = store
        .append_stream("f", "events", vec![json!({"n": 1})])
        .now_or_never();
    assert!(pending.is_none(), "the write was still on its way");
    // As an event stream reads: arm the signal, read, and wait for the
    // signal while the entry is not there. A wake before the commit (the
    // watch's first look) is harmless; no wake after it would leave the
    // reader asleep, and this loop would time out.
    loop {
        let notified = signal.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let page = store
            .read_stream("f", "events", 0, 10)
            .await
            .unwrap_or_else(|err| panic!("{err}"));
        if page.entries.len() == 1 {
            break;
        }
        assert!(
            tokio::time::timeout(PATIENCE, notified).await.is_ok(),
            "the reader was woken after the commit"
        );
    }
    eprintln!("woken after a dropped append in {:?}", started.elapsed());
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "the entry came after the held writer let go"
    );
}
