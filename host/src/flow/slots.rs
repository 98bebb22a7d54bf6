//! A worker's slots: how many Steps it runs at once. The claim loop and the
//! commits that lease a flow's next Steps both take from them, so the two
//! together never run more than the worker's limit.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// The worker's slots, shared by its claim loop and its running Steps.
pub(super) struct Slots {
    max: usize,
    used: AtomicUsize,
    /// Told when slots are given back, so a full worker's loop claims again.
    freed: Notify,
}

impl Slots {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            used: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    /// Takes up to `want` free slots; returns how many it took.
    pub(super) fn take(&self, want: usize) -> usize {
        let mut taken = 0;
        // A failed exchange means another taker moved `used`: look again.
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                taken = want.min(self.max.saturating_sub(used));
                Some(used + taken)
            });
        taken
    }

    /// Gives back `n` slots taken before.
    pub(super) fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            });
        self.freed.notify_one();
    }

    /// Takes the slots a commit's next Steps need besides the committing
    /// Step's own, which passes to the first of them: up to `share - 1`.
    pub(super) fn for_commit(&self, share: usize) -> CommitShare {
        if share == 0 {
            return CommitShare::none();
        }
        let extra = self.take(share - 1);
        CommitShare {
            max: 1 + extra,
            extra,
        }
    }

    /// Gives back the slots `share` took that the commit's `leased` next
    /// Steps do not run in. The first runs in the committing Step's slot;
    /// when none was leased, that slot goes back when the Step's run ends.
    pub(super) fn settle(&self, share: CommitShare, leased: usize) {
        self.give_back(share.extra.saturating_sub(leased.saturating_sub(1)));
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

/// The slots a commit took for the flow's next Steps it may lease.
#[must_use = "settle the share once the commit returns"]
pub(super) struct CommitShare {
    /// The most next Steps the commit may lease: the committing Step's own
    /// slot and the extra ones.
    max: usize,
    /// Slots taken besides the committing Step's own.
    extra: usize,
}

impl CommitShare {
    /// A commit that leases nothing.
    pub(super) fn none() -> Self {
        Self { max: 0, extra: 0 }
    }

    /// The most next Steps the commit may lease.
    pub(super) fn max(&self) -> usize {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_never_taken_past_the_limit_and_come_back_when_given() {
        let slots = Slots::new(4);
        assert_eq!(slots.take(3), 3);
        assert_eq!(slots.take(3), 1, "only one of four was left");
        assert_eq!(slots.take(1), 0);
        slots.give_back(2);
        assert_eq!(slots.used(), 2);
        assert_eq!(slots.take(8), 2);
        slots.give_back(4);
        assert_eq!(slots.used(), 0);
    }

    #[test]
    fn a_commit_takes_its_share_from_the_free_slots_and_gives_back_what_it_did_not_lease() {
        let slots = Slots::new(8);
        assert_eq!(slots.take(1), 1, "the committing Step's own slot");
        let share = slots.for_commit(4);
        assert_eq!(share.max(), 4);
        assert_eq!(slots.used(), 4);
        // Two leased: the first in the Step's slot, the second in one extra.
        slots.settle(share, 2);
        assert_eq!(slots.used(), 2);

        // Nothing leased (or no commit): every extra slot goes back; the
        // Step's own goes back when its run ends.
        let share = slots.for_commit(4);
        slots.settle(share, 0);
        assert_eq!(slots.used(), 2);
    }

    #[test]
    fn a_commit_on_a_full_worker_may_lease_only_into_its_own_slot() {
        let slots = Slots::new(8);
        assert_eq!(slots.take(8), 8);
        let share = slots.for_commit(4);
        assert_eq!(share.max(), 1, "no slot is free beside the Step's own");
        slots.settle(share, 1);
        assert_eq!(slots.used(), 8);

        slots.give_back(1);
        let share = slots.for_commit(4);
        assert_eq!(share.max(), 2, "one free slot beside the Step's own");
        slots.settle(share, 2);
        assert_eq!(slots.used(), 8);
        assert_eq!(CommitShare::none().max(), 0);
    }

    #[test]
    fn slots_taken_from_many_threads_at_once_never_exceed_the_limit() {
        let slots = std::sync::Arc::new(Slots::new(16));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let slots = slots.clone();
                std::thread::spawn(move || {
                    let mut most = 0;
                    for _ in 0..10_000 {
                        let got = slots.take(3);
                        most = most.max(slots.used());
                        slots.give_back(got);
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
