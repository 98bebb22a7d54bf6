//! `[components.NAME]`: a component's file, its grants (directories,
//! environment variables, outbound HTTP and TCP) and its limits.

use std::collections::BTreeMap;

use super::locator::{check_name, Locator};
use super::parse::{Paths, Roles};
use super::raw::{RawComponent, RawConfig};
use super::{ComponentConfig, ComponentRole, ConfigError};
use crate::plugin::{DirGrant, HttpAuthority};

/// Every component of the file. One that no agent uses is checked as a
/// tool.
pub(super) fn components(
    raw: &RawConfig,
    roles: &Roles<'_>,
    paths: &Paths,
    loc: &Locator<'_>,
) -> Result<BTreeMap<String, ComponentConfig>, ConfigError> {
    let mut components = BTreeMap::new();
    for (name, component) in &raw.components {
        check_name(name, "component").map_err(|m| loc.at(component.span(), m))?;
        let role = roles
            .get(name.as_str())
            .map(|(role, _)| *role)
            .unwrap_or(ComponentRole::Tool);
        let config = component_config(name, component.get_ref(), role, paths, loc)?;
        components.insert(name.clone(), config);
    }
    Ok(components)
}

fn component_config(
    name: &str,
    raw: &RawComponent,
    role: ComponentRole,
    paths: &Paths,
    loc: &Locator<'_>,
) -> Result<ComponentConfig, ConfigError> {
    let mut dirs = Vec::new();
    let mut create_dirs = Vec::new();
    for dir in &raw.dirs {
        let grant = dir.get_ref();
        if !grant.guest.starts_with('/') {
            return Err(loc.at(
                dir.span(),
                format!("guest path {:?} must be absolute", grant.guest),
            ));
        }
        if dirs.iter().any(|d: &DirGrant| d.guest_path == grant.guest) {
            return Err(loc.at(
                dir.span(),
                format!("guest path {:?} is granted twice", grant.guest),
            ));
        }
        if grant.create {
            create_dirs.push(paths.resolve(&grant.host));
        }
        dirs.push(DirGrant {
            host_path: paths.resolve(&grant.host),
            guest_path: grant.guest.clone(),
            access: grant.access,
            shared: grant.shared,
            resolved: false,
        });
    }
    for var in &raw.env {
        if var.get_ref().is_empty() || var.get_ref().contains('=') {
            return Err(loc.at(
                var.span(),
                format!("environment variable name {:?} is invalid", var.get_ref()),
            ));
        }
    }
    let mut http = Vec::new();
    for authority in &raw.http {
        http.push(
            HttpAuthority::parse(authority.get_ref()).map_err(|m| loc.at(authority.span(), m))?,
        );
    }
    let mut tcp_connect = Vec::new();
    for addr in &raw.tcp_connect {
        tcp_connect.push(addr.get_ref().parse().map_err(|_| {
            loc.at(
                addr.span(),
                format!(
                    "tcp_connect {:?} must be an IP address and port, like \"127.0.0.1:5432\"",
                    addr.get_ref()
                ),
            )
        })?);
    }
    let limits = loc.limits(&raw.limits)?;
    Ok(ComponentConfig {
        name: name.to_string(),
        path: paths.resolve(raw.path.get_ref()),
        role,
        dirs,
        create_dirs,
        env: raw.env.iter().map(|v| v.get_ref().clone()).collect(),
        config: raw.config.clone(),
        http,
        tcp_connect,
        limits,
    })
}
