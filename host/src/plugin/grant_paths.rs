//! Where a directory grant's root is on the host, and what may not be
//! granted.
//!
//! A grant's root is resolved once, when the component is loaded: the
//! operator's own symlinks in the configured path are followed then, and the
//! result is canonical (no symlink, no `..`). On every call the root is opened
//! again **without following any symlink**, one path component at a time, and
//! handed to WASI as that open handle (through `/proc/self/fd`), so that no
//! later change to the path, by another component or anyone else, can point
//! the grant somewhere else: a symlink that appeared in the path fails the
//! call instead.
//!
//! Two layouts are refused at load, because they let one component change
//! what another sees:
//! - grants of different components that overlap (one contains the other)
//!   where either may write, unless both grants say `shared = true`;
//! - a grant that holds dexa's own state (the store, the API token, the
//!   compiled-artifact cache, or the `.dexa` directory), or lies inside the
//!   artifact cache.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::grants::{DirAccess, DirGrant};

/// The canonical form of a grant's configured host path, following the
/// symlinks that are in it now (at load).
pub fn canonical_root(grant: &DirGrant) -> Result<PathBuf, String> {
    std::fs::canonicalize(&grant.host_path).map_err(|err| {
        format!(
            "granted directory {} cannot be resolved: {err}",
            grant.host_path.display()
        )
    })
}

/// Opens the directory at the canonical `path` without following a symlink
/// anywhere in it. The handle refers to the directory itself, whatever its
/// path points to later.
pub(crate) fn open_root_no_follow(path: &Path) -> Result<OwnedFd, String> {
    let fail = |what: &str, err: std::io::Error| {
        format!("granted directory {}: {what}: {err}", path.display())
    };
    let mut dir = open_at(None, Path::new("/")).map_err(|err| fail("cannot open /", err))?;
    for component in path.components() {
        match component {
            Component::RootDir | Component::CurDir => continue,
            Component::Normal(name) => {
                dir = open_at(Some(&dir), Path::new(name)).map_err(|err| {
                    if matches!(err.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) {
                        format!(
                            "granted directory {}: {:?} is no longer a directory (a symlink \
                             or a file replaced it since the grant was loaded); refusing to follow it",
                            path.display(),
                            name
                        )
                    } else {
                        fail("cannot open it", err)
                    }
                })?;
            }
            Component::ParentDir | Component::Prefix(_) => {
                return Err(format!(
                    "granted directory {} is not a canonical path",
                    path.display()
                ))
            }
        }
    }
    Ok(dir)
}

