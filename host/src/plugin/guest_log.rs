//! The guest's stdout and stderr: each kept up to a cap per call, the rest
//! dropped and counted. A guest that prints is never failed for it (a pipe
//! that refused past its cap made Rust's `eprintln!` panic the guest). When
//! the call ends the host hands what was kept to the session as `guest_log`
//! events and to its own log, tagged with the Step.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// How much a guest may hand over in one write; the pipe takes any amount.
const WRITE_PERMIT: usize = 64 << 10;

/// Which of the guest's outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    pub fn as_str(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

#[derive(Default)]
struct Kept {
    bytes: BytesMut,
    dropped: u64,
}

/// One of a call's output streams: keeps the first `cap` bytes.
#[derive(Clone)]
pub struct GuestLogPipe {
    cap: usize,
    kept: Arc<Mutex<Kept>>,
}

impl GuestLogPipe {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            kept: Arc::default(),
        }
    }

    fn take_in(&self, bytes: &[u8]) {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let room = self.cap.saturating_sub(kept.bytes.len());
        let keep = bytes.len().min(room);
        kept.bytes.extend_from_slice(&bytes[..keep]);
        let dropped = (bytes.len() - keep) as u64;
        kept.dropped = kept.dropped.saturating_add(dropped);
    }

    /// What was kept, as text (invalid UTF-8 replaced), and how many bytes
    /// were dropped past the cap.
    pub fn contents(&self) -> (String, u64) {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        (
            String::from_utf8_lossy(&kept.bytes).into_owned(),
            kept.dropped,
        )
    }
}

impl OutputStream for GuestLogPipe {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.take_in(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

#[async_trait::async_trait]
impl Pollable for GuestLogPipe {
    async fn ready(&mut self) {}
}

impl AsyncWrite for GuestLogPipe {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.take_in(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for GuestLogPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestLogPipe {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pipe_keeps_its_cap_and_counts_the_rest_without_refusing() {
        let mut pipe = GuestLogPipe::new(10);
        for _ in 0..1000 {
            assert_eq!(pipe.check_write().ok(), Some(WRITE_PERMIT));
            assert!(pipe.write(Bytes::from_static(b"hello ")).is_ok());
        }
        let (text, dropped) = pipe.contents();
        assert_eq!(text, "hello hell");
        assert_eq!(dropped, 6 * 1000 - 10);
    }

    #[test]
    fn bytes_that_are_not_utf8_are_kept_as_replacement_characters() {
        let mut pipe = GuestLogPipe::new(100);
        assert!(pipe.write(Bytes::from_static(b"a\xff\xfeb")).is_ok());
        assert_eq!(pipe.contents(), ("a\u{fffd}\u{fffd}b".to_string(), 0));
    }
}
