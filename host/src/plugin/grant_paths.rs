//! Where a directory grant's root is on the host, and what may not be
//! granted.
//!
//! A grant's root is resolved once, when the component is loaded
//! ([`resolve_root`]): the symlinks in the configured path are followed then,
//! and where each of them lies is kept, and the result is canonical (no
//! symlink, no `..`). On every call the root is opened again **without
//! following any symlink**, one path component at a time, and handed to WASI
//! as that open handle (through `/proc/self/fd`), so that no later change to
//! the path, by another component or anyone else, can point the grant
//! somewhere else: a symlink that appeared in the path fails the call instead.
//!
//! Refused at load, because they let one component change what another sees
//! or reach dexa itself ([`check_overlaps`], [`check_state_paths`]):
//! - a grant whose path goes through a symlink lying inside a directory
//!   another component may write (that component could have put it there,
//!   before this start);
//! - grants of different components that overlap (one contains the other)
//!   where either may write, unless both grants say `shared = true`;
//! - a grant that holds dexa's own state (the `.dexa` directory, the store,
//!   the API token, the artifact cache and its key, the config), or lies
//!   inside the cache; and a writable grant holding a component's code.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::grants::{DirAccess, DirGrant};

/// A grant's root as resolved at load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedRoot {
    /// The canonical path of the directory.
    pub root: PathBuf,
    /// Where each symlink followed on the way lies (canonical parent joined
    /// with the link's name).
    pub links: Vec<PathBuf>,
}

/// The most symlinks one resolution follows, as the kernel's own limit.
const MAX_LINKS: usize = 40;

/// Resolves `path` (made absolute against the working directory) the way the
/// kernel would, following `..` and symlinks, and records where every
/// symlink it followed lies. The result must be an existing directory.
pub fn resolve_root(path: &Path) -> Result<ResolvedRoot, String> {
    let fail = |why: String| format!("granted directory {} {why}", path.display());
    let start =
        std::path::absolute(path).map_err(|err| fail(format!("cannot be resolved: {err}")))?;
    let mut pending: Vec<std::ffi::OsString> = start
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut root = PathBuf::from("/");
    let mut links = Vec::new();
    while let Some(name) = pending.pop() {
        if name == ".." {
            root.pop();
            continue;
        }
        let at = root.join(&name);
        let meta = std::fs::symlink_metadata(&at)
            .map_err(|err| fail(format!("cannot be resolved at {}: {err}", at.display())))?;
        if !meta.file_type().is_symlink() {
            root = at;
            continue;
        }
        links.push(at.clone());
        if links.len() > MAX_LINKS {
            return Err(fail(format!("goes through more than {MAX_LINKS} symlinks")));
        }
        let target = std::fs::read_link(&at)
            .map_err(|err| fail(format!("cannot read the symlink {}: {err}", at.display())))?;
        if target.is_absolute() {
            root = PathBuf::from("/");
        }
        for component in target.components().rev() {
            match component {
                Component::Normal(part) => pending.push(part.to_os_string()),
                Component::ParentDir => pending.push("..".into()),
                _ => {}
            }
        }
    }
    if !root.is_dir() {
        return Err(fail("is not a directory".to_string()));
    }
    Ok(ResolvedRoot { root, links })
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

/// One component's directory grants, resolved, for the layout checks:
/// `dirs[i].host_path` is canonical, and `links[i]` says where the symlinks
/// its resolution followed lie.
pub struct GrantSet<'a> {
    pub component: &'a str,
    pub dirs: &'a [DirGrant],
    pub links: &'a [Vec<PathBuf>],
}

