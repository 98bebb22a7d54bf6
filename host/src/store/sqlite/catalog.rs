//! The component catalog on SQLite: the `components` table (records and
//! bytes) and the `activations` log.

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};

use super::sql::{backend, cached_execute, cached_query_row};
use super::{SqliteStore, WriteKind};
use crate::catalog::{
    ActivateIf, Activation, ActivationMode, CatalogError, CatalogStore, ComponentRecord,
    NewActivation,
};
use crate::flow::{StoreError, StoreMillis};
use crate::store::rows::{to_activation, to_record, ACTIVATION_COLUMNS};

fn activation_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(Activation, String, Option<u8>)> {
    Ok((
        Activation {
            seq: row.get(0)?,
            agent: row.get(1)?,
            role: row.get(2)?,
            digest: row.get(3)?,
            mode: ActivationMode::Current,
            upgrade_in_flight: row.get(6)?,
            actor: row.get(7)?,
            reason: row.get(8)?,
            at: row.get(9)?,
        },
        row.get(4)?,
        row.get(5)?,
    ))
}

fn query_activations(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<Activation>, StoreError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt
        .query_map(params, activation_row)?
        .collect::<Result<Vec<_>, _>>()?;
    rows.into_iter()
        .map(|(activation, mode, percent)| to_activation(activation, mode, percent))
        .collect()
}

/// Records the version `dexa.toml` names for the role now, and says whether
/// it is to be activated: when the config has never named it before, except
/// that the first one a store sees stands back for a role already activated
/// explicitly. A version the config named once is never activated by it
/// again, so a worker that restarts with an older `dexa.toml` during a
/// rolling deploy does not undo the newer file's activation.
fn config_changed(
    conn: &Connection,
    now: StoreMillis,
    activation: &NewActivation,
) -> Result<bool, StoreError> {
    let named = cached_execute(
        conn,
        "INSERT INTO config_versions (agent, role, digest, at_ms) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (agent, role, digest) DO NOTHING",
        params![activation.agent, activation.role, activation.digest, now],
    )?;
    if named == 0 {
        return Ok(false);
    }
    let others = cached_query_row(
        conn,
        "SELECT 1 FROM config_versions WHERE agent = ?1 AND role = ?2 AND digest <> ?3 LIMIT 1",
        params![activation.agent, activation.role, activation.digest],
        |_| Ok(()),
    )
    .optional()?;
    if others.is_some() {
        return Ok(true);
    }
    let activated = cached_query_row(
        conn,
        "SELECT 1 FROM activations WHERE agent = ?1 AND role = ?2 LIMIT 1",
        params![activation.agent, activation.role],
        |_| Ok(()),
    )
    .optional()?;
    Ok(activated.is_none())
}

/// Whether `dexa.toml` named this version of the role before.
fn named_before(conn: &Connection, activation: &NewActivation) -> Result<bool, StoreError> {
    let named = cached_query_row(
        conn,
        "SELECT 1 FROM config_versions WHERE agent = ?1 AND role = ?2 AND digest = ?3",
        params![activation.agent, activation.role, activation.digest],
        |_| Ok(()),
    )
    .optional()?;
    Ok(named.is_some())
}

/// Appends `activation` unless `only_if` holds it back; the caller's
/// transaction makes the check and the append one step. (Its error type is
/// [`CatalogError`], which takes a [`StoreError`] but not a rusqlite error:
/// hence `map_err(backend)` on its queries.)
fn append(
    conn: &Connection,
    now: StoreMillis,
    activation: NewActivation,
    only_if: ActivateIf,
) -> Result<Option<Activation>, CatalogError> {
    // A version the config named before is left alone, even if a gc has
    // removed it since (a worker restarted on an older dexa.toml).
    if only_if == ActivateIf::ConfigChanged && named_before(conn, &activation)? {
        return Ok(None);
    }
    let known = cached_query_row(
        conn,
        "SELECT 1 FROM components WHERE digest = ?1",
        params![activation.digest],
        |_| Ok(()),
    )
    .optional()
    .map_err(backend)?;
    if known.is_none() {
        return Err(CatalogError::NoSuchComponent {
            digest: activation.digest,
        });
    }
    if let Some(expected) = activation.after_seq {
        let found: i64 = cached_query_row(
            conn,
            "SELECT COALESCE(MAX(seq), 0) FROM activations WHERE agent = ?1 AND role = ?2",
            params![activation.agent, activation.role],
            |row| row.get(0),
        )
        .map_err(backend)?;
        if found != expected {
            return Err(CatalogError::Moved {
                agent: activation.agent,
                role: activation.role,
                expected,
                found,
            });
        }
    }
    if only_if == ActivateIf::ConfigChanged && !config_changed(conn, now, &activation)? {
        return Ok(None);
    }
    let (mode, percent) = match activation.mode {
        ActivationMode::Current => ("current", None),
        ActivationMode::Ramp(percent) => ("ramp", Some(percent)),
    };
    cached_execute(
        conn,
        "INSERT INTO activations (agent, role, digest, mode, percent, upgrade_in_flight, actor, reason, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            activation.agent,
            activation.role,
            activation.digest,
            mode,
            percent,
            activation.upgrade_in_flight,
            activation.actor,
            activation.reason,
            now
        ],
    )
    .map_err(backend)?;
    Ok(Some(Activation {
        seq: conn.last_insert_rowid(),
        agent: activation.agent,
        role: activation.role,
        digest: activation.digest,
        mode: activation.mode,
        upgrade_in_flight: activation.upgrade_in_flight,
        actor: activation.actor,
        reason: activation.reason,
        at: now,
    }))
}

