//! Activating a version: verify it for its role (it compiles, matches its
//! world, is pre-instantiated and, for a tool, answers `list-tools` with
//! tools no other tool component of the agent serves), add it to the
//! catalog, and append one entry to the activation log. A refusal names the
//! digest and the reason, and the log does not change.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use tokio::sync::Semaphore;

use super::versions::{role_component, runner_record, tool_record};
use super::DexaConfig;
use crate::catalog::{
    short_digest, ActivateIf, Activation, ActivationMode, AgentVersions, CatalogError,
    CatalogStore, ComponentRecord, NewActivation, RoleStates, RUNNER_ROLE,
};
use crate::plugin::cache::sha256_hex;
use crate::plugin::{ComponentSettings, LoadError, RunnerComponent, SandboxEngine, ToolComponent};

/// How many verifications run at once in one process. A verification runs
/// to its end even when the request that asked for it goes away, so this
/// bounds what a client that uploads and hangs up can make a server do.
const CONCURRENT_VERIFICATIONS: usize = 2;

/// The longest reason an activation records (it is kept in the log and
/// shown by every versions report).
pub const MAX_REASON_BYTES: usize = 1024;

fn verifications() -> Arc<Semaphore> {
    static PERMITS: OnceLock<Arc<Semaphore>> = OnceLock::new();
    PERMITS
        .get_or_init(|| Arc::new(Semaphore::new(CONCURRENT_VERIFICATIONS)))
        .clone()
}

/// Runs `load` on a blocking thread once a verification permit is free
/// (compiling, or checking a cached artifact, is CPU work of up to seconds,
/// and `dexa serve` answers other requests meanwhile).
async fn verify_off_thread<T: Send + 'static>(
    digest: &str,
    load: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ActivationRefused> {
    let stopped =
        |err: &dyn std::fmt::Display| refuse(Some(digest), format!("verification stopped: {err}"));
    let permit = verifications()
        .acquire_owned()
        .await
        .map_err(|err| stopped(&err))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        load()
    })
    .await
    .map_err(|err| stopped(&err))
}

/// Loads `wasm` as a runner off the runtime's threads; hands the bytes back.
async fn load_runner_off_thread(
    engine: &SandboxEngine,
    digest: &str,
    wasm: Vec<u8>,
    settings: ComponentSettings,
) -> Result<(Result<RunnerComponent, LoadError>, Vec<u8>), ActivationRefused> {
    let engine = engine.clone();
    verify_off_thread(digest, move || (engine.load_runner(&wasm, settings), wasm)).await
}

/// Loads `wasm` as a tool component (and asks it for its tools) off the
/// runtime's threads; hands the bytes back.
async fn load_tool_off_thread(
    engine: &SandboxEngine,
    digest: &str,
    wasm: Vec<u8>,
    settings: ComponentSettings,
) -> Result<(Result<ToolComponent, LoadError>, Vec<u8>), ActivationRefused> {
    let engine = engine.clone();
    let runtime = tokio::runtime::Handle::current();
    verify_off_thread(digest, move || {
        let tool = runtime.block_on(engine.load_tool(&wasm, settings));
        (tool, wasm)
    })
    .await
}

/// What an activation names: a file to add, or a version already added.
#[derive(Clone, Debug)]
pub enum VersionSource {
    File(std::path::PathBuf),
    Digest(String),
}

impl VersionSource {
    /// A digest is 64 hex digits; anything else is a path.
    pub fn parse(text: &str) -> Self {
        if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            VersionSource::Digest(text.to_ascii_lowercase())
        } else {
            VersionSource::File(text.into())
        }
    }
}

/// Why an activation was refused. The active version did not change.
#[derive(Debug, thiserror::Error)]
#[error("activation refused: {reason}")]
pub struct ActivationRefused {
    pub digest: Option<String>,
    pub reason: String,
    /// The log changed since the request was decided (a rollback raced
    /// another activation): nothing is wrong with the version.
    pub log_moved: bool,
}

fn refuse(digest: Option<&str>, reason: impl Into<String>) -> ActivationRefused {
    let reason = reason.into();
    ActivationRefused {
        reason: match digest {
            Some(digest) => format!("component {digest}: {reason}"),
            None => reason,
        },
        digest: digest.map(str::to_string),
        log_moved: false,
    }
}

/// One activation asked for.
#[derive(Clone, Debug)]
pub struct ActivationRequest {
    pub agent: String,
    /// [`RUNNER_ROLE`] or a tool component's name.
    pub role: String,
    pub source: VersionSource,
    pub mode: ActivationMode,
    pub upgrade_in_flight: bool,
    pub actor: String,
    pub reason: String,
    /// See [`NewActivation::after_seq`]: a rollback's, from
    /// [`rollback_request`].
    pub after_seq: Option<i64>,
}

