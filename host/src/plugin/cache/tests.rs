//! The cache refuses any entry it did not seal itself for that name, and
//! recompiles instead of running it; its key is private and shared.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use wasmtime::component::Component;
use wasmtime::Engine;

use super::key::{load_or_create, KEY_BYTES, KEY_FILE};
use super::{ArtifactCache, CacheOutcome, MAGIC};

/// A guest built by `guests/build.sh`.
fn guest(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/guests")
        .join(format!("{name}.wasm"));
    std::fs::read(&path)
        .unwrap_or_else(|err| panic!("{}: {err}; run guests/build.sh", path.display()))
}

struct Fixture {
    dir: tempfile::TempDir,
    engine: Engine,
}

impl Fixture {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            engine: Engine::default(),
        }
    }

    fn cache(&self) -> ArtifactCache {
        ArtifactCache::open(self.dir.path().to_path_buf(), &self.engine).expect("open cache")
    }

    /// Loads `guest` through a freshly opened cache, as a new process would.
    fn load(&self, name: &str) -> (Component, CacheOutcome) {
        let wasm = guest(name);
        let sha = super::sha256_hex(&wasm);
        self.cache()
            .load_or_compile(&self.engine, name, &sha, &wasm)
            .expect("load")
    }

    fn entry(&self, name: &str) -> PathBuf {
        let cache = self.cache();
        self.dir
            .path()
            .join(cache.entry_name(&super::sha256_hex(&guest(name))))
    }
}

/// The names of a component's exports: which component it really is.
fn exports(engine: &Engine, component: &Component) -> Vec<String> {
    component
        .component_type()
        .exports(engine)
        .map(|(name, _)| name.to_string())
        .collect()
}

#[test]
fn a_sealed_entry_loads_without_compiling() {
    let fx = Fixture::new();
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Compiled);
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Hit);
    let entry = std::fs::read(fx.entry("tiny-tool")).expect("entry");
    assert!(entry.starts_with(MAGIC), "entries start with the magic");
}

#[test]
fn an_entry_with_one_flipped_byte_is_refused_and_recompiled() {
    let fx = Fixture::new();
    fx.load("tiny-tool");
    let path = fx.entry("tiny-tool");
    let mut entry = std::fs::read(&path).expect("entry");
    // A byte in the artifact, past the header and the tag.
    let at = entry.len() / 2;
    entry[at] ^= 0x01;
    std::fs::write(&path, &entry).expect("tamper");
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Recompiled);
    // Rewritten: the next start loads it again.
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Hit);
}

#[test]
fn a_truncated_entry_is_refused_and_recompiled() {
    let fx = Fixture::new();
    fx.load("tiny-tool");
    let path = fx.entry("tiny-tool");
    let entry = std::fs::read(&path).expect("entry");
    // Cut in the artifact, in the tag, and in the magic.
    for keep in [entry.len() - 1, entry.len() / 2, 20, 3, 0] {
        std::fs::write(&path, &entry[..keep]).expect("truncate");
        assert_eq!(
            fx.load("tiny-tool").1,
            CacheOutcome::Recompiled,
            "an entry cut to {keep} bytes"
        );
    }
}

#[test]
fn another_component_s_sealed_entry_under_this_name_is_refused_and_does_not_run() {
    let fx = Fixture::new();
    fx.load("echo-tool");
    fx.load("tiny-tool");
    let (echo_path, tiny_path) = (fx.entry("echo-tool"), fx.entry("tiny-tool"));
    // A valid entry, sealed by this very cache, but for another component.
    std::fs::copy(&tiny_path, &echo_path).expect("swap");
    let (component, outcome) = fx.load("echo-tool");
    assert_eq!(outcome, CacheOutcome::Recompiled);
    let expected = exports(
        &fx.engine,
        &Component::new(&fx.engine, guest("echo-tool")).expect("compile"),
    );
    assert_eq!(exports(&fx.engine, &component), expected);
    // And the bare artifact of the other component, with no seal at all.
    let tiny = Component::new(&fx.engine, guest("tiny-tool")).expect("compile");
    std::fs::write(&echo_path, tiny.serialize().expect("serialize")).expect("swap");
    assert_eq!(fx.load("echo-tool").1, CacheOutcome::Recompiled);
}

#[test]
fn an_entry_from_before_sealing_is_refused_and_rewritten_sealed() {
    let fx = Fixture::new();
    let component = Component::new(&fx.engine, guest("tiny-tool")).expect("compile");
    let path = fx.entry("tiny-tool");
    std::fs::write(&path, component.serialize().expect("serialize")).expect("old entry");
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Recompiled);
    let entry = std::fs::read(&path).expect("entry");
    assert!(entry.starts_with(MAGIC), "the rewritten entry is sealed");
}

