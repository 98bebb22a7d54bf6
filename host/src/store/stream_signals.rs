//! Per-flow signals, and waking them: one signal per flow that someone waits
//! on, shared by its waiters and gone with the last of them. Both backends
//! keep two sets per process: the readers of each flow's streams, and the
//! Steps running for each flow, woken when its tasks are taken (a cancel, a
//! stop). What wakes them differs (a commit of this process at once;
//! another process's through PostgreSQL's `NOTIFY` or SQLite's
//! `data_version`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tokio::sync::Notify;

/// Every flow's stream signal in this process.
#[derive(Debug, Default)]
pub struct StreamSignals {
    flows: Mutex<HashMap<String, FlowSignal>>,
    /// How many wakes there were, of any flow: a waiter that read it before
    /// it could arm its signal knows it may have missed one.
    generation: AtomicU64,
}

/// One flow's signal, and the highest head its commits in this process
/// reported.
#[derive(Debug)]
struct FlowSignal {
    signal: Weak<Notify>,
    /// The flow's head (a backend's own measure of its streams, which grows
    /// with every append): the highest that a commit of this process that
    /// appended to them saw inside its transaction, since the flow's entry
    /// was made; its readers were woken after that commit. A watch of
    /// other processes' commits that finds the head at exactly this value
    /// knows there is nothing else to wake for.
    local_head: Option<i64>,
    /// How many times the flow's tasks were taken (a stop, a cancel) since
    /// the entry was made, as its wakes reported: a stop appends nothing,
    /// so a reader that read appends after a wake learns from this that a
    /// wake it did not see alone may have been a stop.
    stops: u64,
}

