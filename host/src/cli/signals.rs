//! The process's stop signals (SIGTERM, SIGINT), counted from the moment
//! the command starts listening: the first asks for an orderly stop (a
//! drain), the second for an immediate one. One listener for the whole
//! process, so that no signal falls between two listeners' lifetimes.

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// The count of stop signals received so far.
#[derive(Clone)]
pub struct Signals(watch::Receiver<u32>);

impl Signals {
    /// Starts counting: every SIGTERM or SIGINT from now on counts.
    pub fn listen() -> anyhow::Result<Self> {
        // Registered here, before this returns: a signal that comes while
        // the caller is still starting up is not lost.
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let (count, counted) = watch::channel(0u32);
        tokio::spawn(async move {
            loop {
                let received = tokio::select! {
                    got = terminate.recv() => got,
                    got = interrupt.recv() => got,
                };
                if received.is_none() {
                    break;
                }
                count.send_modify(|n| *n = n.saturating_add(1));
            }
        });
        Ok(Self(counted))
    }

    /// Resolves once `n` signals in all have been received.
    pub async fn received(&self, n: u32) {
        let mut counted = self.0.clone();
        // A closed channel (the listener gone) never resolves: no signal
        // can be counted any more.
        if counted.wait_for(|count| *count >= n).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