#[test]
fn an_entry_sealed_under_another_directory_s_key_is_refused() {
    let (first, second) = (Fixture::new(), Fixture::new());
    first.load("tiny-tool");
    std::fs::copy(first.entry("tiny-tool"), second.entry("tiny-tool")).expect("copy");
    // Same engine settings, same name: only the key differs.
    let second = Fixture {
        engine: first.engine.clone(),
        ..second
    };
    assert_eq!(second.load("tiny-tool").1, CacheOutcome::Recompiled);
}

#[test]
fn a_symlink_or_fifo_at_an_entry_is_refused_and_not_followed() {
    let fx = Fixture::new();
    fx.load("tiny-tool");
    let path = fx.entry("tiny-tool");
    // The link points at a valid entry: it must still be refused, and the
    // file it points at left alone.
    let target = fx.dir.path().join("elsewhere");
    std::fs::rename(&path, &target).expect("move");
    std::os::unix::fs::symlink(&target, &path).expect("symlink");
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Recompiled);
    assert!(!std::fs::symlink_metadata(&path)
        .expect("entry")
        .is_symlink());
    assert!(target.is_file(), "the link's target is untouched");
    // A FIFO would block a plain open forever.
    std::fs::remove_file(&path).expect("remove");
    let fifo = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    assert_eq!(fx.load("tiny-tool").1, CacheOutcome::Recompiled);
}

#[test]
fn processes_racing_to_make_the_key_all_use_the_one_that_landed() {
    for _round in 0..20 {
        let dir = tempfile::tempdir().expect("tempdir");
        let racers = 8;
        let barrier = Arc::new(Barrier::new(racers));
        let keys: Vec<[u8; KEY_BYTES]> = (0..racers)
            .map(|_| {
                let (dir, barrier) = (dir.path().to_path_buf(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    load_or_create(&dir).expect("key").0
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|racer| racer.join().expect("racer"))
            .collect();
        let on_disk = std::fs::read(dir.path().join(KEY_FILE)).expect("key file");
        assert!(
            keys.iter().all(|k| k.as_slice() == on_disk),
            "one key for all"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, [KEY_FILE], "no candidate key is left behind");
    }
}

#[test]
fn the_key_file_is_private_to_the_host_s_user() {
    let dir = tempfile::tempdir().expect("tempdir");
    load_or_create(dir.path()).expect("key");
    let meta = std::fs::metadata(dir.path().join(KEY_FILE)).expect("key file");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), KEY_BYTES as u64);
}

/// Opening the cache with a key file that `spoil` changed fails with an
/// error that says why.
fn refused_key(spoil: impl FnOnce(&Path), reason: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    load_or_create(dir.path()).expect("key");
    spoil(&dir.path().join(KEY_FILE));
    let err = match ArtifactCache::open(dir.path().to_path_buf(), &Engine::default()) {
        Ok(_) => panic!("a spoiled key was accepted ({reason})"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains(reason), "{err}");
}

#[test]
fn a_key_file_that_others_may_read_is_refused() {
    refused_key(
        |key| std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o644)).expect("chmod"),
        "its mode is 644",
    );
}

#[test]
fn a_key_file_of_the_wrong_length_is_refused() {
    refused_key(
        |key| std::fs::write(key, b"short").expect("write"),
        "5 bytes long",
    );
    refused_key(
        |key| std::fs::write(key, [7u8; 64]).expect("write"),
        "64 bytes long",
    );
}

#[test]
fn a_symlinked_key_file_is_refused() {
    refused_key(
        |key| {
            let elsewhere = key.with_file_name("elsewhere");
            std::fs::rename(key, &elsewhere).expect("move");
            std::os::unix::fs::symlink(&elsewhere, key).expect("symlink");
        },
        "symbolic link",
    );
}

#[test]
fn a_key_file_owned_by_another_user_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Only root can give a file away; the owner check is the same code.
        eprintln!("skipped: needs root to chown the key file");
        return;
    }
    refused_key(
        |key| std::os::unix::fs::chown(key, Some(65534), None).expect("chown"),
        "owned by uid 65534",
    );
}

/// A tiny component; each `n` is another build of it (another digest).
fn build(n: u32) -> Vec<u8> {
    wat::parse_str(format!(
        r#"(component
             (core module $m (func (export "f") (result i32) i32.const {n}))
             (core instance $i (instantiate $m))
             (func (export "f") (result s32) (canon lift (core func $i "f"))))"#
    ))
    .expect("a component")
}

