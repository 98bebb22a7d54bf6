//! A PostgreSQL cluster of a test's own (`scripts/test-postgres.sh`), for
//! tests that stop the server or change how it accepts connections, which
//! the cluster every other test shares must not see. Stopped when dropped.

use std::path::Path;
use std::process::Command;

use crate::repo_root;

/// A running cluster on 127.0.0.1 with its data under `target/`.
pub struct Cluster {
    dir: tempfile::TempDir,
    /// `postgres://dexa@127.0.0.1:PORT/dexa`.
    pub url: String,
}

fn script(action: &str, dir: &Path) -> String {
    let output = Command::new(repo_root().join("scripts/test-postgres.sh"))
        .arg(action)
        .arg(dir)
        .output()
        .unwrap_or_else(|err| panic!("test-postgres.sh {action}: {err}"));
    assert!(
        output.status.success(),
        "test-postgres.sh {action}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

impl Cluster {
    /// Starts a plain cluster.
    pub fn start() -> Self {
        Self::start_with("start")
    }

    /// Starts a cluster that accepts TLS connections only, with a server
    /// certificate for 127.0.0.1 from a test CA ([`Cluster::ca_cert`]).
    pub fn start_tls() -> Self {
        Self::start_with("start-tls")
    }

    fn start_with(action: &str) -> Self {
        // Under target/, not /tmp: the server runs as `postgres` when the
        // tests run as root, and must reach its data directory.
        let dir = tempfile::Builder::new()
            .prefix("pg-own-")
            .tempdir_in(repo_root().join("target"))
            .unwrap_or_else(|err| panic!("temp dir: {err}"));
        let url = script(action, dir.path());
        Self { dir, url }
    }

    /// The test CA's certificate (PEM) of a TLS cluster.
    pub fn ca_cert(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Stops the server, keeping its data and port.
    pub fn pause(&self) {
        script("pause", self.dir.path());
    }

    /// Starts it again after [`Cluster::pause`].
    pub fn resume(&self) {
        script("resume", self.dir.path());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("scripts/test-postgres.sh"))
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}
