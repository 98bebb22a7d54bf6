//! A worker's slots: how many Steps it runs at once. The claim loop and the
//! commits that lease a flow's next Steps both take from them, so the two
//! together never run more than the worker's limit. Slots are held by
//! [`Taken`] guards and go back when those drop, on every path, a panic's
//! unwinding included.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The worker's slots, shared by its claim loop and its running Steps.
pub(super) struct Slots {
    max: usize,
    used: AtomicUsize,
    /// Told when slots are given back, so a full worker's loop claims again.
    freed: Notify,
}

impl Slots {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            used: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Takes up to `want` free slots.
    pub(super) fn take(self: &Arc<Self>, want: usize) -> Taken {
        let mut taken = 0;
        // The closure reruns when another taker moved `used` meanwhile.
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                taken = want.min(self.max.saturating_sub(used));
                Some(used + taken)
            });
        Taken {
            slots: self.clone(),
            n: taken,
        }
    }

    fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        let before = self.used.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(before >= n, "gave back {n} slots of {before} taken");
        self.freed.notify_one();
    }

    /// Resolves once slots were given back since the last time it resolved.
    pub(super) async fn freed(&self) {
        self.freed.notified().await
    }

    /// How many slots are taken now.
    #[cfg(test)]
    pub(super) fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// Slots taken and not yet given back: they go back when this drops.
#[must_use = "the slots go back as soon as this drops"]
pub(super) struct Taken {
    slots: Arc<Slots>,
    n: usize,
}

impl Taken {
    /// How many slots this holds.
    pub(super) fn len(&self) -> usize {
        self.n
    }

    /// One of these slots, for one Step; `None` when none is left.
    pub(super) fn split_one(&mut self) -> Option<Taken> {
        if self.n == 0 {
            return None;
        }
        self.n -= 1;
        Some(Taken {
            slots: self.slots.clone(),
            n: 1,
        })
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.slots.give_back(self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_never_taken_past_the_limit_and_come_back_when_dropped() {
        let slots = Slots::new(4);
        let mut three = slots.take(3);
        assert_eq!(three.len(), 3);
        let one = slots.take(3);
        assert_eq!(one.len(), 1, "only one of four was left");
        assert_eq!(slots.take(1).len(), 0);
        let split = three.split_one();
        assert_eq!(split.as_ref().map(Taken::len), Some(1));
        assert_eq!((three.len(), slots.used()), (2, 4));
        drop(three);
        assert_eq!(slots.used(), 2);
        drop((one, split));
        assert_eq!(slots.used(), 0);
    }

    #[test]
    fn a_slot_held_across_a_panic_comes_back() {
        let slots = Slots::new(2);
        let held = slots.take(2);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = held;
            panic!("a Step panicked");
        }));
        assert!(unwound.is_err());
        assert_eq!(slots.used(), 0);
    }

    #[test]
    fn slots_taken_from_many_threads_at_once_never_exceed_the_limit() {
        let slots = Slots::new(16);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let slots = slots.clone();
                std::thread::spawn(move || {
                    let mut most = 0;
                    for _ in 0..10_000 {
                        let taken = slots.take(3);
                        most = most.max(slots.used());
                        drop(taken);
                    }
                    most
                })
            })
            .collect();
        for thread in threads {
            let most = thread.join().unwrap_or_else(|_| panic!("a taker panicked"));
            assert!(most <= 16, "{most} slots were taken at once, over 16");
        }
        assert_eq!(slots.used(), 0);
    }
}