/// Verifies `wasm` for `role` (it compiles, matches its world, is
/// pre-instantiated and, for a tool, answers `list-tools` with tools no other
/// tool component of the agent serves), then adds it to the catalog. Returns
/// its record.
pub async fn verify_and_add(
    config: &DexaConfig,
    engine: &SandboxEngine,
    catalog: &dyn CatalogStore,
    agent: &str,
    role: &str,
    wasm: Vec<u8>,
    actor: &str,
) -> Result<ComponentRecord, ActivationRefused> {
    let digest = sha256_hex(&wasm);
    let component = role_component(config, agent, role).map_err(|r| refuse(Some(&digest), r))?;
    let settings = super::deploy::settings(config, component)
        .map_err(|err| refuse(Some(&digest), format!("{err:#}")))?;
    let (record, wasm) = if role == RUNNER_ROLE {
        let (runner, wasm) = load_runner_off_thread(engine, &digest, wasm, settings).await?;
        let runner = runner.map_err(|err| refuse(Some(&digest), err.to_string()))?;
        (runner_record(&runner, wasm.len(), actor), wasm)
    } else {
        let (tool, wasm) = load_tool_off_thread(engine, &digest, wasm, settings).await?;
        let tool = tool.map_err(|err| refuse(Some(&digest), err.to_string()))?;
        let record = tool_record(&tool, wasm.len(), actor);
        check_collisions(config, catalog, agent, role, &record).await?;
        (record, wasm)
    };
    catalog
        .add_component(record.clone(), wasm)
        .await
        .map_err(|err| refuse(Some(&digest), format!("the store refused it: {err}")))?;
    Ok(record)
}

