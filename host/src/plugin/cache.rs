//! The compiled-artifact cache: compiling a component takes 100+ ms, loading
//! its cached machine code well under one.
//!
//! Entries are keyed by the component's SHA-256 and a digest of everything in
//! the engine that affects code generation (wasmtime's own compatibility hash
//! plus its version), so a changed engine never loads a stale artifact.
//!
//! The cache directory holds native code that the host maps as executable:
//! it must be writable only by the host's user.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// How a component came to be ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from the cache; nothing was compiled.
    Hit,
    /// Compiled now and written to the cache.
    Compiled,
    /// Compiled now; no cache is configured (or writing to it failed).
    CompiledUncached,
}

/// Feeds a `Hash` impl into SHA-256, giving a digest that is stable across
/// processes (unlike `DefaultHasher`).
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn finish(&self) -> u64 {
        let digest = self.0.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }
}

/// SHA-256 of `bytes`, as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

pub(crate) struct ArtifactCache {
    dir: PathBuf,
    engine_key: String,
}

impl ArtifactCache {
    pub(crate) fn open(dir: PathBuf, engine: &Engine) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&dir).map_err(|err| {
            anyhow::anyhow!("cannot create component cache {}: {err}", dir.display())
        })?;
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        env!("CARGO_PKG_VERSION").hash(&mut hasher);
        let engine_key = hex::encode(&hasher.0.finalize()[..8]);
        Ok(Self { dir, engine_key })
    }

    fn entry_path(&self, component_sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{component_sha256}-{}.cwasm", self.engine_key))
    }

    /// Loads the compiled component from the cache, or compiles and stores it.
    pub(crate) fn load_or_compile(
        &self,
        engine: &Engine,
        name: &str,
        sha256: &str,
        wasm: &[u8],
    ) -> Result<(Component, CacheOutcome), String> {
        let path = self.entry_path(sha256);
        if let Ok(artifact) = std::fs::read(&path) {
            // Read into memory rather than mapping the file: a mapped entry
            // that someone truncates would crash the host with SIGBUS.
            // SAFETY: the entry was written by `Component::serialize` of an
            // engine with the same compatibility key (it is in the file name),
            // and the cache directory is trusted (module docs).
            match unsafe { Component::deserialize(engine, &artifact) } {
                Ok(component) => return Ok((component, CacheOutcome::Hit)),
                Err(err) => tracing::warn!(
                    component = name,
                    path = %path.display(),
                    error = %err,
                    "cached component is unusable; recompiling"
                ),
            }
        }
        let component = compile(engine, name, wasm)?;
        match self.store(&path, &component) {
            Ok(()) => Ok((component, CacheOutcome::Compiled)),
            Err(err) => {
                tracing::warn!(
                    component = name,
                    path = %path.display(),
                    error = %err,
                    "cannot write the component cache; continuing without it"
                );
                Ok((component, CacheOutcome::CompiledUncached))
            }
        }
    }

    /// Writes atomically, so that concurrent workers never read half a file.
    fn store(&self, path: &Path, component: &Component) -> anyhow::Result<()> {
        let bytes = component.serialize().map_err(anyhow::Error::from)?;
        let mut file = tempfile::NamedTempFile::new_in(&self.dir)?;
        file.write_all(&bytes)?;
        file.as_file().sync_all()?;
        file.persist(path)?;
        Ok(())
    }
}

pub(crate) fn compile(engine: &Engine, name: &str, wasm: &[u8]) -> Result<Component, String> {
    tracing::info!(
        component = name,
        bytes = wasm.len(),
        "compiling component (first start; later starts load it from the cache)"
    );
    Component::new(engine, wasm).map_err(|err| format!("{err:#}"))
}
