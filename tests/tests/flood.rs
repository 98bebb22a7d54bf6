//! Floods of events that cost the guest nothing to send (empty deltas, empty
//! tool-call events) from a runner and a tool, for their whole deadline,
//! beside a healthy session on the same `dexa worker`: the worker's memory
//! stays bounded, no lease is lost, the healthy session stays within twice
//! its solo latency, and what the floods store is bounded by their budget.
//! Its own test binary, so that no other test shares the machine while it
//! measures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dexa_tests::hostile::{first_turn, render, Peers, WORKER_ENV};
use dexa_tests::kit::AgentTestStack;
use dexa_tests::measure::{healthy_turns, p50, rss_mib, PeakRss};

/// The most resident memory the flooded worker may reach. The worker idles
/// at about 60 MiB; before events were counted by what they store, an 8 s
/// flood of empty deltas took `dexa serve` to 1.5 GiB.
const WORKER_RSS_BOUND_MIB: u64 = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_byte_event_floods_cost_their_budget_not_the_worker() {
    let peers = Peers::start();
    // The default event budget (not the hostile suite's 64 KiB), so that the
    // floods run with what an operator gets out of the box.
    let mut stack = AgentTestStack::with_config(|dir| {
        render(dir, &peers, "").replace(r#", events_per_call = "64KiB""#, "")
    });
    stack.start_worker_with_env(&[], &WORKER_ENV);
    let pid = stack.worker(0).pid();
    let healthy = stack.sessions("Healthy");
    // The floods never end by themselves: the agent whose 1 s deadline
    // stops them.
    let attacks = stack.sessions("Spinner");
    healthy_turns(&healthy, "warm", 2).await;
    let solo = healthy_turns(&healthy, "solo", 9).await;
    let idle_rss = rss_mib(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let mut floods = Vec::new();
    for (lane, message) in ["empty-flood", "tool empty_flood {}", "empty-flood"]
        .into_iter()
        .enumerate()
    {
        let (attacks, stop) = (attacks.clone(), stop.clone());
        floods.push(tokio::spawn(async move {
            let mut sessions = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let id = format!("flood{lane}-{}", sessions.len());
                first_turn(&attacks, &id, message).await;
                sessions.push(id);
            }
            sessions
        }));
    }
    let rss = PeakRss::start(pid);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let flooded = healthy_turns(&healthy, "flooded", 9).await;
    stop.store(true, Ordering::Relaxed);
    let peak = rss.stop().await;
    let mut flood_sessions = Vec::new();
    for flood in floods {
        flood_sessions.extend(flood.await.expect("flood lane"));
    }

    // What the floods stored: each session's whole event stream.
    let mut most_rows = 0;
    for id in &flood_sessions {
        let mut after = 0;
        let mut rows = 0;
        loop {
            let (events, next) = attacks.read_events(id, after, 1000).await.expect("events");
            if events.is_empty() {
                break;
            }
            rows += events.len();
            after = events.last().map_or(next, |(seq, _)| *seq);
        }
        most_rows = most_rows.max(rows);
    }
    println!(
        "healthy turn p50/worst: solo {:?}/{:?}, beside {} flood sessions {:?}/{:?}; \
         worker RSS idle {idle_rss} MiB, peak {peak} MiB; most rows one flood session stored: {most_rows}",
        p50(&solo),
        solo[solo.len() - 1],
        flood_sessions.len(),
        p50(&flooded),
        flooded[flooded.len() - 1],
    );
    assert!(!flood_sessions.is_empty(), "the floods ran");
    assert!(
        peak <= WORKER_RSS_BOUND_MIB,
        "the flooded worker reached {peak} MiB, over {WORKER_RSS_BOUND_MIB} MiB"
    );
    assert!(
        p50(&flooded) <= p50(&solo) * 2,
        "a healthy turn took {:?} beside the floods, over twice its solo {:?}",
        p50(&flooded),
        p50(&solo)
    );
    let log = stack.worker_log(0);
    assert!(
        !log.contains("lease lost") && !log.contains("renewing leases failed"),
        "the worker lost a lease under the flood:\n{log}"
    );
    // Each flooding call may store at most its budget (1 MiB by default) at
    // 128 bytes an event, and a turn makes at most three attempts plus the
    // host's own events.
    let per_call = (1 << 20) / 128;
    assert!(
        most_rows <= 3 * per_call + 64,
        "one flood session stored {most_rows} events, over three calls' budgets"
    );
}