/// Refuses a grant resolved through a symlink that lies inside another
/// component's writable grant (whatever `shared` says: that component could
/// have planted it, even before this start), and grants of different
/// components that overlap where either may write, unless both say
/// `shared`.
pub fn check_overlaps(sets: &[GrantSet<'_>]) -> Result<(), String> {
    for (i, a) in sets.iter().enumerate() {
        for (j, b) in sets.iter().enumerate() {
            if i == j {
                continue;
            }
            for (ga, links) in a.dirs.iter().zip(a.links) {
                for gb in b.dirs.iter().filter(|g| g.access == DirAccess::ReadWrite) {
                    if let Some(link) = links.iter().find(|l| l.starts_with(&gb.host_path)) {
                        return Err(format!(
                            "component {:?}'s granted directory {} is reached through the symlink {}, \
                             inside {}, which component {:?} may write; refusing to follow it",
                            a.component,
                            ga.host_path.display(),
                            link.display(),
                            gb.host_path.display(),
                            b.component
                        ));
                    }
                }
            }
            if j < i {
                continue;
            }
            for ga in a.dirs {
                for gb in b.dirs {
                    let writable =
                        ga.access == DirAccess::ReadWrite || gb.access == DirAccess::ReadWrite;
                    if writable && nested(&ga.host_path, &gb.host_path) && !(ga.shared && gb.shared)
                    {
                        return Err(format!(
                            "components {:?} and {:?} are granted overlapping directories {} and {} \
                             and one of them may write there, so it could change what the other \
                             sees; give them separate directories, or mark both grants \
                             `shared = true` if they are meant to share files",
                            a.component,
                            b.component,
                            ga.host_path.display(),
                            gb.host_path.display()
                        ));
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

/// What a grant may not hold: dexa's secrets and state (refused for any
/// access) and the code components run (refused for write access).
#[derive(Clone, Debug, Default)]
pub struct StatePaths {
    /// The `.dexa` directory, the store, the API token, the cache.
    pub state: Vec<PathBuf>,
    /// Component files, the config, scripted model answers.
    pub code: Vec<PathBuf>,
    /// The artifact cache, inside which nothing may be granted.
    pub cache_dir: Option<PathBuf>,
}

/// Names whose presence at the top of a granted directory marks it as a
/// dexa directory (a config's, or a cache), refused whatever else is known.
const STATE_MARKERS: [&str; 3] = [".dexa", "dexa.toml", "cache-key"];

/// Refuses a grant that holds any of `paths.state` (or is one), a writable
/// grant that holds any of `paths.code`, a grant inside the cache, and a
/// grant that holds a `.dexa`, `dexa.toml` or `cache-key` at its top.
/// Grants must be canonical ([`resolve_root`]); the paths are compared in
/// canonical form, those that do not exist yet by their nearest existing
/// ancestor.
pub fn check_state_paths(
    component: &str,
    dirs: &[DirGrant],
    paths: &StatePaths,
) -> Result<(), String> {
    let refuse = |grant: &DirGrant, what: &Path| {
        Err(format!(
            "component {component:?} may not be granted {}: it holds dexa's own state ({}); \
             grant a directory of its own instead",
            grant.host_path.display(),
            what.display()
        ))
    };
    for grant in dirs {
        let root = &grant.host_path;
        for path in &paths.state {
            if canonical_or_nearest(path).starts_with(root) {
                return refuse(grant, path);
            }
        }
        if grant.access == DirAccess::ReadWrite {
            for path in &paths.code {
                if canonical_or_nearest(path).starts_with(root) {
                    return refuse(grant, path);
                }
            }
        }
        for marker in STATE_MARKERS {
            let path = root.join(marker);
            if std::fs::symlink_metadata(&path).is_ok() {
                return refuse(grant, &path);
            }
        }
        if let Some(cache) = &paths.cache_dir {
            if root.starts_with(canonical_or_nearest(cache)) {
                return Err(format!(
                    "component {component:?} may not be granted {}: it is inside the \
                     compiled-component cache {}",
                    root.display(),
                    cache.display()
                ));
            }
        }
    }
    Ok(())
}

/// `path` made absolute, with its nearest existing ancestor canonical and
/// the rest appended as written (without `.`/`..` handling beyond what
/// `std::path::absolute` does).
fn canonical_or_nearest(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    let mut at = absolute.as_path();
    loop {
        if let Ok(canonical) = std::fs::canonicalize(at) {
            let mut out = canonical;
            out.extend(rest.iter().rev());
            return out;
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return absolute,
        }
    }
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

    fn grant(path: &Path, access: DirAccess, shared: bool) -> DirGrant {
        DirGrant {
            host_path: path.to_path_buf(),
            guest_path: "/g".to_string(),
            access,
            shared,
            resolved: false,
        }
    }

    /// Resolves each `(component, grant)` and runs the overlap check.
    fn layout(grants: &[(&str, DirGrant)]) -> Result<(), String> {
        let resolved: Vec<(DirGrant, Vec<PathBuf>)> = grants
            .iter()
            .map(|(_, g)| {
                let r = resolve_root(&g.host_path).expect("resolves");
                let mut g = g.clone();
                g.host_path = r.root;
                (g, r.links)
            })
            .collect();
        let dirs: Vec<[DirGrant; 1]> = resolved.iter().map(|(g, _)| [g.clone()]).collect();
        let links: Vec<[Vec<PathBuf>; 1]> = resolved.iter().map(|(_, l)| [l.clone()]).collect();
        let sets: Vec<GrantSet<'_>> = grants
            .iter()
            .enumerate()
            .map(|(i, (component, _))| GrantSet {
                component,
                dirs: &dirs[i],
                links: &links[i],
            })
            .collect();
        check_overlaps(&sets)
    }

    #[test]
    fn a_grant_reached_through_a_symlink_another_component_may_write_is_refused_however_spelt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(base.join("shared")).expect("shared");
        std::fs::create_dir_all(base.join("home")).expect("home");
        // Planted by the writer before this start: shared/sub -> ../home.
        std::os::unix::fs::symlink("../home", base.join("shared/sub")).expect("symlink");
        // An operator's own symlink to the reader's grant, above both.
        std::os::unix::fs::symlink(base.join("shared"), base.join("alias")).expect("alias");
        let writer = grant(&base.join("shared"), DirAccess::ReadWrite, true);
        for reader_path in [
            base.join("shared/sub"),
            base.join("alias/sub"),
            base.join("home/../shared/sub"),
        ] {
            let reader = grant(&reader_path, DirAccess::ReadOnly, true);
            let err = layout(&[("writer", writer.clone()), ("reader", reader)])
                .expect_err("the writer planted the link");
            assert!(
                err.contains("which component \"writer\" may write"),
                "{err}"
            );
        }
        // A link above every writable grant is the operator's: followed.
        let reader = grant(&base.join("alias"), DirAccess::ReadOnly, true);
        assert_eq!(layout(&[("writer", writer), ("reader", reader)]), Ok(()));
    }

    #[test]
    fn overlapping_grants_need_both_to_be_shared_when_either_may_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(base.join("a/b")).expect("dirs");
        let outer = |access, shared| grant(&base.join("a"), access, shared);
        let inner = |access, shared| grant(&base.join("a/b"), access, shared);
        use DirAccess::{ReadOnly, ReadWrite};
        assert!(layout(&[
            ("x", outer(ReadWrite, false)),
            ("y", inner(ReadOnly, false))
        ])
        .is_err());
        assert!(layout(&[("x", outer(ReadOnly, false)), ("y", inner(ReadWrite, true))]).is_err());
        assert_eq!(
            layout(&[("x", outer(ReadWrite, true)), ("y", inner(ReadOnly, true))]),
            Ok(())
        );
        assert_eq!(
            layout(&[("x", outer(ReadOnly, false)), ("y", inner(ReadOnly, false))]),
            Ok(())
        );
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
