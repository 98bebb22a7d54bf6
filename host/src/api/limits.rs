//! How many connections `dexa serve` keeps open, and for how long a client
//! may take to send a request's headers: the guard against slow clients
//! (Slowloris) that would otherwise hold every file descriptor the process
//! has, so that nothing, `/healthz` included, could connect.
//!
//! The numbers are sized from the process's open-file limit, which
//! [`raise_fd_limit`] first raises to its hard limit.

use std::time::Duration;

/// The default `--header-timeout`: a request's headers must all arrive
/// within this long of the connection opening or of the previous response
/// (an idle keep-alive connection waits at most this long for its next
/// request). Long enough for a slow mobile link, short enough that a pool
/// of half-sent requests drains quickly.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The shortest `--header-timeout` accepted: below it, healthy clients on a
/// busy machine would be cut off.
pub const MIN_HEADER_TIMEOUT: Duration = Duration::from_millis(100);
/// The longest `--header-timeout` accepted: longer only helps an attacker.
pub const MAX_HEADER_TIMEOUT: Duration = Duration::from_secs(300);
/// Connections kept beyond `--max-connections` for health checks: on them
/// only `GET /healthz` is answered (anything else gets a 503 `overloaded`),
/// one request per connection, with [`RESERVE_HEADER_TIMEOUT`]; when they
/// are all taken, a new connection closes the oldest.
pub const HEALTH_RESERVE: usize = 32;
/// The header timeout on a health-check connection (or the header timeout,
/// if that is shorter): a health checker sends its request at once, so an
/// attacker's connection leaves the reserve quickly.
pub const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest write-stall timeout (see
/// [`ConnectionLimits::write_stall_timeout`]), whatever the header timeout:
/// an event stream's client may pause reading briefly.
pub const MIN_WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The default `--max-connections` is at most this many, whatever the
/// open-file limit: each connection costs a task and up to
/// [`MAX_HEADER_BYTES`] of buffer.
pub const MAX_DEFAULT_CONNECTIONS: usize = 4096;
/// The largest request head (request line and headers) accepted; a larger
/// one gets 431. It bounds the memory an attacker's half-sent requests hold.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The soft open-file limit [`raise_fd_limit`] aims for (never above the
/// hard limit): far more than [`MAX_DEFAULT_CONNECTIONS`] needs.
const FD_LIMIT_TARGET: u64 = 65_536;

/// The limits the HTTP server enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// See [`DEFAULT_HEADER_TIMEOUT`].
    pub header_timeout: Duration,
    /// Connections served the whole API at once; more go to the
    /// health-check reserve, where a new one pushes out the oldest.
    pub max_connections: usize,
    /// See [`HEALTH_RESERVE`].
    pub health_reserve: usize,
}

impl ConnectionLimits {
    /// The limits for a process allowed `fd_limit` open files:
    /// `header_timeout` (default [`DEFAULT_HEADER_TIMEOUT`]) and
    /// `max_connections` (default: what [`fd_headroom`] leaves of the limit
    /// after the reserve, at most [`MAX_DEFAULT_CONNECTIONS`]). Errors say
    /// which value is wrong and what would do.
    pub fn new(
        header_timeout: Option<Duration>,
        max_connections: Option<usize>,
        fd_limit: u64,
    ) -> anyhow::Result<Self> {
        let header_timeout = header_timeout.unwrap_or(DEFAULT_HEADER_TIMEOUT);
        anyhow::ensure!(
            (MIN_HEADER_TIMEOUT..=MAX_HEADER_TIMEOUT).contains(&header_timeout),
            "--header-timeout {} is out of range: it must be from {} to {}",
            humantime::format_duration(header_timeout),
            humantime::format_duration(MIN_HEADER_TIMEOUT),
            humantime::format_duration(MAX_HEADER_TIMEOUT),
        );
        let fd_limit = usize::try_from(fd_limit).unwrap_or(usize::MAX);
        let headroom = fd_headroom(fd_limit);
        // Connections the limit leaves room for, after the store's and the
        // worker's files and the health-check reserve.
        let room = fd_limit
            .saturating_sub(headroom)
            .saturating_sub(HEALTH_RESERVE);
        let max_connections = match max_connections {
            Some(0) => anyhow::bail!("--max-connections must be at least 1"),
            Some(wanted) => {
                anyhow::ensure!(
                    wanted <= room,
                    "--max-connections {wanted} does not fit the open-file limit of {fd_limit}: \
                     with {HEALTH_RESERVE} more for health checks and {headroom} kept for the \
                     store and the worker, at most {room} fit; raise the limit (ulimit -n, \
                     LimitNOFILE=) or ask for fewer"
                );
                wanted
            }
            None => {
                anyhow::ensure!(
                    room >= 1,
                    "the open-file limit of {fd_limit} leaves no room for connections \
                     ({headroom} are kept for the store and the worker and {HEALTH_RESERVE} \
                     for health checks); raise it (ulimit -n, LimitNOFILE=)"
                );
                room.min(MAX_DEFAULT_CONNECTIONS)
            }
        };
        Ok(Self {
            header_timeout,
            max_connections,
            health_reserve: HEALTH_RESERVE,
        })
    }