/// Refuses a tool version that serves a tool another tool component of the
/// agent serves in any version active now.
async fn check_collisions(
    config: &DexaConfig,
    catalog: &dyn CatalogStore,
    agent: &str,
    role: &str,
    record: &ComponentRecord,
) -> Result<(), ActivationRefused> {
    let digest = record.digest.as_str();
    let unavailable = |err| refuse(Some(digest), format!("the catalog is unreadable: {err}"));
    let states = RoleStates::from_log(
        &catalog
            .activations(Some(agent))
            .await
            .map_err(unavailable)?,
    );
    let others = config
        .agents
        .get(agent)
        .map(|a| {
            a.tools
                .iter()
                .filter(|t| *t != role)
                .cloned()
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for other in others {
        let Some(state) = states.role(agent, &other) else {
            continue;
        };
        for active in state.active() {
            let Some(theirs) = catalog.component(active).await.map_err(unavailable)? else {
                continue;
            };
            for tool in &record.tools {
                if theirs.tools.iter().any(|t| t.name == tool.name) {
                    return Err(refuse(
                        Some(digest),
                        format!(
                            "its tool {:?} is also served by tool component {other:?} (version {})",
                            tool.name,
                            short_digest(active)
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

fn read_file(path: &Path) -> Result<Vec<u8>, ActivationRefused> {
    std::fs::read(path)
        .map_err(|err| refuse(None, format!("cannot read {}: {err}", path.display())))
}

/// Verifies and activates a version: the log gains one entry, or, refused,
/// nothing changes.
pub async fn activate(
    config: &DexaConfig,
    engine: &SandboxEngine,
    catalog: &dyn CatalogStore,
    request: ActivationRequest,
) -> Result<Activation, ActivationRefused> {
    if request.reason.len() > MAX_REASON_BYTES {
        return Err(refuse(
            None,
            format!(
                "the reason is {} bytes; at most {MAX_REASON_BYTES} are kept",
                request.reason.len()
            ),
        ));
    }
    let wasm = match &request.source {
        VersionSource::File(path) => read_file(path)?,
        VersionSource::Digest(digest) => match catalog.component_bytes(digest).await {
            Ok(Some(bytes)) if sha256_hex(&bytes) == *digest => bytes,
            Ok(Some(_)) => {
                return Err(refuse(
                    Some(digest),
                    "its stored bytes hash to another digest: the registry is corrupt",
                ))
            }
            Ok(None) => return Err(refuse(Some(digest), "it is not in the registry")),
            Err(err) => return Err(refuse(Some(digest), format!("the store: {err}"))),
        },
    };
    let record = verify_and_add(
        config,
        engine,
        catalog,
        &request.agent,
        &request.role,
        wasm,
        &request.actor,
    )
    .await?;
    if request.upgrade_in_flight && request.role != RUNNER_ROLE {
        // A tool call keeps the version it was deferred with to its end;
        // only a turn's runner moves.
        return Err(refuse(
            Some(&record.digest),
            format!(
                "upgrade in flight moves open turns to a new runner; tool component {:?} has \
                 no turns to move (each tool call keeps the version it was deferred with)",
                request.role
            ),
        ));
    }
    activation_test_pause();
    let appended = catalog
        .activate(
            NewActivation {
                agent: request.agent,
                role: request.role,
                digest: record.digest.clone(),
                mode: request.mode,
                upgrade_in_flight: request.upgrade_in_flight,
                actor: request.actor,
                reason: request.reason,
                after_seq: request.after_seq,
            },
            ActivateIf::Always,
        )
        .await;
    match appended {
        Ok(Some(activation)) => Ok(activation),
        Ok(None) => Err(refuse(Some(&record.digest), "the log did not take it")),
        Err(CatalogError::NoSuchComponent { digest }) => Err(refuse(
            Some(&digest),
            "it left the registry before it was activated (a gc ran meanwhile); add it again",
        )),
        Err(moved @ CatalogError::Moved { .. }) => Err(ActivationRefused {
            log_moved: true,
            ..refuse(
                Some(&record.digest),
                format!(
                    "{moved}; look at `dexa agent versions` and roll back again if still needed"
                ),
            )
        }),
        Err(err) => Err(refuse(Some(&record.digest), err.to_string())),
    }
}

/// Test hook: with `DEXA_TEST_ACTIVATION_PAUSE=<file>` set, an activation
/// that has added its version waits here until `<file>` exists, so that a
/// test can SIGKILL it between the add and the log entry.
fn activation_test_pause() {
    let Some(gate) = std::env::var_os("DEXA_TEST_ACTIVATION_PAUSE") else {
        return;
    };
    let gate = std::path::PathBuf::from(gate);
    let _ = std::fs::write(gate.with_extension("reached"), b"");
    while !gate.exists() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Verifies `wasm` as a runner or a tool component (whichever world it
/// implements, with no grants) and adds it to the catalog, for activation
/// later by digest. Returns its record and whether it was new.
pub async fn add_component(
    engine: &SandboxEngine,
    catalog: &dyn CatalogStore,
    wasm: Vec<u8>,
    name: &str,
    actor: &str,
) -> Result<(ComponentRecord, bool), ActivationRefused> {
    let digest = sha256_hex(&wasm);
    let settings = ComponentSettings::named(name);
    let (runner, wasm) = load_runner_off_thread(engine, &digest, wasm, settings.clone()).await?;
    let (record, wasm) = match runner {
        Ok(runner) => (runner_record(&runner, wasm.len(), actor), wasm),
        Err(LoadError::WrongWorld { .. }) => {
            let (tool, wasm) = load_tool_off_thread(engine, &digest, wasm, settings).await?;
            let tool = tool.map_err(|err| refuse(Some(&digest), err.to_string()))?;
            (tool_record(&tool, wasm.len(), actor), wasm)
        }
        Err(err) => return Err(refuse(Some(&digest), err.to_string())),
    };
    let added = catalog
        .add_component(record.clone(), wasm)
        .await
        .map_err(|err| refuse(Some(&digest), format!("the store refused it: {err}")))?;
    Ok((record, added))
}

/// A rollback to decide: the version it activates, and the newest entry of
/// the role's log it was decided on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RollbackTarget {
    pub digest: String,
    /// The activation appends only while this is still the role's newest
    /// entry, so a rollback never undoes an activation it did not see.
    pub after_seq: i64,
}

/// A rollback of `role`: the activation of the version that was current
/// before (or, while a ramp stands, of the current one, ending the ramp).
pub async fn rollback_request(
    catalog: &dyn CatalogStore,
    agent: &str,
    role: &str,
) -> Result<RollbackTarget, ActivationRefused> {
    let log = catalog
        .activations(Some(agent))
        .await
        .map_err(|err| refuse(None, format!("the activation log is unreadable: {err}")))?;
    let states = RoleStates::from_log(&log);
    let state = states.role(agent, role);
    match (
        state.and_then(|s| s.rollback_target()),
        state.and_then(|s| s.last.as_ref()),
    ) {
        (Some(digest), Some(last)) => Ok(RollbackTarget {
            digest: digest.to_string(),
            after_seq: last.seq,
        }),
        _ => Err(refuse(
            None,
            format!("agent {agent:?} ({role}) has no earlier version to roll back to"),
        )),
    }
}

/// The reason a rollback records when none is given.
pub fn rollback_reason(target: &str, reason: String) -> String {
    if reason.trim().is_empty() {
        format!("rollback to {}", short_digest(target))
    } else {
        reason
    }
}

/// `agent`'s activation log and what each role takes now.
pub async fn versions_report(
    catalog: &dyn CatalogStore,
    agent: &str,
) -> Result<AgentVersions, crate::flow::StoreError> {
    let log = catalog.activations(Some(agent)).await?;
    Ok(AgentVersions::from_log(agent, log))
}
