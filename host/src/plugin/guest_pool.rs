//! Long guest calls move to threads of their own, at a lower CPU priority
//! than the host. A guest that burns CPU up to its deadline then competes
//! with other long guests, not with the host's commits, lease renewals and
//! heartbeats: those keep their pace, so a busy worker does not lose its
//! leases (which would run Steps twice), and a healthy session's work is not
//! slowed. A call starts on the caller's thread and moves only once it has
//! run (or waited) past [`INLINE_BUDGET`], so the common short call pays no
//! thread hop.

use std::future::Future;
use std::sync::OnceLock;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::error::CallError;

/// How long a call runs on the caller's thread before it moves to the pool.
/// A spinning guest moves at its first epoch yield (every tick); a call that
/// waits on the host (the model) moves when it wakes, which costs nothing.
const INLINE_BUDGET: Duration = Duration::from_millis(2);

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

#[cfg(target_os = "linux")]
fn lower_this_threads_priority() {
    // On Linux a thread has its own nice value, addressed by its thread id.
    // setpriority sets an absolute value, so add to the current one.
    // SAFETY: gettid, getpriority and setpriority take no pointers and have
    // no preconditions; a failure leaves the priority as it was.
    let result = unsafe {
        let tid = libc::gettid() as libc::id_t;
        *libc::__errno_location() = 0;
        let current = libc::getpriority(libc::PRIO_PROCESS as _, tid);
        if current == -1 && *libc::__errno_location() != 0 {
            -1
        } else {
            let lowered = current.saturating_add(GUEST_NICENESS).min(19);
            libc::setpriority(libc::PRIO_PROCESS as _, tid, lowered)
        }
    };
    if result != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot lower the CPU priority of a guest thread; long guest calls compete with the host"
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_this_threads_priority() {
    tracing::warn!("guest threads keep the host's CPU priority on this platform");
}

/// Stops the spawned call when the caller stops waiting for it (its Step
/// was cancelled); the call's own deadline bounds it otherwise.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs one guest call: on the caller's thread while it is short, then on
/// the guest pool.
pub(crate) async fn run<T, F>(component: &str, call: F) -> Result<T, CallError>
where
    F: Future<Output = Result<T, CallError>> + Send + 'static,
    T: Send + 'static,
{
    let started = Instant::now();
    let mut call = Box::pin(call);
    let finished = std::future::poll_fn(|cx| match call.as_mut().poll(cx) {
        Poll::Ready(result) => Poll::Ready(Some(result)),
        Poll::Pending if started.elapsed() < INLINE_BUDGET => Poll::Pending,
        Poll::Pending => Poll::Ready(None),
    })
    .await;
    if let Some(result) = finished {
        return result;
    }
    let Some(runtime) = pool() else {
        return call.await;
    };
    let mut task = AbortOnDrop(runtime.handle().spawn(call));
    match (&mut task.0).await {
        Ok(result) => result,
        Err(err) => Err(CallError::Instantiate {
            component: component.to_string(),
            reason: format!("the call's task ended abnormally: {err}"),
        }),
    }
}