/// `openat(parent, name, O_PATH | O_DIRECTORY | O_NOFOLLOW)`, checked to be a
/// directory (a symlink opened with `O_PATH | O_NOFOLLOW` would be the link).
fn open_at(parent: Option<&OwnedFd>, name: &Path) -> std::io::Result<OwnedFd> {
    let name = CString::new(name.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let at = parent.map_or(libc::AT_FDCWD, |fd| fd.as_raw_fd());
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `name` is a valid C string and `at` an open descriptor (or
    // AT_FDCWD); the returned descriptor, if any, is owned by us alone.
    let fd = unsafe { libc::openat(at, name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is not owned elsewhere.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fd` is open and `stat` points to enough writable memory.
    if unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so it filled `stat`.
    let mode = unsafe { stat.assume_init() }.st_mode;
    if mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(std::io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    Ok(fd)
}

/// The path under which an open directory handle can be opened again: the
/// same directory, whatever its name points to now.
pub(crate) fn handle_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// One component's directory grants, for the layout checks.
pub struct GrantSet<'a> {
    pub component: &'a str,
    pub dirs: &'a [DirGrant],
}

/// Refuses grants of different components that overlap where either may
/// write, unless both say `shared`; with `shared`, refuses a symlink in the
/// part of a path that lies inside the other component's writable grant (it
/// could have been put there by that component). Grants must be canonical
/// ([`canonical_root`]); `configured` gives each grant's path as written
/// (absolute), in the same order, to see overlaps the symlinks hide.
pub fn check_overlaps(sets: &[GrantSet<'_>], configured: &[Vec<PathBuf>]) -> Result<(), String> {
    for (i, a) in sets.iter().enumerate() {
        for (j, b) in sets.iter().enumerate().skip(i + 1) {
            for (ai, ga) in a.dirs.iter().enumerate() {
                for (bi, gb) in b.dirs.iter().enumerate() {
                    let writable =
                        ga.access == DirAccess::ReadWrite || gb.access == DirAccess::ReadWrite;
                    let (ca, cb) = (&configured[i][ai], &configured[j][bi]);
                    let overlap = nested(&ga.host_path, &gb.host_path) || nested(ca, cb);
                    if !writable || !overlap {
                        continue;
                    }
                    if !(ga.shared && gb.shared) {
                        return Err(format!(
                            "components {:?} and {:?} are granted overlapping directories {} and {} \
                             and one of them may write there, so it could change (or redirect) what \
                             the other sees; give them separate directories, or mark both grants \
                             `shared = true` if they are meant to share files",
                            a.component,
                            b.component,
                            ga.host_path.display(),
                            gb.host_path.display()
                        ));
                    }
                    for (outer, inner) in [(ca, cb), (cb, ca)] {
                        if inner.starts_with(outer) {
                            no_symlink_below(outer, inner)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whether one path contains the other (or they are the same).
fn nested(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// Refuses a symlink in `inner`'s components below `outer`.
fn no_symlink_below(outer: &Path, inner: &Path) -> Result<(), String> {
    let Ok(rest) = inner.strip_prefix(outer) else {
        return Ok(());
    };
    let mut at = outer.to_path_buf();
    for component in rest.components() {
        at.push(component);
        if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(format!(
                "granted directory {}: {} is a symlink inside a directory another component may \
                 write; refusing to follow it",
                inner.display(),
                at.display()
            ));
        }
    }
    Ok(())
}

/// Refuses a grant that holds any of dexa's own `state` paths (or is one),
/// or lies inside `cache_dir` (compiled native code the host runs). Paths
/// are compared canonically; a state path that does not exist yet is
/// compared as written.
pub fn check_state_paths(
    component: &str,
    dirs: &[DirGrant],
    state: &[PathBuf],
    cache_dir: Option<&Path>,
) -> Result<(), String> {
    let canonical =
        |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    for grant in dirs {
        let root = canonical(&grant.host_path);
        for path in state {
            if canonical(path).starts_with(&root) {
                return Err(format!(
                    "component {component:?} may not be granted {}: it holds dexa's own state ({}); \
                     grant a directory of its own instead",
                    grant.host_path.display(),
                    path.display()
                ));
            }
        }
        if let Some(cache) = cache_dir {
            if root.starts_with(canonical(cache)) {
                return Err(format!(
                    "component {component:?} may not be granted {}: it is inside the \
                     compiled-component cache {}",
                    grant.host_path.display(),
                    cache.display()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlink_anywhere_in_a_root_is_refused_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("sub")).expect("dirs");
        let root = std::fs::canonicalize(real.join("sub")).expect("canonical");
        assert!(open_root_no_follow(&root).is_ok());
        std::fs::rename(&real, dir.path().join("moved")).expect("rename");
        std::os::unix::fs::symlink(dir.path().join("moved"), &real).expect("symlink");
        let err = open_root_no_follow(&root).expect_err("a symlink is in the path now");
        assert!(err.contains("is no longer a directory"), "{err}");
    }

    #[test]
    fn an_open_root_stays_the_same_directory_when_its_path_is_redirected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("root");
        std::fs::write(root.join("mine.txt"), "mine").expect("file");
        let fd = open_root_no_follow(&std::fs::canonicalize(&root).expect("c")).expect("open");
        std::fs::rename(&root, dir.path().join("elsewhere")).expect("rename");
        std::fs::create_dir(&root).expect("new root");
        let text = std::fs::read_to_string(handle_path(&fd).join("mine.txt")).expect("read");
        assert_eq!(text, "mine");
    }
}
