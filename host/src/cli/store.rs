//! `dexa store`: operations on the store itself: migrate its schema, copy
//! a SQLite deployment into PostgreSQL.

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
    /// Copy a stopped SQLite deployment into a PostgreSQL store: every
    /// session with its state, messages, events, history, timers and leases,
    /// and the component catalog. Refuses a non-empty target unless
    /// --replace; checks every table's row count at the end.
    Copy(CopyArgs),
}

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// The source: sqlite:PATH (or a bare path). Stop its workers first.
    pub from: String,
    /// The target: postgres://...
    pub to: String,
    /// Empty a non-empty target first (everything in it is lost). Stop the
    /// target's workers too: the copy holds its tables for its whole run.
    #[arg(long)]
    pub replace: bool,
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
        StoreCommand::Copy(args) => copy(args).await,
    }
}

async fn copy(args: CopyArgs) -> anyhow::Result<()> {
    let source = args
        .from
        .strip_prefix("sqlite://")
        .or_else(|| args.from.strip_prefix("sqlite:"))
        .unwrap_or(&args.from);
    if source.contains("://") {
        anyhow::bail!(
            "{}: the source must be a SQLite store (sqlite:PATH)",
            args.from
        );
    }
    if !(args.to.starts_with("postgres://") || args.to.starts_with("postgresql://")) {
        anyhow::bail!("{}: the target must be a postgres:// store", args.to);
    }
    let target = PostgresUrl::parse(&args.to).map_err(anyhow::Error::msg)?;
    tracing::info!("copying {source} into {}", args.to);
    let report = crate::store::copy::sqlite_to_postgres(
        std::path::Path::new(source),
        target,
        args.replace,
        &|table, rows| tracing::info!(table, rows, "  {table}: {rows} rows"),
    )
    .await?;
    let total: u64 = report.tables.iter().map(|(_, rows)| rows).sum();
    println!(
        "copied {total} rows in {} tables; every table's count matches",
        report.tables.len()
    );
    Ok(())
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
