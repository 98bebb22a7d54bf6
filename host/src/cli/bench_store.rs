//! The store a benchmark runs on: `--store sqlite` (a temporary file, the
//! default) or `--store postgres://...` (a fresh schema on that server,
//! dropped afterwards), so that one run can put both backends side by side.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::flow::FlowStore;
use crate::store::postgres::{PostgresStore, PostgresUrl};
use crate::store::sqlite::{SqliteOptions, SqliteStore, Synchronous};

/// One backend under test.
pub(crate) struct BenchStore {
    /// `sqlite` or `postgres`, for the report.
    pub label: &'static str,
    /// Where another handle (or another process) opens the same store.
    pub address: String,
    pub store: Arc<dyn FlowStore>,
    synchronous: Synchronous,
    postgres: Option<PostgresStore>,
    _temp: Option<tempfile::TempDir>,
}

impl BenchStore {
    /// Opens `spec` (`sqlite` or a `postgres://` address); a SQLite store
    /// goes in `dir` (else a temporary directory) as `file`.
    pub async fn open(
        spec: &str,
        synchronous: Synchronous,
        dir: Option<&Path>,
        file: &str,
    ) -> anyhow::Result<Self> {
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            anyhow::ensure!(
                !spec.contains("schema="),
                "--store {spec}: the benchmark makes (and drops) a schema of its own; leave schema= out"
            );
            let unique = format!(
                "dexa_bench_{}_{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis())
                    .unwrap_or(0)
            );
            let sep = if spec.contains('?') { '&' } else { '?' };
            let address = format!("{spec}{sep}schema={unique}");
            let url = PostgresUrl::parse(&address).map_err(anyhow::Error::msg)?;
            let store = PostgresStore::connect(url).await?;
            return Ok(Self {
                label: "postgres",
                address,
                store: Arc::new(store.clone()),
                synchronous,
                postgres: Some(store),
                _temp: None,
            });
        }
        anyhow::ensure!(
            spec == "sqlite",
            "--store {spec}: give sqlite or a postgres:// address"
        );
        let temp = tempfile::tempdir()?;
        let path: PathBuf = dir.unwrap_or(temp.path()).join(file);
        let store = SqliteStore::open(&path, SqliteOptions { synchronous })?;
        Ok(Self {
            label: "sqlite",
            address: path.display().to_string(),
            store: Arc::new(store),
            synchronous,
            postgres: None,
            _temp: Some(temp),
        })
    }

    /// A second handle on the same store: how another process reaches it.
    pub async fn another_handle(&self) -> anyhow::Result<Arc<dyn FlowStore>> {
        Ok(match &self.postgres {
            Some(_) => {
                let url = PostgresUrl::parse(&self.address).map_err(anyhow::Error::msg)?;
                Arc::new(PostgresStore::connect(url).await?)
            }
            None => Arc::new(SqliteStore::open(
                &self.address,
                SqliteOptions {
                    synchronous: self.synchronous,
                },
            )?),
        })
    }

    /// Drops what the run made on a server (a temporary file goes by
    /// itself).
    pub async fn finish(self) {
        if let Some(store) = &self.postgres {
            if let Err(err) = store.drop_schema().await {
                eprintln!("could not drop the benchmark's schema: {err}");
            }
        }
    }
}
