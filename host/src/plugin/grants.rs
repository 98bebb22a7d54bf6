//! Capability grants of one component. A component with no grants sees no
//! files, no environment variables and no network; clocks and random numbers
//! are always available.
//!
//! Directory grants go through wasmtime-wasi's preopens, which resolve every
//! path with cap-std inside the granted directory: neither `..` nor a symlink
//! can leave it.

use std::path::PathBuf;

use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder};

/// Whether a granted directory may be changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirAccess {
    ReadOnly,
    ReadWrite,
}

/// A host directory, visible to the guest at `guest_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirGrant {
    pub host_path: PathBuf,
    pub guest_path: String,
    pub access: DirAccess,
}

/// Everything a component may reach beyond its own memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grants {
    pub dirs: Vec<DirGrant>,
    /// Environment variables, by explicit name and value.
    pub env: Vec<(String, String)>,
}

impl Grants {
    /// No capability at all.
    pub fn none() -> Self {
        Self::default()
    }

    /// Grants `host_path` at `guest_path`.
    pub fn dir(
        mut self,
        host_path: impl Into<PathBuf>,
        guest_path: impl Into<String>,
        access: DirAccess,
    ) -> Self {
        self.dirs.push(DirGrant {
            host_path: host_path.into(),
            guest_path: guest_path.into(),
            access,
        });
        self
    }

    /// Grants one environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Checks what can be checked before any call: directories exist and guest
    /// paths are absolute and distinct.
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for grant in &self.dirs {
            if !grant.guest_path.starts_with('/') {
                return Err(format!(
                    "guest path {:?} must be absolute",
                    grant.guest_path
                ));
            }
            if !seen.insert(grant.guest_path.as_str()) {
                return Err(format!(
                    "guest path {:?} is granted twice",
                    grant.guest_path
                ));
            }
            if !grant.host_path.is_dir() {
                return Err(format!(
                    "host directory {} does not exist",
                    grant.host_path.display()
                ));
            }
        }
        for (name, _) in &self.env {
            if name.is_empty() || name.contains('=') {
                return Err(format!("environment variable name {name:?} is invalid"));
            }
        }
        Ok(())
    }

    /// A fresh WASI context holding exactly these grants.
    pub(crate) fn wasi_ctx(&self, stderr: MemoryOutputPipe) -> anyhow::Result<WasiCtx> {
        let mut builder = WasiCtxBuilder::new();
        builder.stderr(stderr);
        for grant in &self.dirs {
            let perms = match grant.access {
                DirAccess::ReadOnly => FsPerms::ReadOnly,
                DirAccess::ReadWrite => FsPerms::ReadWrite,
            };
            builder
                .preopened_dir(&grant.host_path, &grant.guest_path, perms)
                .map_err(|err| {
                    anyhow::anyhow!(
                        "cannot open granted directory {}: {err}",
                        grant.host_path.display()
                    )
                })?;
        }
        for (name, value) in &self.env {
            builder.env(name, value);
        }
        Ok(builder.build())
    }
}
