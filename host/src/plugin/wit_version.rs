//! Which version of `dex:agents` a component was built against. A component
//! built against another version would fail to link with a message about a
//! missing import; this check names both versions instead, so an operator
//! knows to rebuild rather than to hunt for a bug.

use wasmtime::component::Component;
use wasmtime::Engine;

use super::error::LoadError;

/// The WIT package this host implements.
pub const WIT_PACKAGE: &str = "dex:agents@0.2.0";
/// Its version alone.
pub const WIT_VERSION: &str = "0.2.0";

/// The `dex:agents` version an import name carries, if it is one of ours:
/// `dex:agents/events@0.1.0` gives `0.1.0`; an unversioned name gives "".
fn dex_version(import: &str) -> Option<&str> {
    let rest = import.strip_prefix("dex:agents/")?;
    Some(rest.split_once('@').map_or("", |(_, version)| version))
}

/// Whether a guest's version can be linked by this host's, by semver: the
/// same major version, and for 0.x the same minor (0.2.0 and 0.2.1 are one
/// track, 0.1 and 0.2 are not). Within a track the linker decides the rest.
fn compatible(found: &str) -> bool {
    let track = |version: &str| -> Option<(u64, u64)> {
        let mut parts = version.split('.');
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        Some((major, minor))
    };
    match (track(found), track(WIT_VERSION)) {
        (Some((major, minor)), Some((host_major, host_minor))) => {
            major == host_major && (major > 0 || minor == host_minor)
        }
        _ => false,
    }
}

/// Refuses a component whose `dex:agents` imports are of another version.
/// A component that imports nothing of ours (a tool that writes no events)
/// runs under any version.
pub(crate) fn check_imports(
    engine: &Engine,
    name: &str,
    component: &Component,
) -> Result<(), LoadError> {
    let other = component
        .component_type()
        .imports(engine)
        .find_map(|(import, _)| {
            dex_version(import)
                .filter(|v| !compatible(v))
                .map(str::to_string)
        });
    match other {
        None => Ok(()),
        Some(found) => Err(LoadError::WitVersion {
            name: name.to_string(),
            found: if found.is_empty() {
                "(no version)".to_string()
            } else {
                found
            },
            wanted: WIT_VERSION,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_imports_carry_a_version_we_check() {
        assert_eq!(dex_version("dex:agents/events@0.1.0"), Some("0.1.0"));
        assert_eq!(dex_version("dex:agents/step@0.2.0"), Some("0.2.0"));
        assert_eq!(dex_version("dex:agents/step"), Some(""));
        assert_eq!(dex_version("wasi:cli/stdout@0.2.6"), None);
        assert_eq!(dex_version("dex:agentsx/step@0.1.0"), None);
    }

    #[test]
    fn a_version_on_the_hosts_track_is_left_to_the_linker() {
        assert!(compatible("0.2.0"));
        assert!(compatible("0.2.7"));
        assert!(!compatible("0.1.0"));
        assert!(!compatible("0.3.0"));
        assert!(!compatible("1.2.0"));
        assert!(!compatible(""));
        assert!(!compatible("banana"));
    }
}
