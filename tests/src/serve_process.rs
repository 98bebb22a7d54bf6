//! `dexa serve` as a real process under a chosen open-file limit, and the
//! raw-socket clients the connection tests need: half-sent requests held
//! open (Slowloris) and one-shot HTTP/1.1 requests with a deadline.
//!
//! The server runs `$DEXA_BIN` (else `target/<profile>/dexa`, see
//! [`crate::kit::dexa_binary`]) on `127.0.0.1:0`, through `sh -c 'ulimit -n
//! N; exec dexa serve ...'`, and is killed when dropped or when the test
//! process dies.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

use crate::api_server::{helpdesk_config, TEST_TOKEN};
use crate::kit::dexa_binary;

/// A half-sent request: a request line and one header, never the blank
/// line that ends the head.
pub const HALF_SENT_REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: dexa\r\n";

/// A running `dexa serve` (agent `Helpdesk`, token [`TEST_TOKEN`]).
pub struct ServeProcess {
    /// Where it listens.
    pub address: SocketAddr,
    child: Child,
    stderr: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl ServeProcess {
    /// Starts `dexa serve` with at most `fd_limit` open files, the
    /// environment `env` added (settings go there, so that a binary that
    /// lacks them still starts) and `args` after `serve`; waits until it
    /// says where it listens. Panics, with what it printed, if it does not
    /// within 60 s.
    pub async fn start(fd_limit: u64, env: &[(&str, &str)], args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
        let config = helpdesk_config(dir.path(), &json!({"turns": []}));
        let stderr = dir.path().join("serve-stderr.txt");
        let stderr_file =
            std::fs::File::create(&stderr).unwrap_or_else(|err| panic!("stderr file: {err}"));
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg("ulimit -n \"$1\" && shift && exec \"$@\"")
            .arg("sh")
            .arg(fd_limit.to_string())
            .arg(dexa_binary())
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config)
            .args(args)
            .env("DEXA_API_TOKEN", TEST_TOKEN)
            .env_remove("DEXA_HEADER_TIMEOUT")
            .env_remove("DEXA_MAX_CONNECTIONS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr_file)
            .kill_on_drop(true);
        for (name, value) in env {
            command.env(name, value);
        }
        // SAFETY: prctl is async-signal-safe. The server dies with the test
        // process even if that is killed before it can drop this handle
        // (the setting survives the exec of sh into dexa).
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", dexa_binary().display()));
        let started = Instant::now();
        let address = loop {
            let printed = std::fs::read_to_string(&stderr).unwrap_or_default();
            if let Some(address) = listening_address(&printed) {
                break address;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("dexa serve exited with {status} before listening; it printed:\n{printed}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "dexa serve did not listen within 60 s; it printed:\n{printed}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Self {
            address,
            child,
            stderr,
            _dir: dir,
        }
    }

    /// What the server printed on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Sends SIGTERM and waits up to `deadline` for the process to exit.
    /// Returns how long it took, or `None` if it was still running (it is
    /// then killed).
    pub async fn terminate(mut self, deadline: Duration) -> Option<Duration> {
        let pid = self.child.id()?;
        let pid = libc::pid_t::try_from(pid).ok()?;
        // SAFETY: kill takes no pointers; the pid is our own child, not yet
        // reaped (we hold its handle).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let started = Instant::now();
        match tokio::time::timeout(deadline, self.child.wait()).await {
            Ok(_) => Some(started.elapsed()),
            Err(_) => None,
        }
    }
}

/// The address in `dexa serve: http://127.0.0.1:PORT (...`.
fn listening_address(printed: &str) -> Option<SocketAddr> {
    let rest = printed.split("dexa serve: http://").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// An HTTP/1.1 answer: the status and the body (or what came of the head).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// One request on a new connection (`Connection: close`), with `token` as
/// the bearer token if given; the whole exchange must end within
/// `deadline`. Errors say what went wrong.
pub async fn request(
    address: SocketAddr,
    path: &str,
    token: Option<&str>,
    deadline: Duration,
) -> Result<Answer, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(address)
            .await
            .map_err(|err| format!("connect: {err}"))?;
        let auth = token
            .map(|token| format!("Authorization: Bearer {token}\r\n"))
            .unwrap_or_default();
        let head = format!("GET {path} HTTP/1.1\r\nHost: dexa\r\n{auth}Connection: close\r\n\r\n");
        stream
            .write_all(head.as_bytes())
            .await
            .map_err(|err| format!("write: {err}"))?;
        let mut received = Vec::new();
        stream
            .read_to_end(&mut received)
            .await
            .map_err(|err| format!("read: {err}"))?;
        parse_answer(&received)
    };
    tokio::time::timeout(deadline, exchange)
        .await
        .map_err(|_| format!("no answer within {deadline:?}"))?
}

fn parse_answer(received: &[u8]) -> Result<Answer, String> {
    let text = String::from_utf8_lossy(received);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP/1.1 answer: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    Ok(Answer { status, body })
}

/// Requests `path` until it answers `200`, for up to `deadline`. Returns
/// how long that took, or the last failure.
pub async fn until_ok(
    address: SocketAddr,
    path: &str,
    token: Option<&str>,
    deadline: Duration,
) -> Result<Duration, String> {
    let started = Instant::now();
    let mut last = String::from("not tried");
    while started.elapsed() < deadline {
        let left = deadline.saturating_sub(started.elapsed());
        match request(address, path, token, left).await {
            Ok(answer) if answer.status == 200 => return Ok(started.elapsed()),
            Ok(answer) => last = format!("{} {}", answer.status, answer.body),
            Err(err) => last = err,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "{path} did not answer 200 within {deadline:?}; last: {last}"
    ))
}

/// Opens `count` connections to `address`, 64 at a time, each sending
/// [`HALF_SENT_REQUEST`] and nothing more. A connection that cannot be
/// made within `connect_deadline` (the server's listen queue is full) is
/// left out. Returns the open ones. (Opening hundreds at once overflows the
/// listen queue of a server on a busy machine, and a client can then
/// believe itself connected while the server never saw it.)
pub async fn half_open(
    address: SocketAddr,
    count: usize,
    connect_deadline: Duration,
) -> Vec<TcpStream> {
    const AT_ONCE: usize = 64;
    let mut open = Vec::with_capacity(count);
    let mut left = count;
    while left > 0 {
        let batch = left.min(AT_ONCE);
        left -= batch;
        let attempts: Vec<_> = (0..batch)
            .map(|_| {
                tokio::spawn(async move {
                    let connect = TcpStream::connect(address);
                    let mut stream = tokio::time::timeout(connect_deadline, connect)
                        .await
                        .ok()?
                        .ok()?;
                    stream.write_all(HALF_SENT_REQUEST).await.ok()?;
                    Some(stream)
                })
            })
            .collect();
        for attempt in attempts {
            if let Ok(Some(stream)) = attempt.await {
                open.push(stream);
            }
        }
    }
    open
}

/// Whether the server closed `stream` within `deadline`: a read sees the
/// end (after whatever answer it wrote) or a reset. Any bytes it sent are
/// returned with `true`.
pub async fn closed_by_server(stream: &mut TcpStream, deadline: Duration) -> (bool, Vec<u8>) {
    let mut received = Vec::new();
    let outcome = tokio::time::timeout(deadline, stream.read_to_end(&mut received)).await;
    let closed = match outcome {
        Ok(Ok(_)) => true,
        Ok(Err(err)) => matches!(
            err.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        Err(_) => false,
    };
    (closed, received)
}

/// How many of `streams` the server still holds open: a read would wait,
/// rather than see the end, a reset or an answer. Does not wait itself.
pub fn still_open(streams: &[TcpStream]) -> usize {
    let mut byte = [0u8; 1];
    streams
        .iter()
        .filter(|stream| {
            matches!(stream.try_read(&mut byte),
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count()
}

/// Raises this process's soft open-file limit to its hard limit, so that
/// a test can hold thousands of sockets; returns the limit in force.
pub fn raise_own_fd_limit() -> u64 {
    dexa::api::limits::raise_fd_limit().unwrap_or(0)
}
