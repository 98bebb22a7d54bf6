//! The cache's secret key: 32 random bytes in `<cache dir>/cache-key`, mode
//! 0600, shared by every process that uses the directory.
//!
//! The first process to start makes it; the others read it. Making it is
//! race-free between processes: each writes a complete candidate to a
//! private temporary file and links it into place only if no key exists
//! yet (`renameat2(RENAME_NOREPLACE)`, or `link`); the losers read the
//! winner's. No process ever sees half a key.
//!
//! An existing key file is used only if it is a regular file (not a
//! symlink, FIFO or device), owned by this process's user, not readable or
//! writable by group or others, and exactly [`KEY_BYTES`] long. Anything
//! else is refused with an error naming the file: a key others could read
//! no longer authenticates anything.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The key file's name in the cache directory.
pub(crate) const KEY_FILE: &str = "cache-key";
/// The key's length: 256 bits, as long as an HMAC-SHA256 tag.
pub(crate) const KEY_BYTES: usize = 32;

/// The secret key of one cache directory.
pub(crate) struct CacheKey(pub(super) [u8; KEY_BYTES]);

impl std::fmt::Debug for CacheKey {
    // Never print the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheKey(..)")
    }
}

/// Reads `dir`'s key, making it first if there is none.
pub(crate) fn load_or_create(dir: &Path) -> anyhow::Result<CacheKey> {
    let path = dir.join(KEY_FILE);
    // Two rounds: if another process links its key in between our read
    // and our link, the second read finds it.
    for _ in 0..2 {
        match read(&path) {
            Ok(key) => return Ok(key),
            Err(ReadError::Missing) => {}
            Err(ReadError::Refused(reason)) => anyhow::bail!(
                "the component cache key {} is refused: {reason}; remove it (a new key is made \
                 at the next start, and the cached components are recompiled once)",
                path.display()
            ),
        }
        if let Some(key) = create(dir, &path)? {
            return Ok(key);
        }
    }
    anyhow::bail!(
        "the component cache key {} keeps appearing and vanishing; is another program \
         removing it?",
        path.display()
    )
}

enum ReadError {
    Missing,
    Refused(String),
}

fn read(path: &Path) -> Result<CacheKey, ReadError> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        // A symlink is refused (ELOOP) rather than followed, and a FIFO
        // does not block the open.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|err| match err.kind() {
            ErrorKind::NotFound => ReadError::Missing,
            _ if err.raw_os_error() == Some(libc::ELOOP) => {
                ReadError::Refused("it is a symbolic link".to_string())
            }
            _ => ReadError::Refused(format!("cannot open it: {err}")),
        })?;
    // The checks are on the open file, so the file cannot change between
    // them and the read.
    let meta = file
        .metadata()
        .map_err(|err| ReadError::Refused(format!("cannot stat it: {err}")))?;
    if !meta.file_type().is_file() {
        return Err(ReadError::Refused("it is not a regular file".to_string()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid {
        return Err(ReadError::Refused(format!(
            "it is owned by uid {}, not by this process's uid {uid}",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(ReadError::Refused(format!(
            "its mode is {mode:03o}: group or others may read or write it (it must be 600)"
        )));
    }
    if meta.len() != KEY_BYTES as u64 {
        return Err(ReadError::Refused(format!(
            "it is {} bytes long, not {KEY_BYTES}",
            meta.len()
        )));
    }
    let mut key = [0u8; KEY_BYTES];
    file.read_exact(&mut key)
        .map_err(|err| ReadError::Refused(format!("cannot read it: {err}")))?;
    Ok(CacheKey(key))
}

/// Links a new key into place. `None`: another process's key got there
/// first (read it).
fn create(dir: &Path, path: &Path) -> anyhow::Result<Option<CacheKey>> {
    let mut key = [0u8; KEY_BYTES];
    File::open("/dev/urandom")
        .and_then(|mut random| random.read_exact(&mut key))
        .map_err(|err| anyhow::anyhow!("cannot read /dev/urandom to make a cache key: {err}"))?;
    // tempfile creates the file with mode 0600 and a random name (O_EXCL),
    // so no other process can open our candidate.
    let mut candidate = tempfile::Builder::new()
        .prefix(".cache-key-")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)
        .map_err(|err| anyhow::anyhow!("cannot create a cache key in {}: {err}", dir.display()))?;
    candidate
        .write_all(&key)
        .and_then(|()| candidate.as_file().sync_all())
        .map_err(|err| anyhow::anyhow!("cannot write a cache key in {}: {err}", dir.display()))?;
    match candidate.persist_noclobber(path) {
        Ok(_) => Ok(Some(CacheKey(key))),
        // The temporary file is removed when the error is dropped.
        Err(err) if err.error.kind() == ErrorKind::AlreadyExists => Ok(None),
        Err(err) => Err(anyhow::anyhow!(
            "cannot put the cache key at {}: {}",
            path.display(),
            err.error
        )),
    }
}
