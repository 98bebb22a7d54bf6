//! The compiled-artifact cache: compiling a component takes 100+ ms, loading
//! its cached machine code well under one.
//!
//! Entries are keyed by the component's SHA-256 and a digest of everything in
//! the engine that affects code generation (wasmtime's own compatibility hash
//! plus its version), so a changed engine never loads a stale artifact.
//!
//! # Authenticated entries
//! An entry is native code that the host maps as executable, and wasmtime's
//! own checks on it are only a header and version check: a flipped byte in
//! its machine code would run. So each entry is sealed with an HMAC-SHA256
//! tag under a secret key of the cache directory (see [`key`]):
//!
//! ```text
//! MAGIC (8 bytes) | tag (32 bytes) | artifact (Component::serialize)
//! tag = HMAC-SHA256(key, DOMAIN | entry file name | 0 | artifact)
//! ```
//!
//! The tag is checked before `Component::deserialize` sees a byte. The entry
//! file name (component SHA-256 and engine digest) is under the tag, so a
//! valid entry of another component or engine copied over this name is
//! refused too. An entry that is missing its header (written before entries
//! were sealed), truncated, tampered with, not a regular file or too large
//! is refused with a warning, removed, and the component compiled anew from
//! its wasm ([`CacheOutcome::Recompiled`]): it never runs.
//!
//! # A bounded cache
//! Every rebuild of a component is a new entry, and an engine upgrade makes
//! every entry stale, so the entries are bounded in bytes
//! ([`DEFAULT_MAX_BYTES`], `cache_max` in `dexa.toml`): after writing an
//! entry, the least recently used others are removed until the rest fit.
//! A load that hits an entry marks it used (its modification time). Another
//! process that wanted a removed entry compiles it again; one reading it
//! keeps its open file.
//!
//! What this protects against: corruption on disk, and anyone who can write
//! to the cache directory but cannot read the key (another user, if the
//! directory's permissions let them; a backup restored from elsewhere).
//! What it does not: anyone who can read the key file (the host's own user,
//! root, a copy of the key) can forge entries, and anyone who can write to
//! the directory can still delete entries or the key (the host then
//! recompiles, or refuses a key it did not make). The directory must stay
//! writable only by the host's user, and no component may be granted a
//! directory that contains it.

mod key;
#[cfg(test)]
mod tests;

use std::hash::{Hash, Hasher};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

use key::CacheKey;

/// How a component came to be ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from the cache; nothing was compiled.
    Hit,
    /// Compiled now and written to the cache.
    Compiled,
    /// The cache's entry was refused (tampered with, truncated, not sealed
    /// by this cache's key, or unusable), so it was compiled now from its
    /// wasm and the entry rewritten. The refused entry never ran.
    Recompiled,
    /// Compiled now; no cache is configured (or writing to it failed).
    CompiledUncached,
}

/// The first bytes of every sealed entry (a version: a new format gets a
/// new magic, and older entries are refused and rewritten).
const MAGIC: &[u8; 8] = b"dexaCW01";
/// The HMAC-SHA256 tag's length.
const TAG_BYTES: usize = 32;
/// Separates this use of the key from any other.
const DOMAIN: &[u8] = b"dexa component cache entry v1\0";
/// The largest entry the cache reads; a bigger file is refused unread.
const MAX_ENTRY_BYTES: u64 = 1 << 30;
/// The bytes of entries a cache keeps unless configured otherwise: a few
/// versions of a dozen components (a Python component's entry is ~35 MB).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// The smallest bound a configuration may set: below a few entries, every
/// start would recompile what the last one evicted.
pub const MIN_MAX_BYTES: u64 = 64 << 20;
/// What entry files are named with.
const ENTRY_SUFFIX: &str = ".cwasm";
/// What this cache's temporary files are named with: eviction removes only
/// files named as this cache names them, whatever else the directory holds.
const TEMPORARY_PREFIX: &str = ".dexa-entry-";
/// A temporary file a crashed write left behind is removed after this long.
const STALE_TEMPORARY: std::time::Duration = std::time::Duration::from_secs(3600);

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
    key: CacheKey,
    max_bytes: u64,
}

