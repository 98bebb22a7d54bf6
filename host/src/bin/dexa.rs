use clap::Parser;

/// mimalloc, not glibc's malloc: under load a turn allocates from several
/// runtime threads at once (JSON, SQL rows, HTTP bodies), and glibc's
/// arena locks and consolidation took about an eighth of the CPU in a
/// profile of the HTTP benchmark with 16 clients.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay`: its place in mimalloc's `mi_option_t` (15 in
/// both v2 and the v3 sources libmimalloc-sys builds; the bindings name no
/// constant for it). `host/Cargo.toml` pins libmimalloc-sys's version.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long mimalloc keeps memory freed to it before returning it to the
/// system, in milliseconds: v2's default, not v3's second. A guest may
/// make the host hold a request of tens of MiB (a model request, a tool's
/// output); a worker must not keep one resident while the next arrives.
const PURGE_DELAY_MS: std::ffi::c_long = 10;

/// Sets the purge delay's default (`MIMALLOC_PURGE_DELAY` still sets it).
/// Called before any other thread starts: mimalloc's options are plain
/// values that its allocating threads read without synchronisation.
fn set_allocator_defaults() {
    // SAFETY: only this thread runs yet (see above); the call stores one
    // option's default, and mimalloc ignores an index out of range.
    unsafe { libmimalloc_sys::mi_option_set_default(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
}

fn main() -> std::process::ExitCode {
    set_allocator_defaults();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run()),
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> std::process::ExitCode {
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
