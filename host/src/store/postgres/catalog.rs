//! The component catalog on PostgreSQL: `components` (records and bytes),
//! the `activations` log and `config_versions`.
//!
//! Activations and removals take the `activations` table in a mode that
//! excludes each other (reads go on): sequence numbers then commit in
//! order, so a worker reading "after seq N" never misses one committed
//! later below it, and a gc never removes a version an activation is
//! naming at that moment.

use async_trait::async_trait;
use deadpool_postgres::GenericClient;

use super::sql::{execute, query, query_one, query_opt, retrying, TxResult};
use super::PostgresStore;
use crate::catalog::{
    ActivateIf, Activation, ActivationMode, CatalogError, CatalogStore, ComponentRecord,
    NewActivation,
};
use crate::flow::{StoreError, StoreMillis};
use crate::store::rows::{to_activation, to_record, ACTIVATION_COLUMNS};

const LOCK_LOG: &str = "LOCK TABLE activations IN SHARE ROW EXCLUSIVE MODE";

fn activation_row(row: &tokio_postgres::Row) -> Result<Activation, StoreError> {
    let seq: i64 = row.get(0);
    let percent: Option<i64> = row.get(5);
    let percent = percent
        .map(|p| {
            u8::try_from(p).map_err(|_| StoreError::Corrupt(format!("activation {seq} has {p} %")))
        })
        .transpose()?;
    to_activation(
        Activation {
            seq,
            agent: row.get(1),
            role: row.get(2),
            digest: row.get(3),
            mode: ActivationMode::Current,
            upgrade_in_flight: row.get(6),
            actor: row.get(7),
            reason: row.get(8),
            at: row.get(9),
        },
        row.get(4),
        percent,
    )
}

/// Records the version `dexa.toml` names now and says whether to activate
/// it (the rule is the SQLite backend's, documented there).
async fn config_changed<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    activation: &NewActivation,
) -> TxResult<bool, CatalogError> {
    let named = execute(
        tx,
        "INSERT INTO config_versions (agent, role, digest, at_ms) VALUES ($1, $2, $3, $4)
         ON CONFLICT (agent, role, digest) DO NOTHING",
        &[
            &activation.agent,
            &activation.role,
            &activation.digest,
            &now,
        ],
    )
    .await?;
    if named == 0 {
        return Ok(false);
    }
    let others = query_opt(
        tx,
        "SELECT 1 FROM config_versions WHERE agent = $1 AND role = $2 AND digest <> $3 LIMIT 1",
        &[&activation.agent, &activation.role, &activation.digest],
    )
    .await?;
    if others.is_some() {
        return Ok(true);
    }
    let activated = query_opt(
        tx,
        "SELECT 1 FROM activations WHERE agent = $1 AND role = $2 LIMIT 1",
        &[&activation.agent, &activation.role],
    )
    .await?;
    Ok(activated.is_none())
}

async fn append<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    activation: &NewActivation,
    only_if: ActivateIf,
) -> TxResult<Option<Activation>, CatalogError> {
    execute(tx, LOCK_LOG, &[]).await?;
    if only_if == ActivateIf::ConfigChanged {
        let named = query_opt(
            tx,
            "SELECT 1 FROM config_versions WHERE agent = $1 AND role = $2 AND digest = $3",
            &[&activation.agent, &activation.role, &activation.digest],
        )
        .await?;
        if named.is_some() {
            return Ok(None);
        }
    }
    let known = query_opt(
        tx,
        "SELECT 1 FROM components WHERE digest = $1",
        &[&activation.digest],
    )
    .await?;
    if known.is_none() {
        return Err(super::sql::TxError::Other(CatalogError::NoSuchComponent {
            digest: activation.digest.clone(),
        }));
    }
    if let Some(expected) = activation.after_seq {
        let found: i64 = query_one(
            tx,
            "SELECT COALESCE(MAX(seq), 0) FROM activations WHERE agent = $1 AND role = $2",
            &[&activation.agent, &activation.role],
        )
        .await?
        .get(0);
        if found != expected {
            return Err(super::sql::TxError::Other(CatalogError::Moved {
                agent: activation.agent.clone(),
                role: activation.role.clone(),
                expected,
                found,
            }));
        }
    }
    if only_if == ActivateIf::ConfigChanged && !config_changed(tx, now, activation).await? {
        return Ok(None);
    }
    let (mode, percent) = match activation.mode {
        ActivationMode::Current => ("current", None),
        ActivationMode::Ramp(percent) => ("ramp", Some(i64::from(percent))),
    };
    let seq: i64 = query_one(
        tx,
        "INSERT INTO activations (agent, role, digest, mode, percent, upgrade_in_flight, actor,
            reason, at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING seq",
        &[
            &activation.agent,
            &activation.role,
            &activation.digest,
            &mode,
            &percent,
            &activation.upgrade_in_flight,
            &activation.actor,
            &activation.reason,
            &now,
        ],
    )
    .await?
    .get(0);
    Ok(Some(Activation {
        seq,
        agent: activation.agent.clone(),
        role: activation.role.clone(),
        digest: activation.digest.clone(),
        mode: activation.mode,
        upgrade_in_flight: activation.upgrade_in_flight,
        actor: activation.actor.clone(),
        reason: activation.reason.clone(),
        at: now,
    }))
}