impl ArtifactCache {
    /// Opens (creating, mode 0700) the cache directory and reads its key,
    /// making one if there is none. A key file that is not this user's
    /// private 32-byte file is an error (see [`key`]).
    pub(crate) fn open(dir: PathBuf, engine: &Engine) -> anyhow::Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|err| {
                anyhow::anyhow!("cannot create component cache {}: {err}", dir.display())
            })?;
        let key = key::load_or_create(&dir)?;
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        env!("CARGO_PKG_VERSION").hash(&mut hasher);
        let engine_key = hex::encode(&hasher.0.finalize()[..8]);
        Ok(Self {
            dir,
            engine_key,
            key,
            max_bytes: DEFAULT_MAX_BYTES,
        })
    }

    /// Keeps at most `max_bytes` of entries (see the module docs).
    pub(crate) fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Removes the least recently used entries (and temporary files a
    /// crashed write left) until the entries fit in the bound; `keep`, the
    /// entry just written, stays even if it alone is over.
    fn evict(&self, keep: &Path) {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let now = std::time::SystemTime::now();
        let mut entries = Vec::new();
        let mut total: u64 = 0;
        for item in listing.flatten() {
            let path = item.path();
            let name = item.file_name();
            let name = name.to_string_lossy();
            // Not followed: a symlink here is no entry of ours.
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let used = meta.modified().unwrap_or(now);
            if name.starts_with(TEMPORARY_PREFIX) {
                if meta.is_file() && now.duration_since(used).unwrap_or_default() > STALE_TEMPORARY
                {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            if !meta.is_file() || !is_entry_name(&name) {
                continue;
            }
            total = total.saturating_add(meta.len());
            entries.push((used, meta.len(), path));
        }
        if total <= self.max_bytes {
            return;
        }
        entries.sort_by_key(|(used, _, _)| *used);
        for (_, bytes, path) in entries {
            if total <= self.max_bytes {
                break;
            }
            if path == keep {
                continue;
            }
            let removed = match std::fs::remove_file(&path) {
                Ok(()) => true,
                // Another process evicted it first: it is gone all the same.
                Err(err) => err.kind() == ErrorKind::NotFound,
            };
            if removed {
                total = total.saturating_sub(bytes);
                tracing::info!(
                    path = %path.display(),
                    bytes,
                    "removed the least recently used compiled component: the cache is over its bound"
                );
            }
        }
    }

    fn entry_name(&self, component_sha256: &str) -> String {
        format!("{component_sha256}-{}{ENTRY_SUFFIX}", self.engine_key)
    }

    /// The tag of `artifact` stored under `entry_name`.
    fn mac(&self, entry_name: &str, artifact: &[u8]) -> Hmac<Sha256> {
        // HMAC takes a key of any length; ours is always 32 bytes.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        mac.update(DOMAIN);
        mac.update(entry_name.as_bytes());
        mac.update(&[0]);
        mac.update(artifact);
        mac
    }

    /// `artifact` as an entry file's bytes.
    fn seal(&self, entry_name: &str, artifact: &[u8]) -> Vec<u8> {
        let tag = self.mac(entry_name, artifact).finalize().into_bytes();
        let mut entry = Vec::with_capacity(MAGIC.len() + TAG_BYTES + artifact.len());
        entry.extend_from_slice(MAGIC);
        entry.extend_from_slice(&tag);
        entry.extend_from_slice(artifact);
        entry
    }

    /// The artifact inside an entry file's bytes, if its tag is right.
    fn unseal<'a>(&self, entry_name: &str, entry: &'a [u8]) -> Result<&'a [u8], String> {
        let rest = entry
            .strip_prefix(MAGIC.as_slice())
            .ok_or("it has no dexa header (written before entries were sealed, or not an entry)")?;
        if rest.len() < TAG_BYTES {
            return Err("it is truncated".to_string());
        }
        let (tag, artifact) = rest.split_at(TAG_BYTES);
        // verify_slice compares in constant time.
        self.mac(entry_name, artifact)
            .verify_slice(tag)
            .map_err(|_| {
                "its tag does not match (tampered with, truncated, or not sealed by this \
                 cache's key for this name)"
            })?;
        Ok(artifact)
    }

    /// Loads the compiled component from the cache, or compiles and stores it.
    pub(crate) fn load_or_compile(
        &self,
        engine: &Engine,
        name: &str,
        sha256: &str,
        wasm: &[u8],
    ) -> Result<(Component, CacheOutcome), String> {
        let entry_name = self.entry_name(sha256);
        let path = self.dir.join(&entry_name);
        let mut refused = false;
        match read_entry(&path) {
            Ok(None) => {}
            Ok(Some(entry)) => {
                let loaded = self.unseal(&entry_name, &entry).and_then(|artifact| {
                    // SAFETY: the bytes carry this cache's tag over this
                    // entry's name, so they are what `Component::serialize`
                    // wrote for this component with an engine of the same
                    // compatibility key (module docs: the key's limits).
                    // They are in memory, not mapped from the file, so
                    // nobody can change them after the check (or truncate
                    // a mapping under the host, which would be SIGBUS).
                    unsafe { Component::deserialize(engine, artifact) }
                        .map_err(|err| format!("wasmtime cannot load it: {err}"))
                });
                match loaded {
                    Ok(component) => return Ok((component, CacheOutcome::Hit)),
                    Err(reason) => {
                        refused = true;
                        refuse(name, &path, &reason);
                    }
                }
            }
            Err(reason) => {
                refused = true;
                refuse(name, &path, &reason);
            }
        }
        let component = compile(engine, name, wasm)?;
        let stored = self.store(&path, &entry_name, &component);
        if stored.is_ok() {
            self.evict(&path);
        }
        match stored {
            Ok(()) if refused => Ok((component, CacheOutcome::Recompiled)),
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
    fn store(&self, path: &Path, entry_name: &str, component: &Component) -> anyhow::Result<()> {
        let artifact = component.serialize().map_err(anyhow::Error::from)?;
        let entry = self.seal(entry_name, &artifact);
        drop(artifact);
        // A private (0600) temporary file, renamed over whatever is at
        // `path`: a symlink there is replaced, not followed.
        let mut file = tempfile::Builder::new()
            .prefix(TEMPORARY_PREFIX)
            .tempfile_in(&self.dir)?;
        file.write_all(&entry)?;
        file.as_file().sync_all()?;
        file.persist(path)?;
        Ok(())
    }
}

/// Whether `name` is an entry's: 64 hex digits (the component), `-`, 16
/// hex digits (the engine), [`ENTRY_SUFFIX`].
fn is_entry_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(ENTRY_SUFFIX) else {
        return false;
    };
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    matches!(stem.split_once('-'), Some((component, engine)) if hex(component, 64) && hex(engine, 16))
}

/// Warns that the entry at `path` is refused, and removes it.
fn refuse(component: &str, path: &Path, reason: &str) {
    tracing::warn!(
        component,
        path = %path.display(),
        reason,
        "refused a cached component: it will not run; recompiling it from its wasm"
    );
    // Unlinks the entry itself (a symlink, not its target). If this fails,
    // the rewrite that follows replaces it.
    let _ = std::fs::remove_file(path);
}

/// The bytes of the entry at `path`; `None` if there is none. An entry
/// that is not a regular file, or is larger than [`MAX_ENTRY_BYTES`], is
/// an error and is not read.
fn read_entry(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        // A symlink is not followed and a FIFO does not block.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let mut file = match file {
        Ok(file) => file,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(None),
        Err(err) if err.raw_os_error() == Some(libc::ELOOP) => {
            return Err("it is a symbolic link".to_string())
        }
        Err(err) => return Err(format!("cannot open it: {err}")),
    };
    let meta = file
        .metadata()
        .map_err(|err| format!("cannot stat it: {err}"))?;
    if !meta.file_type().is_file() {
        return Err("it is not a regular file".to_string());
    }
    if meta.len() > MAX_ENTRY_BYTES {
        return Err(format!("it is over {MAX_ENTRY_BYTES} bytes"));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // `take`: the file may grow after the stat.
    (&mut file)
        .take(MAX_ENTRY_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|err| format!("cannot read it: {err}"))?;
    if bytes.len() as u64 > MAX_ENTRY_BYTES {
        return Err(format!("it is over {MAX_ENTRY_BYTES} bytes"));
    }
    // Used now: the bound evicts the least recently used entries. (Best
    // effort: an entry this user does not own keeps its time.)
    let _ = file.set_modified(std::time::SystemTime::now());
    Ok(Some(bytes))
}

pub(crate) fn compile(engine: &Engine, name: &str, wasm: &[u8]) -> Result<Component, String> {
    tracing::info!(
        component = name,
        bytes = wasm.len(),
        "compiling component (first start; later starts load it from the cache)"
    );
    Component::new(engine, wasm).map_err(|err| format!("{err:#}"))
}