impl StreamSignals {
    fn flows(&self) -> MutexGuard<'_, HashMap<String, FlowSignal>> {
        match self.flows.lock() {
            Ok(flows) => flows,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The signal of `flow_id`'s streams (shared by its readers).
    pub fn stream(&self, flow_id: &str) -> Arc<Notify> {
        let mut flows = self.flows();
        if let Some(flow) = flows.get_mut(flow_id) {
            if let Some(signal) = flow.signal.upgrade() {
                return signal;
            }
            // A reader that drops its signal between reads and takes it
            // again keeps the head its flow's last commit here reported:
            // a reader that arms after that commit's wake reads after it.
            let signal = Arc::new(Notify::new());
            flow.signal = Arc::downgrade(&signal);
            return signal;
        }
        // Forget flows nobody reads any more before the map can grow (not
        // on a reader's return, which would forget its flow's head).
        if flows.len() >= 64 && flows.len().is_power_of_two() {
            flows.retain(|_, flow| flow.signal.strong_count() > 0);
        }
        let signal = Arc::new(Notify::new());
        let flow = FlowSignal {
            signal: Arc::downgrade(&signal),
            local_head: None,
            stops: 0,
        };
        flows.insert(flow_id.to_string(), flow);
        signal
    }

    /// How many wakes there were so far, of any flow.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Counts a wake (see [`Self::generation`]).
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Wakes the readers of `flow_id`'s streams, if any.
    pub fn wake(&self, flow_id: &str) {
        self.bump();
        let signal = self
            .flows()
            .get(flow_id)
            .and_then(|flow| flow.signal.upgrade());
        if let Some(signal) = signal {
            signal.notify_waiters();
        }
    }

    /// Wakes the readers of `flow_id`'s streams after a commit of this
    /// process that appended to them and saw their head at `head` inside
    /// its transaction: a watch that then finds the same head need not
    /// wake them again (see [`Self::local_head`]).
    pub fn wake_committed(&self, flow_id: &str, head: i64) {
        self.bump();
        let signal = {
            let mut flows = self.flows();
            match flows.get_mut(flow_id) {
                Some(flow) => {
                    // Set before the wake, under the lock the watch reads
                    // it with. The highest head reported wins: commits may
                    // report out of order, and each head only grows.
                    flow.local_head = Some(flow.local_head.map_or(head, |seen| seen.max(head)));
                    flow.signal.upgrade()
                }
                None => None,
            }
        };
        if let Some(signal) = signal {
            signal.notify_waiters();
        }
    }

    /// Wakes the readers of `flow_id`'s streams because its tasks were
    /// taken (a stop, or a cancel), and counts it (see [`Self::stops`]).
    pub fn wake_stopped(&self, flow_id: &str) {
        self.bump();
        let signal = {
            let mut flows = self.flows();
            match flows.get_mut(flow_id) {
                Some(flow) => {
                    flow.stops = flow.stops.wrapping_add(1);
                    flow.signal.upgrade()
                }
                None => None,
            }
        };
        if let Some(signal) = signal {
            signal.notify_waiters();
        }
    }

    /// How many [`Self::wake_stopped`] wakes `flow_id`'s readers had since
    /// its entry was made. Two wakes that come together (an append and a
    /// stop seen in one look of a watch) reach a reader as one; a reader
    /// that compares this before and after its read knows to look at the
    /// flow's status even though the read found appends.
    pub fn stops(&self, flow_id: &str) -> u64 {
        self.flows().get(flow_id).map_or(0, |flow| flow.stops)
    }

    /// The highest head an appending commit of this process reported for
    /// `flow_id` ([`Self::wake_committed`]) since its entry was made (by
    /// its first reader; an entry lives until pruned with no reader).
    ///
    /// A head only grows, so a head read later that equals it holds no
    /// commit after that one: every commit it holds came before, and the
    /// readers woken after that commit read them all.
    pub fn local_head(&self, flow_id: &str) -> Option<i64> {
        self.flows().get(flow_id).and_then(|flow| flow.local_head)
    }

    /// Wakes every reader (a notification may have been missed, a stop's
    /// too: each counts one, see [`Self::stops`]).
    pub fn wake_all(&self) {
        self.bump();
        let signals: Vec<Arc<Notify>> = self
            .flows()
            .values_mut()
            .filter_map(|flow| {
                let signal = flow.signal.upgrade()?;
                flow.stops = flow.stops.wrapping_add(1);
                Some(signal)
            })
            .collect();
        for signal in signals {
            signal.notify_waiters();
        }
    }

    /// The flows some reader waits on now, with their signals.
    pub fn read(&self) -> Vec<(String, Arc<Notify>)> {
        self.flows()
            .iter()
            .filter_map(|(flow_id, flow)| flow.signal.upgrade().map(|s| (flow_id.clone(), s)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop's wake and a wake of every reader (after a lost notification,
    /// which may have been a stop's) count for the flows read; a plain wake
    /// does not.
    #[test]
    fn a_stop_and_a_wake_of_every_reader_count_a_plain_wake_does_not() {
        let signals = StreamSignals::default();
        let reader = signals.stream("a");
        assert_eq!(signals.stops("a"), 0);
        signals.wake("a");
        signals.wake_committed("a", 3);
        assert_eq!(signals.stops("a"), 0, "appends");
        signals.wake_stopped("a");
        assert_eq!(signals.stops("a"), 1, "a stop");
        signals.wake_all();
        assert_eq!(signals.stops("a"), 2, "a wake of every reader");
        signals.wake_stopped("nobody-reads");
        assert_eq!(signals.stops("nobody-reads"), 0);
        drop(reader);
    }

    #[test]
    fn a_flow_signal_is_shared_by_its_readers_and_gone_with_the_last() {
        let signals = StreamSignals::default();
        let first = signals.stream("a");
        let second = signals.stream("a");
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(signals.read().len(), 1);
        drop((first, second));
        assert!(signals.read().is_empty(), "no reader, no signal");
    }

    #[test]
    fn a_flow_keeps_the_highest_head_its_commits_reported_across_readers() {
        let signals = StreamSignals::default();
        signals.wake_committed("a", 3);
        assert_eq!(signals.local_head("a"), None, "nobody reads it");
        let reader = signals.stream("a");
        signals.wake_committed("a", 5);
        signals.wake_committed("a", 4);
        assert_eq!(
            signals.local_head("a"),
            Some(5),
            "a late report of an older head"
        );
        drop(reader);
        signals.wake_committed("a", 6);
        // 63 more flows, read: 64 entries, the size at which a new flow's
        // entry first prunes those nobody reads.
        let others: Vec<_> = (0..63).map(|n| signals.stream(&format!("b{n}"))).collect();
        let _again = signals.stream("a");
        assert_eq!(signals.local_head("a"), Some(6), "a reader that came back");
        drop(others);
    }
}