/// The entries' files and their total size.
fn entries(dir: &Path) -> (Vec<PathBuf>, u64) {
    let mut found = Vec::new();
    let mut total = 0;
    for item in std::fs::read_dir(dir).expect("the cache dir") {
        let path = item.expect("an item").path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| super::is_entry_name(&n)) {
            total += std::fs::metadata(&path).expect("stat").len();
            found.push(path);
        }
    }
    (found, total)
}

impl Fixture {
    /// Loads build `n` through a fresh cache bounded to `max` bytes.
    fn load_build(&self, n: u32, max: u64) -> CacheOutcome {
        let wasm = build(n);
        let sha = super::sha256_hex(&wasm);
        self.cache()
            .with_max_bytes(max)
            .load_or_compile(&self.engine, "built", &sha, &wasm)
            .expect("load")
            .1
    }
}

#[test]
fn the_cache_stays_under_its_bound_across_twenty_rebuilds() {
    let fixture = Fixture::new();
    // Builds 1000..1020 encode alike: their entries are the same size.
    assert_eq!(fixture.load_build(1000, u64::MAX), CacheOutcome::Compiled);
    let (_, one) = entries(fixture.dir.path());
    assert!(one > 0);
    let bound = 3 * one + one / 2;
    for n in 1001..1021 {
        assert_eq!(
            fixture.load_build(n, bound),
            CacheOutcome::Compiled,
            "build {n}"
        );
        let (found, total) = entries(fixture.dir.path());
        assert!(
            total <= bound,
            "build {n}: {total} bytes over the bound {bound}"
        );
        assert!(found.len() <= 3, "build {n}: {} entries", found.len());
    }
    // The newest three are kept; the oldest were removed and compile again.
    for n in 1018..1021 {
        assert_eq!(fixture.load_build(n, bound), CacheOutcome::Hit, "build {n}");
    }
    assert_eq!(fixture.load_build(1000, bound), CacheOutcome::Compiled);
}

#[test]
fn a_hit_marks_its_entry_used_so_the_least_recently_used_goes_first() {
    let fixture = Fixture::new();
    assert_eq!(fixture.load_build(2000, u64::MAX), CacheOutcome::Compiled);
    let (_, one) = entries(fixture.dir.path());
    let bound = 3 * one + one / 2;
    let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
    for n in [2001, 2002] {
        pause();
        assert_eq!(fixture.load_build(n, bound), CacheOutcome::Compiled);
    }
    // 2000 is the oldest written, but used now.
    pause();
    assert_eq!(fixture.load_build(2000, bound), CacheOutcome::Hit);
    pause();
    assert_eq!(fixture.load_build(2003, bound), CacheOutcome::Compiled);
    assert_eq!(fixture.load_build(2000, bound), CacheOutcome::Hit);
    assert_eq!(
        fixture.load_build(2001, bound),
        CacheOutcome::Compiled,
        "evicted"
    );
}

#[test]
fn eviction_removes_only_what_the_cache_named_itself() {
    let fixture = Fixture::new();
    let dir = fixture.dir.path();
    let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    let aged = |name: &str| {
        let path = dir.join(name);
        std::fs::write(&path, vec![0u8; 4096]).expect("write");
        std::fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(two_hours_ago))
            .expect("age it");
        path
    };
    // Another program's files in a shared directory, old and large.
    let foreign = [
        aged("other.cwasm"),
        aged(".tmp-someone-elses"),
        aged(&format!("{}-{}.cwasm.bak", "a".repeat(64), "b".repeat(16))),
    ];
    // A temporary file of this cache that a crashed write left.
    let crashed = aged(".dexa-entry-crashed");
    assert_eq!(fixture.load_build(4000, u64::MAX), CacheOutcome::Compiled);
    let (_, one) = entries(dir);
    for n in 4001..4005 {
        assert_eq!(fixture.load_build(n, one + one / 2), CacheOutcome::Compiled);
    }
    for path in &foreign {
        assert!(path.exists(), "{} was removed", path.display());
    }
    assert!(
        !crashed.exists(),
        "a stale temporary file of the cache stays"
    );
    assert!(dir.join(super::key::KEY_FILE).exists(), "the key stays");
    assert_eq!(entries(dir).0.len(), 1);
}

#[test]
fn an_entry_alone_over_the_bound_is_kept_and_runs() {
    let fixture = Fixture::new();
    assert_eq!(fixture.load_build(3000, 1), CacheOutcome::Compiled);
    assert_eq!(fixture.load_build(3000, 1), CacheOutcome::Hit);
    assert_eq!(fixture.load_build(3001, 1), CacheOutcome::Compiled);
    let (found, _) = entries(fixture.dir.path());
    assert_eq!(found.len(), 1, "only the newest: {found:?}");
}
