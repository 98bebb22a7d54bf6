use clap::Parser;

/// mimalloc, not glibc's malloc: under load a turn allocates from several
/// runtime threads at once (JSON, SQL rows, HTTP bodies), and glibc's
/// arena locks and consolidation took about an eighth of the CPU in a
/// profile of the HTTP benchmark with 16 clients.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc v3's `mi_option_purge_delay` (its place in `mi_option_t`; the
/// Rust bindings' named constants are v2's). Cargo.lock pins the sources.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory goes back to the system at once, not after mimalloc's
/// default second: a guest may make the host hold a request of tens of
/// MiB (a model request, a tool's output), and a worker must not keep one
/// resident while the next one arrives. Only a default:
/// `MIMALLOC_PURGE_DELAY` (milliseconds) still sets it.
fn purge_freed_memory_at_once() {
    // SAFETY: sets one option's default value; any option index and value
    // is accepted (an index out of range is ignored).
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, 0) };
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    purge_freed_memory_at_once();
    let cli = dexa::cli::Cli::parse();
    let format = cli.log_format;
    format.install();
    match dexa::cli::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            match format {
                dexa::cli::LogFormat::Json => tracing::error!("{err:#}"),
                dexa::cli::LogFormat::Text => eprintln!("error: {err:#}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}