    /// How long a response may wait on a client that reads none of it
    /// (a write that cannot proceed because the client's window and the
    /// socket's buffer are full): the header timeout, at least
    /// [`MIN_WRITE_STALL_TIMEOUT`]. Without it, a client that pipelines
    /// requests for a public page and never reads would hold its connection
    /// for ever; any progress starts the wait again.
    pub fn write_stall_timeout(&self) -> Duration {
        self.header_timeout.max(MIN_WRITE_STALL_TIMEOUT)
    }

    /// The header timeout on a health-check reserve connection.
    pub fn reserve_header_timeout(&self) -> Duration {
        self.header_timeout.min(RESERVE_HEADER_TIMEOUT)
    }
}

/// Open files kept for everything but HTTP connections (the SQLite store
/// and its WAL, the component cache, the files and sockets tools are
/// granted): a quarter of the limit, at least 128.
pub fn fd_headroom(fd_limit: usize) -> usize {
    (fd_limit / 4).max(128)
}

/// Raises the soft open-file limit toward the hard limit (to at most
/// 65,536) and returns the soft limit now in force. Many systems start
/// processes at a soft limit of 1,024 with a far higher hard limit; the
/// connection cap is sized from the result. A failure to raise leaves the
/// limit as it was and is not an error.
pub fn raise_fd_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given, which
    // lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let current = limit.rlim_cur;
    let wanted = limit.rlim_max.min(FD_LIMIT_TARGET);
    if current >= wanted {
        return Ok(current);
    }
    let raised = libc::rlimit {
        rlim_cur: wanted,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit only reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot raise the open-file limit from {current}"
        );
        return Ok(current);
    }
    Ok(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(
        timeout: Option<Duration>,
        cap: Option<usize>,
        fds: u64,
    ) -> Result<ConnectionLimits, String> {
        ConnectionLimits::new(timeout, cap, fds).map_err(|err| err.to_string())
    }

    #[test]
    fn the_default_cap_leaves_room_for_the_store_the_worker_and_health_checks() {
        let at_1024 = limits(None, None, 1024).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(at_1024.header_timeout, DEFAULT_HEADER_TIMEOUT);
        assert_eq!(at_1024.max_connections, 1024 - 256 - HEALTH_RESERVE);
        assert_eq!(at_1024.health_reserve, HEALTH_RESERVE);
        assert_eq!(at_1024.write_stall_timeout(), MIN_WRITE_STALL_TIMEOUT);
        let at_256 = limits(None, None, 256).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(at_256.max_connections, 256 - 128 - HEALTH_RESERVE);
        let huge = limits(None, None, 1 << 20).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(huge.max_connections, MAX_DEFAULT_CONNECTIONS);
        let explicit = limits(Some(Duration::from_secs(3)), Some(10), 256)
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(explicit.max_connections, 10);
        assert_eq!(explicit.header_timeout, Duration::from_secs(3));
        assert_eq!(explicit.reserve_header_timeout(), RESERVE_HEADER_TIMEOUT);
        let long =
            limits(Some(Duration::from_secs(60)), None, 1024).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(long.write_stall_timeout(), Duration::from_secs(60));
        let short = limits(Some(Duration::from_millis(500)), None, 1024)
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(short.reserve_header_timeout(), Duration::from_millis(500));
    }

    #[test]
    fn bad_values_are_refused_with_what_would_do() {
        let zero = limits(None, Some(0), 1024).unwrap_err();
        assert!(zero.contains("at least 1"), "{zero}");
        let too_many = limits(None, Some(1000), 1024).unwrap_err();
        assert!(
            too_many.contains("at most 736 fit") && too_many.contains("ulimit -n"),
            "{too_many}"
        );
        let no_room = limits(None, None, 100).unwrap_err();
        assert!(no_room.contains("leaves no room"), "{no_room}");
        for timeout in [
            Duration::ZERO,
            Duration::from_millis(99),
            Duration::from_secs(301),
        ] {
            let refused = limits(Some(timeout), None, 1024).unwrap_err();
            assert!(refused.contains("out of range"), "{refused}");
        }
    }

    #[test]
    fn the_soft_fd_limit_is_raised_toward_the_hard_limit() {
        let now = raise_fd_limit().unwrap_or_else(|err| panic!("{err}"));
        assert!(now >= 1, "{now}");
        // A second call finds it raised already.
        assert_eq!(raise_fd_limit().unwrap_or_else(|err| panic!("{err}")), now);
    }
}
