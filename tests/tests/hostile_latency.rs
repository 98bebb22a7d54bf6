//! A healthy session on the same worker as a stream of hostile sessions
//! (CPU spinners, memory bombs, event floods in tools and runners) keeps its
//! turn latency within twice its solo latency. Its own test binary, so that
//! no other test shares the machine while it measures.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dexa::session::AgentSessionClient;
use dexa_tests::hostile::{first_turn, stack, Peers};
use dexa_tests::measure::{healthy_turns, p50};

/// Median latency of `turns` healthy turns in session `id`.
async fn healthy_turn_latency(sessions: &AgentSessionClient, id: &str, turns: u64) -> Duration {
    p50(&healthy_turns(sessions, id, turns).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_session_on_the_same_worker_stays_within_twice_its_solo_latency() {
    let peers = Peers::start();
    let stack = stack(&peers, "");
    // Fast turns finish inline; slow ones (model latency) move to the guest
    // pool, where the spinning attacks run too.
    let fast = stack.sessions("Healthy");
    let slow = stack.sessions("HealthySlow");
    let (attacks, spinner) = (stack.sessions("Attacks"), stack.sessions("Spinner"));
    // Warm the worker's instance pool and the store first.
    healthy_turn_latency(&fast, "warm", 2).await;
    let fast_solo = healthy_turn_latency(&fast, "fast-solo", 7).await;
    let slow_solo = healthy_turn_latency(&slow, "slow-solo", 5).await;

    // Keep a mix of attacks running the whole time: CPU spinners, memory
    // bombs and event floods in both tools and runners.
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    for (lane, message) in [
        "tool spin {}",
        "spin",
        "tool memory_bomb {}",
        "memory-bomb",
        "tool event_flood {}",
    ]
    .into_iter()
    .enumerate()
    {
        // The spins need the agent whose deadline stops them.
        let attacks = if message.contains("spin") {
            &spinner
        } else {
            &attacks
        }
        .clone();
        let stop = stop.clone();
        attackers.push(tokio::spawn(async move {
            let mut round = 0;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                first_turn(&attacks, &format!("lane{lane}-{round}"), message).await;
            }
            round
        }));
    }
    // Let the attacks get going before measuring.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fast_attacked = healthy_turn_latency(&fast, "fast-attacked", 7).await;
    let slow_attacked = healthy_turn_latency(&slow, "slow-attacked", 5).await;
    stop.store(true, Ordering::Relaxed);
    let mut rounds = 0;
    for attacker in attackers {
        rounds += attacker.await.expect("attacker");
    }
    for (name, solo, attacked) in [
        ("fast", fast_solo, fast_attacked),
        ("slow", slow_solo, slow_attacked),
    ] {
        println!(
            "{name} healthy turn p50: solo {solo:?}, beside {rounds} attack sessions {attacked:?} ({:.2}x)",
            attacked.as_secs_f64() / solo.as_secs_f64()
        );
    }
    for (name, solo, attacked) in [
        ("fast", fast_solo, fast_attacked),
        ("slow", slow_solo, slow_attacked),
    ] {
        assert!(
            attacked <= solo * 2,
            "a {name} healthy turn took {attacked:?} beside attacks, over twice its solo {solo:?}"
        );
    }
}
