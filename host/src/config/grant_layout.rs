//! The directory grants of all the components a worker loads, resolved once
//! and checked together: no component may be able to change what another
//! sees, and none may reach dexa's own state (see
//! [`crate::plugin::grant_paths`]).

use std::path::PathBuf;

use super::{DexaConfig, ModelConfig, StoreUrl};
use crate::plugin::grant_paths::{
    check_overlaps, check_state_paths, resolve_root, GrantSet, StatePaths,
};
use crate::plugin::ComponentSettings;

/// Resolves every grant of `all` to its canonical root (marking it
/// `resolved`, so that loading does not follow a symlink again), then
/// refuses the layouts [`check_overlaps`] and [`check_state_paths`] refuse.
/// Runs after the `create = true` directories exist.
pub(super) fn resolve_and_check(
    config: &DexaConfig,
    all: &mut [ComponentSettings],
) -> anyhow::Result<()> {
    let mut links = Vec::with_capacity(all.len());
    for settings in all.iter_mut() {
        let mut component_links = Vec::with_capacity(settings.grants.dirs.len());
        for grant in &mut settings.grants.dirs {
            let resolved = resolve_root(&grant.host_path)
                .map_err(|err| config.error(format!("component {:?}: {err}", settings.name)))?;
            grant.host_path = resolved.root;
            grant.resolved = true;
            component_links.push(resolved.links);
        }
        links.push(component_links);
    }
    let sets: Vec<GrantSet<'_>> = all
        .iter()
        .zip(&links)
        .map(|(settings, links)| GrantSet {
            component: &settings.name,
            dirs: &settings.grants.dirs,
            links,
        })
        .collect();
    check_overlaps(&sets).map_err(|err| config.error(err))?;
    let paths = state_paths(config);
    for set in &sets {
        check_state_paths(set.component, set.dirs, &paths).map_err(|err| config.error(err))?;
    }
    Ok(())
}

/// What dexa keeps for itself: the `.dexa` directory next to the config
/// (the generated API token lives there), the store and the cache; and the
/// code it runs: every component's file, the config, scripted answers.
fn state_paths(config: &DexaConfig) -> StatePaths {
    let mut state = vec![config.local_dir(), config.cache_dir.clone()];
    match &config.store {
        StoreUrl::Sqlite(path, _) => state.push(path.clone()),
        StoreUrl::Postgres(_) => {}
    }
    let mut code: Vec<PathBuf> = config.components.values().map(|c| c.path.clone()).collect();
    code.push(config.file.clone());
    for model in config.models.values() {
        if let ModelConfig::Scripted { responses, .. } = model {
            code.push(responses.clone());
        }
    }
    StatePaths {
        state,
        code,
        cache_dir: Some(config.cache_dir.clone()),
    }
}
