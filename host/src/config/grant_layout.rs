//! The directory grants of all the components a worker loads, checked
//! together: no component may be able to change what another sees, and none
//! may reach dexa's own state (see [`crate::plugin::grant_paths`]).

use std::path::PathBuf;

use super::{DexaConfig, StoreUrl};
use crate::plugin::grant_paths::{canonical_root, check_overlaps, check_state_paths, GrantSet};
use crate::plugin::ComponentSettings;

/// Refuses overlapping grants (unless both are `shared`) and grants that
/// hold the store, the API token, the `.dexa` directory or the artifact
/// cache. Runs after the `create = true` directories exist.
pub(super) fn check(config: &DexaConfig, all: &[ComponentSettings]) -> anyhow::Result<()> {
    let mut canonical = Vec::with_capacity(all.len());
    let mut configured = Vec::with_capacity(all.len());
    for settings in all {
        let mut dirs = settings.grants.dirs.clone();
        for grant in &mut dirs {
            grant.host_path = canonical_root(grant)
                .map_err(|err| config.error(format!("component {:?}: {err}", settings.name)))?;
        }
        configured.push(
            settings
                .grants
                .dirs
                .iter()
                .map(|grant| grant.host_path.clone())
                .collect::<Vec<_>>(),
        );
        canonical.push(dirs);
    }
    let sets: Vec<GrantSet<'_>> = all
        .iter()
        .zip(&canonical)
        .map(|(settings, dirs)| GrantSet {
            component: &settings.name,
            dirs,
        })
        .collect();
    check_overlaps(&sets, &configured).map_err(|err| config.error(err))?;
    let state = state_paths(config);
    for set in &sets {
        check_state_paths(set.component, set.dirs, &state, Some(&config.cache_dir))
            .map_err(|err| config.error(err))?;
    }
    Ok(())
}

/// What dexa keeps for itself next to the config: the `.dexa` directory
/// (the generated API token lives there), the store and the cache.
fn state_paths(config: &DexaConfig) -> Vec<PathBuf> {
    let mut paths = vec![config.local_dir(), config.cache_dir.clone()];
    match &config.store {
        StoreUrl::Sqlite(path, _) => paths.push(path.clone()),
    }
    paths
}
