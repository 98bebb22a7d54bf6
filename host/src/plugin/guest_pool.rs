//! Guest code runs on threads of its own, at a lower CPU priority than the
//! host. A guest that burns CPU up to its deadline then competes with other
//! guests, not with the host's commits, lease renewals and heartbeats: those
//! keep their pace, so a busy worker does not lose its leases (which would
//! run Steps twice), and a healthy session's own host work is not slowed.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

use super::error::CallError;

/// How much lower than the host guest threads run (a `nice` increment).
const GUEST_NICENESS: libc::c_int = 10;

/// One pool per process; never dropped, so no runtime is dropped inside
/// another's async context.
static POOL: OnceLock<Option<Runtime>> = OnceLock::new();

fn pool() -> Option<&'static Runtime> {
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        let built = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("dexa-guest")
            .enable_all()
            .on_thread_start(lower_this_threads_priority)
            .build();
        match built {
            Ok(runtime) => Some(runtime),
            Err(err) => {
                tracing::warn!(error = %err, "no guest thread pool; guests run on the host's threads");
                None
            }
        }
    })
    .as_ref()
}

fn lower_this_threads_priority() {
    // On Linux a thread has its own nice value; the thread id addresses it.
    // SAFETY: gettid and setpriority take no pointers and have no
    // preconditions; a failure only leaves the priority as it was.
    let result = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS as _, tid as libc::id_t, GUEST_NICENESS)
    };
    if result != 0 {
        tracing::debug!("cannot lower the priority of a guest thread");
    }
}

/// Stops the spawned call when the caller stops waiting for it (its Step
/// was cancelled); the call's own deadline bounds it otherwise.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs one guest call on the guest pool and waits for it.
pub(crate) async fn run<T, F>(component: &str, call: F) -> Result<T, CallError>
where
    F: Future<Output = Result<T, CallError>> + Send + 'static,
    T: Send + 'static,
{
    let handle = match pool() {
        Some(runtime) => runtime.handle().clone(),
        None => Handle::current(),
    };
    let mut task = AbortOnDrop(handle.spawn(call));
    match (&mut task.0).await {
        Ok(result) => result,
        Err(err) => Err(CallError::Instantiate {
            component: component.to_string(),
            reason: format!("the call's task ended abnormally: {err}"),
        }),
    }
}