#[async_trait]
impl CatalogStore for PostgresStore {
    async fn add_component(
        &self,
        mut record: ComponentRecord,
        bytes: Vec<u8>,
    ) -> Result<bool, StoreError> {
        record.added_at = self.clock_now();
        let text = serde_json::to_string(&record)
            .map_err(|err| StoreError::Corrupt(format!("a component record: {err}")))?;
        let (record, text, bytes) = (&record, &text, &bytes);
        retrying(|| async move {
            let client = self.client().await?;
            let added = execute(
                &client,
                "INSERT INTO components (digest, record, bytes) VALUES ($1, $2, $3)
                 ON CONFLICT (digest) DO NOTHING",
                &[&record.digest, text, bytes],
            )
            .await?;
            Ok(added == 1)
        })
        .await
    }

    async fn component(&self, digest: &str) -> Result<Option<ComponentRecord>, StoreError> {
        retrying(|| async move {
            let client = self.client().await?;
            let row = query_opt(
                &client,
                "SELECT record FROM components WHERE digest = $1",
                &[&digest],
            )
            .await?;
            Ok(row.map(|row| to_record(digest, row.get(0))).transpose()?)
        })
        .await
    }

    async fn component_bytes(&self, digest: &str) -> Result<Option<Vec<u8>>, StoreError> {
        retrying(|| async move {
            let client = self.client().await?;
            let row = query_opt(
                &client,
                "SELECT bytes FROM components WHERE digest = $1",
                &[&digest],
            )
            .await?;
            Ok(row.map(|row| row.get(0)))
        })
        .await
    }

    async fn list_components(&self) -> Result<Vec<ComponentRecord>, StoreError> {
        retrying(|| async move {
            let client = self.client().await?;
            let rows = query(&client, "SELECT digest, record FROM components", &[]).await?;
            let mut records = rows
                .iter()
                .map(|row| to_record(row.get(0), row.get(1)))
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
        retrying(|| async move {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            execute(&tx, LOCK_LOG, &[]).await?;
            let mut removed = Vec::new();
            for digest in digests {
                let deleted = execute(
                    &tx,
                    "DELETE FROM components WHERE digest = $1 AND NOT EXISTS
                       (SELECT 1 FROM activations WHERE digest = $1 AND seq > $2)",
                    &[digest, &seen_seq],
                )
                .await?;
                if deleted == 1 {
                    removed.push(digest.clone());
                }
            }
            tx.commit().await?;
            Ok(removed)
        })
        .await
    }

    async fn activate(
        &self,
        activation: NewActivation,
        only_if: ActivateIf,
    ) -> Result<Option<Activation>, CatalogError> {
        let activation = &activation;
        retrying(|| async move {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let appended = append(&tx, self.clock_now(), activation, only_if).await?;
            tx.commit().await?;
            Ok(appended)
        })
        .await
    }

    async fn activations(&self, agent: Option<&str>) -> Result<Vec<Activation>, StoreError> {
        retrying(|| async move {
            let client = self.client().await?;
            let rows = query(
                &client,
                &format!(
                    "SELECT {ACTIVATION_COLUMNS} FROM activations
                     WHERE ($1::text IS NULL OR agent = $1) ORDER BY seq"
                ),
                &[&agent],
            )
            .await?;
            Ok(rows
                .iter()
                .map(activation_row)
                .collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }

    async fn activations_after(&self, seq: i64) -> Result<Vec<Activation>, StoreError> {
        retrying(|| async move {
            let client = self.client().await?;
            let rows = query(
                &client,
                &format!(
                    "SELECT {ACTIVATION_COLUMNS} FROM activations WHERE seq > $1 ORDER BY seq"
                ),
                &[&seq],
            )
            .await?;
            Ok(rows
                .iter()
                .map(activation_row)
                .collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }
}
