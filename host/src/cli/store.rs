//! `dexa store`: operations on the store itself.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::config::{DexaConfig, StoreUrl};
use crate::store::postgres::{schema::SCHEMA_VERSION, PostgresStore, PostgresUrl};

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// Apply the schema's migrations to a PostgreSQL store (a SQLite store
    /// migrates itself when opened). Safe to run again, and from several
    /// machines at once.
    Migrate(MigrateArgs),
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The store (`postgres://...`); default: the config's.
    pub store: Option<String>,
    /// The config file whose store to migrate.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
}

pub async fn run(command: StoreCommand) -> anyhow::Result<()> {
    match command {
        StoreCommand::Migrate(args) => migrate(args).await,
    }
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let address = match args.store {
        Some(address) => address,
        None => match DexaConfig::load(&args.config)?.store {
            StoreUrl::Postgres(address) => address,
            StoreUrl::Sqlite(path, _) => {
                println!(
                    "{} is a SQLite store: it migrates itself when opened; nothing to do",
                    path.display()
                );
                return Ok(());
            }
        },
    };
    if !(address.starts_with("postgres://") || address.starts_with("postgresql://")) {
        anyhow::bail!(
            "{address}: `dexa store migrate` takes a postgres:// store (a SQLite store migrates itself when opened)"
        );
    }
    let url = PostgresUrl::parse(&address).map_err(anyhow::Error::msg)?;
    let (before, after) = PostgresStore::migrate(&url).await?;
    if before == after {
        println!("{address}: schema {after}, up to date");
    } else if before == 0 {
        println!("{address}: created schema {after}");
    } else {
        println!("{address}: migrated schema {before} to {after}");
    }
    debug_assert_eq!(after, SCHEMA_VERSION);
    Ok(())
}