#[async_trait]
impl CatalogStore for SqliteStore {
    async fn add_component(
        &self,
        mut record: ComponentRecord,
        bytes: Vec<u8>,
    ) -> Result<bool, StoreError> {
        self.write_quietly(move |conn, now| {
            record.added_at = now;
            let text = serde_json::to_string(&record)
                .map_err(|err| StoreError::Corrupt(format!("a component record: {err}")))?;
            let added = cached_execute(
                conn,
                "INSERT INTO components (digest, record, bytes) VALUES (?1, ?2, ?3)
                 ON CONFLICT (digest) DO NOTHING",
                params![record.digest, text, bytes],
            )?;
            Ok(added == 1)
        })
        .await
    }

    async fn component(&self, digest: &str) -> Result<Option<ComponentRecord>, StoreError> {
        let digest = digest.to_string();
        self.read(move |conn, _| {
            let text: Option<String> = cached_query_row(
                conn,
                "SELECT record FROM components WHERE digest = ?1",
                params![digest],
                |row| row.get(0),
            )
            .optional()?;
            text.map(|text| to_record(&digest, text)).transpose()
        })
        .await
    }

    async fn component_bytes(&self, digest: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let digest = digest.to_string();
        self.read_blocking(move |conn, _| {
            Ok(cached_query_row(
                conn,
                "SELECT bytes FROM components WHERE digest = ?1",
                params![digest],
                |row| row.get(0),
            )
            .optional()?)
        })
        .await
    }

    async fn list_components(&self) -> Result<Vec<ComponentRecord>, StoreError> {
        self.read_blocking(|conn, _| {
            let mut stmt = conn.prepare_cached("SELECT digest, record FROM components")?;
            let rows = stmt
                .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            let mut records = rows
                .into_iter()
                .map(|(digest, text)| to_record(&digest, text))
                .collect::<Result<Vec<_>, _>>()?;
            records.sort_by_key(|r| (r.added_at, r.digest.clone()));
            Ok(records)
        })
        .await
    }

    async fn remove_components(
        &self,
        digests: &[String],
        seen_seq: i64,
    ) -> Result<Vec<String>, StoreError> {
        let digests = digests.to_vec();
        self.write_quietly(move |conn, _| {
            let mut removed = Vec::new();
            for digest in digests {
                let deleted = cached_execute(
                    conn,
                    "DELETE FROM components WHERE digest = ?1 AND NOT EXISTS
                       (SELECT 1 FROM activations WHERE digest = ?1 AND seq > ?2)",
                    params![digest, seen_seq],
                )?;
                if deleted == 1 {
                    removed.push(digest);
                }
            }
            Ok(removed)
        })
        .await
    }

    async fn activate(
        &self,
        activation: NewActivation,
        only_if: ActivateIf,
    ) -> Result<Option<Activation>, CatalogError> {
        self.write_job(WriteKind::QUIET, move |conn, now| {
            append(conn, now, activation, only_if)
        })
        .await
    }

    async fn activations(&self, agent: Option<&str>) -> Result<Vec<Activation>, StoreError> {
        let agent = agent.map(str::to_string);
        self.read(move |conn, _| match agent {
            Some(agent) => query_activations(
                conn,
                &format!(
                    "SELECT {ACTIVATION_COLUMNS} FROM activations WHERE agent = ?1 ORDER BY seq"
                ),
                params![agent],
            ),
            None => query_activations(
                conn,
                &format!("SELECT {ACTIVATION_COLUMNS} FROM activations ORDER BY seq"),
                [],
            ),
        })
        .await
    }

    async fn activations_after(&self, seq: i64) -> Result<Vec<Activation>, StoreError> {
        self.read(move |conn, _| {
            query_activations(
                conn,
                &format!(
                    "SELECT {ACTIVATION_COLUMNS} FROM activations WHERE seq > ?1 ORDER BY seq"
                ),
                params![seq],
            )
        })
        .await
    }
}
