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
    flows: Mutex<HashMap<String, Weak<Notify>>>,
    /// How many wakes there were, of any flow: a waiter that read it before
    /// it could arm its signal knows it may have missed one.
    generation: AtomicU64,
}

impl StreamSignals {
    fn flows(&self) -> MutexGuard<'_, HashMap<String, Weak<Notify>>> {
        match self.flows.lock() {
            Ok(flows) => flows,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The signal of `flow_id`'s streams (shared by its readers).
    pub fn stream(&self, flow_id: &str) -> Arc<Notify> {
        let mut flows = self.flows();
        if let Some(signal) = flows.get(flow_id).and_then(Weak::upgrade) {
            return signal;
        }
        // Forget flows nobody reads any more before the map can grow.
        if flows.len() >= 64 && flows.len().is_power_of_two() {
            flows.retain(|_, signal| signal.strong_count() > 0);
        }
        let signal = Arc::new(Notify::new());
        flows.insert(flow_id.to_string(), Arc::downgrade(&signal));
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
        let signal = self.flows().get(flow_id).and_then(Weak::upgrade);
        if let Some(signal) = signal {
            signal.notify_waiters();
        }
    }

    /// Wakes every reader (a notification may have been missed).
    pub fn wake_all(&self) {
        self.bump();
        for (_, signal) in self.read() {
            signal.notify_waiters();
        }
    }

    /// The flows some reader waits on now, with their signals.
    pub fn read(&self) -> Vec<(String, Arc<Notify>)> {
        self.flows()
            .iter()
            .filter_map(|(flow_id, signal)| signal.upgrade().map(|s| (flow_id.clone(), s)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
