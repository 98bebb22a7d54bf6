//! Capability grants of one component. A component with no grants sees no
//! files, no environment variables and no network; clocks and random numbers
//! are always available.
//!
//! Directory grants go through wasmtime-wasi's preopens, which resolve every
//! path with cap-std inside the granted directory: neither `..` nor a symlink
//! can leave it. The granted directory itself is resolved once, at load, and
//! opened on each call without following symlinks (see
//! [`super::grant_paths`]), so no one can redirect it later. Outbound HTTP goes through wasi:http and is checked against
//! an allow-list of `host:port` authorities (see [`super::factors::http`]).
//! Raw TCP is off unless exact socket addresses are granted; UDP and DNS
//! lookups are always off.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use super::guest_log::GuestLogPipe;
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder};

use super::grant_paths::{handle_path, open_root_no_follow, resolve_root};

/// Whether a granted directory may be changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirAccess {
    ReadOnly,
    ReadWrite,
}

/// A host directory, visible to the guest at `guest_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirGrant {
    /// Where it is on the host; canonical once the component is loaded.
    pub host_path: PathBuf,
    pub guest_path: String,
    pub access: DirAccess,
    /// The operator allows this grant to overlap other components' grants
    /// (see [`super::grant_paths::check_overlaps`]).
    pub shared: bool,
    /// `host_path` is already resolved and checked (by the deployment's
    /// layout check): loading verifies it without following symlinks again.
    pub resolved: bool,
}

/// Everything a component may reach beyond its own memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Grants {
    pub dirs: Vec<DirGrant>,
    /// Environment variables, by explicit name and value.
    pub env: Vec<(String, String)>,
    /// Where outbound wasi:http requests may go.
    pub http: Vec<HttpAuthority>,
    /// Addresses a raw TCP socket may connect to. Empty: no sockets at all.
    pub tcp_connect: Vec<SocketAddr>,
}

/// One allowed wasi:http destination: a host name or IP literal and a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpAuthority {
    /// Lowercase, without brackets for IPv6.
    pub host: String,
    pub port: u16,
}

impl HttpAuthority {
    /// Parses `host:port`; the port is required so a grant is never wider
    /// than it reads.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| format!("HTTP grant {text:?} must be host:port"))?;
        let bracketed = host.starts_with('[') && host.ends_with(']');
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.contains(':') && !bracketed {
            return Err(format!(
                "HTTP grant {text:?}: write an IPv6 host in brackets, like \"[::1]:8080\""
            ));
        }
        if host.is_empty() || host.contains(['/', '@', ' ', '*']) {
            return Err(format!("HTTP grant {text:?} has an invalid host"));
        }
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("HTTP grant {text:?} has an invalid port"))?;
        Ok(Self {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// Whether a request to `host` on `port` is covered by this grant.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.port == port
            && self
                .host
                .eq_ignore_ascii_case(host.trim_start_matches('[').trim_end_matches(']'))
    }
}

impl std::fmt::Display for HttpAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Grants {
    /// No capability at all.
    pub fn none() -> Self {
        Self::default()
    }

    /// Grants `host_path` at `guest_path`.
    pub fn dir(
        mut self,
        host_path: impl Into<PathBuf>,
        guest_path: impl Into<String>,
        access: DirAccess,
    ) -> Self {
        self.dirs.push(DirGrant {
            host_path: host_path.into(),
            guest_path: guest_path.into(),
            access,
            shared: false,
            resolved: false,
        });
        self
    }

    /// Grants one environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Allows outbound HTTP to `authority` (`host:port`).
    pub fn http(mut self, authority: HttpAuthority) -> Self {
        self.http.push(authority);
        self
    }

    /// Allows a raw TCP connection to `addr`.
    pub fn tcp_connect(mut self, addr: SocketAddr) -> Self {
        self.tcp_connect.push(addr);
        self
    }

    /// Checks what can be checked before any call: directories exist and guest
    /// paths are absolute and distinct.
    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::BTreeSet::new();
        for grant in &self.dirs {
            if !grant.guest_path.starts_with('/') {
                return Err(format!(
                    "guest path {:?} must be absolute",
                    grant.guest_path
                ));
            }
            if !seen.insert(grant.guest_path.as_str()) {
                return Err(format!(
                    "guest path {:?} is granted twice",
                    grant.guest_path
                ));
            }
            if !grant.host_path.is_dir() {
                return Err(format!(
                    "host directory {} does not exist",
                    grant.host_path.display()
                ));
            }
        }
        for (name, _) in &self.env {
            if name.is_empty() || name.contains('=') {
                return Err(format!("environment variable name {name:?} is invalid"));
            }
        }
        Ok(())
    }

    /// [`Self::validate`], then resolves each granted directory to its
    /// canonical path: the symlinks in the configured path are followed now,
    /// at load, and never again. A grant already `resolved` is only checked
    /// to open without following any symlink.
    pub fn resolve(&mut self) -> Result<(), String> {
        self.validate()?;
        for grant in &mut self.dirs {
            if grant.resolved {
                open_root_no_follow(&grant.host_path)?;
            } else {
                grant.host_path = resolve_root(&grant.host_path)?.root;
                grant.resolved = true;
            }
        }
        Ok(())
    }

    /// A fresh WASI context holding exactly these grants.
    pub(crate) fn wasi_ctx(
        &self,
        stdout: GuestLogPipe,
        stderr: GuestLogPipe,
    ) -> anyhow::Result<WasiCtx> {
        let mut builder = WasiCtxBuilder::new();
        builder.stdout(stdout).stderr(stderr);
        for grant in &self.dirs {
            let perms = match grant.access {
                DirAccess::ReadOnly => FsPerms::ReadOnly,
                DirAccess::ReadWrite => FsPerms::ReadWrite,
            };
            if !grant.host_path.is_absolute() {
                anyhow::bail!(
                    "granted directory {} was not resolved at load",
                    grant.host_path.display()
                );
            }
            // Opened by handle: the path is walked here without following a
            // symlink, and WASI opens the very directory this handle holds.
            let root = open_root_no_follow(&grant.host_path).map_err(anyhow::Error::msg)?;
            builder
                .preopened_dir(handle_path(&root), &grant.guest_path, perms)
                .map_err(|err| {
                    anyhow::anyhow!(
                        "cannot open granted directory {}: {err}",
                        grant.host_path.display()
                    )
                })?;
        }
        for (name, value) in &self.env {
            builder.env(name, value);
        }
        // wasmtime-wasi's defaults already deny these; say so here, where a
        // reader looks for what a guest may reach.
        builder
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .allow_tcp(!self.tcp_connect.is_empty());
        let allowed: Arc<[SocketAddr]> = self.tcp_connect.clone().into();
        builder.socket_addr_check(move |addr, usage| {
            let permitted = match usage {
                SocketAddrUse::TcpConnect => allowed.contains(&addr),
                // The implicit bind a connect performs: any local port.
                SocketAddrUse::TcpBind => addr.ip().is_unspecified() && addr.port() == 0,
                _ => false,
            };
            if !permitted {
                metrics::counter!(crate::telemetry::GRANTS_REFUSED, "kind" => "tcp").increment(1);
            }
            Box::pin(async move { permitted })
        });
        Ok(builder.build())
    }
}
