//! Opening a PostgreSQL store: the pool, the schema check, the listener;
//! `dexa store migrate`; dropping a schema of the store's own.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

use super::listen::{self, Signals};
use super::url::PostgresUrl;
use super::{schema, Inner, PostgresStore};
use crate::flow::StoreError;

impl PostgresStore {
    /// Connects, creates the schema in an empty database and checks the
    /// version of an existing one: a newer one is refused, and so is an
    /// older one until `dexa store migrate` has run.
    pub async fn connect(url: PostgresUrl) -> Result<Self, StoreError> {
        let pool = pool(&url)?;
        {
            let mut client = pool.get().await.map_err(|err| {
                StoreError::Backend(format!(
                    "cannot connect to {}: {}",
                    url.text,
                    super::sql::chain(&err)
                ))
            })?;
            if let Some(schema) = &url.schema {
                schema::create_own(&client, schema).await?;
            }
            if let schema::SchemaState::Older(found) = schema::open(&mut client).await? {
                return Err(StoreError::Backend(format!(
                    "the PostgreSQL store has schema {found} and this dexa writes schema {}; \
                     run `dexa store migrate` first",
                    schema::SCHEMA_VERSION
                )));
            }
        }
        let schema = url.schema.as_deref().unwrap_or("public");
        let signals = Arc::new(Signals::for_schema(schema));
        let (clock, listener) = listen::start(url.clone(), signals.clone()).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                url,
                pool,
                signals,
                clock,
                listener,
            }),
        })
    }

    /// Applies the schema's migrations; returns the versions before and
    /// after.
    pub async fn migrate(url: &PostgresUrl) -> Result<(i64, i64), StoreError> {
        let pool = pool(url)?;
        let mut client = pool.get().await?;
        if let Some(schema) = &url.schema {
            schema::create_own(&client, schema).await?;
        }
        schema::migrate(&mut client).await
    }

    /// Drops this store's schema with everything in it (for benchmarks
    /// and tests that made one of their own); refused for a store in the
    /// default schema.
    pub async fn drop_schema(&self) -> Result<(), StoreError> {
        let Some(schema) = &self.inner.url.schema else {
            return Err(StoreError::Backend(
                "this store has no schema of its own to drop".to_string(),
            ));
        };
        let client = self.client().await?;
        schema::drop_own(&client, schema).await
    }
}

fn pool(url: &PostgresUrl) -> Result<Pool, StoreError> {
    let tls = url.tls().map_err(StoreError::Backend)?;
    let manager = Manager::from_config(
        url.config.clone(),
        tls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(url.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|err| StoreError::Backend(format!("the PostgreSQL pool: {err}")))
}
