//! The component catalog's storage rules, run against every store backend
//! (SQLite and PostgreSQL): idempotent adds by digest, activations that
//! refuse an unknown digest and leave the log unchanged, the log read from
//! a sequence number, removal that keeps the log and never takes a version
//! activated after the log the gc read, an activation refused when its
//! role's log moved since it was decided, and how `dexa.toml`'s
//! bootstrap activates only a file it never named before.

use std::sync::Arc;

use dexa::catalog::{
    ActivateIf, ActivationMode, CatalogError, CatalogStore, ComponentRecord, NewActivation,
    RoleStates, CONFIG_ACTOR, RUNNER_ROLE,
};
use dexa::store::sqlite::{SqliteOptions, SqliteStore};

trait CatalogFactory {
    fn open(&self, dir: &std::path::Path) -> Arc<dyn CatalogStore>;
}

struct SqliteFactory;

impl CatalogFactory for SqliteFactory {
    fn open(&self, dir: &std::path::Path) -> Arc<dyn CatalogStore> {
        Arc::new(
            SqliteStore::open(dir.join("catalog.sqlite"), SqliteOptions::default())
                .unwrap_or_else(|err| panic!("{err}")),
        )
    }
}

struct PostgresFactory;

impl CatalogFactory for PostgresFactory {
    fn open(&self, dir: &std::path::Path) -> Arc<dyn CatalogStore> {
        Arc::new(dexa_tests::toy::open_postgres(dir))
    }
}

fn record(digest: &str, added_by: &str) -> ComponentRecord {
    ComponentRecord {
        digest: digest.to_string(),
        world: "runner".into(),
        wit_package: "dex:agents@0.2.0".into(),
        tools: Vec::new(),
        size: 3,
        added_at: 0,
        added_by: added_by.into(),
    }
}

fn activation(digest: &str, actor: &str) -> NewActivation {
    NewActivation {
        agent: "A".into(),
        role: RUNNER_ROLE.into(),
        digest: digest.into(),
        mode: ActivationMode::Current,
        upgrade_in_flight: false,
        actor: actor.into(),
        reason: String::new(),
        after_seq: None,
    }
}

async fn adding_is_idempotent_by_digest_and_the_first_record_stays(factory: &dyn CatalogFactory) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    assert!(catalog
        .add_component(record("d1", "alice"), b"one".to_vec())
        .await
        .unwrap());
    assert!(!catalog
        .add_component(record("d1", "bob"), b"two".to_vec())
        .await
        .unwrap());
    let stored = catalog.component("d1").await.unwrap().unwrap();
    assert_eq!(stored.added_by, "alice");
    assert!(stored.added_at > 0, "the store's clock stamps it");
    assert_eq!(
        catalog.component_bytes("d1").await.unwrap().as_deref(),
        Some(&b"one"[..])
    );
    assert_eq!(catalog.list_components().await.unwrap().len(), 1);
    assert_eq!(catalog.component("d2").await.unwrap(), None);
    assert_eq!(catalog.component_bytes("d2").await.unwrap(), None);
}

async fn an_activation_of_an_unknown_digest_is_refused_and_the_log_is_unchanged(
    factory: &dyn CatalogFactory,
) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    let refused = catalog
        .activate(activation("nope", "alice"), ActivateIf::Always)
        .await;
    assert!(
        matches!(&refused, Err(CatalogError::NoSuchComponent { digest }) if digest == "nope"),
        "{refused:?}"
    );
    assert!(catalog.activations(None).await.unwrap().is_empty());
}

async fn the_log_is_append_only_and_read_from_a_sequence_number(factory: &dyn CatalogFactory) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    for digest in ["d1", "d2"] {
        catalog
            .add_component(record(digest, "a"), b"x".to_vec())
            .await
            .unwrap();
    }
    let first = catalog
        .activate(activation("d1", "alice"), ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    let mut ramp = activation("d2", "bob");
    ramp.mode = ActivationMode::Ramp(10);
    let second = catalog
        .activate(ramp, ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    assert!(second.seq > first.seq);
    let after = catalog.activations_after(first.seq).await.unwrap();
    assert_eq!(after, vec![second.clone()]);
    assert!(catalog
        .activations_after(second.seq)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(catalog.activations(Some("other")).await.unwrap(), vec![]);
    let states = RoleStates::from_log(&catalog.activations(Some("A")).await.unwrap());
    let role = states.role("A", RUNNER_ROLE).unwrap();
    assert_eq!(role.current.as_deref(), Some("d1"));
    assert_eq!(role.ramp, Some(("d2".to_string(), 10)));
    // Removing a version keeps the log that names it.
    assert_eq!(
        catalog
            .remove_components(&["d2".to_string()], second.seq)
            .await
            .unwrap(),
        vec!["d2".to_string()]
    );
    assert_eq!(catalog.activations(None).await.unwrap().len(), 2);
    assert_eq!(catalog.component("d2").await.unwrap(), None);
}

async fn the_config_activates_a_version_only_the_first_time_it_names_it(
    factory: &dyn CatalogFactory,
) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    for digest in ["file1", "explicit", "file2"] {
        catalog
            .add_component(record(digest, "a"), b"x".to_vec())
            .await
            .unwrap();
    }
    let config =
        |digest| catalog.activate(activation(digest, CONFIG_ACTOR), ActivateIf::ConfigChanged);
    assert!(
        config("file1").await.unwrap().is_some(),
        "the first file of a role"
    );
    assert!(
        config("file1").await.unwrap().is_none(),
        "the same file again"
    );
    catalog
        .activate(activation("explicit", "alice"), ActivateIf::Always)
        .await
        .unwrap();
    assert!(
        config("file1").await.unwrap().is_none(),
        "the explicit one stands"
    );
    let changed = config("file2").await.unwrap().unwrap();
    assert_eq!(
        (changed.digest.as_str(), changed.actor.as_str()),
        ("file2", CONFIG_ACTOR)
    );
    assert!(config("file2").await.unwrap().is_none());
    // A worker still on the first file (a rolling deploy) restarts: the
    // config named it before, so the newer file stays active, even once a
    // gc has removed the first file's version.
    assert!(config("file1").await.unwrap().is_none());
    catalog
        .remove_components(&["file1".to_string()], i64::MAX)
        .await
        .unwrap();
    assert!(config("file1").await.unwrap().is_none());
    let log = catalog.activations(Some("A")).await.unwrap();
    assert_eq!(
        RoleStates::from_log(&log)
            .role("A", RUNNER_ROLE)
            .and_then(|r| r.current.clone())
            .as_deref(),
        Some("file2")
    );
}

async fn an_explicit_activation_before_any_start_is_kept_by_the_first_start(
    factory: &dyn CatalogFactory,
) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    for digest in ["file1", "explicit", "file2"] {
        catalog
            .add_component(record(digest, "a"), b"x".to_vec())
            .await
            .unwrap();
    }
    catalog
        .activate(activation("explicit", "alice"), ActivateIf::Always)
        .await
        .unwrap();
    let first_start = catalog
        .activate(activation("file1", CONFIG_ACTOR), ActivateIf::ConfigChanged)
        .await
        .unwrap();
    assert!(first_start.is_none(), "{first_start:?}");
    // The file was noted: a later change of it is activated.
    let changed = catalog
        .activate(activation("file2", CONFIG_ACTOR), ActivateIf::ConfigChanged)
        .await
        .unwrap();
    assert!(changed.is_some());
}

async fn a_removal_keeps_a_version_activated_after_the_log_it_was_decided_on(
    factory: &dyn CatalogFactory,
) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    for digest in ["old", "new", "idle"] {
        catalog
            .add_component(record(digest, "a"), b"x".to_vec())
            .await
            .unwrap();
    }
    let seen = catalog
        .activate(activation("new", "alice"), ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    // A gc read the log up to `seen` and found `old` unused; an operator
    // then rolls back to it before the gc removes anything.
    catalog
        .activate(activation("old", "bob"), ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    let removed = catalog
        .remove_components(&["old".to_string(), "idle".to_string()], seen.seq)
        .await
        .unwrap();
    assert_eq!(removed, vec!["idle".to_string()]);
    assert!(catalog.component_bytes("old").await.unwrap().is_some());
    // And once the gc has removed a version, activating it is refused.
    let refused = catalog
        .activate(activation("idle", "carol"), ActivateIf::Always)
        .await;
    assert!(
        matches!(&refused, Err(CatalogError::NoSuchComponent { .. })),
        "{refused:?}"
    );
}

async fn an_activation_decided_on_an_older_log_of_its_role_is_refused(
    factory: &dyn CatalogFactory,
) {
    let dir = tempfile::tempdir().unwrap();
    let catalog = factory.open(dir.path());
    for digest in ["d1", "d2"] {
        catalog
            .add_component(record(digest, "a"), b"x".to_vec())
            .await
            .unwrap();
    }
    let expecting = |digest: &str, after_seq: i64| NewActivation {
        after_seq: Some(after_seq),
        ..activation(digest, "alice")
    };
    let first = catalog
        .activate(expecting("d1", 0), ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    // Another role's activation does not move this role's log.
    let other_role = NewActivation {
        role: "some-tool".into(),
        ..activation("d2", "carol")
    };
    catalog
        .activate(other_role, ActivateIf::Always)
        .await
        .unwrap();
    // Bob activates d2 while Alice's rollback to d1 is decided on `first`.
    let second = catalog
        .activate(activation("d2", "bob"), ActivateIf::Always)
        .await
        .unwrap()
        .unwrap();
    let refused = catalog
        .activate(expecting("d1", first.seq), ActivateIf::Always)
        .await;
    assert!(
        matches!(&refused, Err(CatalogError::Moved { expected, found, .. })
            if *expected == first.seq && *found == second.seq),
        "{refused:?}"
    );
    assert_eq!(catalog.activations(Some("A")).await.unwrap().len(), 3);
    assert!(catalog
        .activate(expecting("d1", second.seq), ActivateIf::Always)
        .await
        .unwrap()
        .is_some());
}

macro_rules! backends {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(&super::SqliteFactory).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(&super::PostgresFactory).await;
                }
            )*
        }
    };
}

backends!(
    adding_is_idempotent_by_digest_and_the_first_record_stays,
    an_activation_of_an_unknown_digest_is_refused_and_the_log_is_unchanged,
    the_log_is_append_only_and_read_from_a_sequence_number,
    the_config_activates_a_version_only_the_first_time_it_names_it,
    an_explicit_activation_before_any_start_is_kept_by_the_first_start,
    a_removal_keeps_a_version_activated_after_the_log_it_was_decided_on,
    an_activation_decided_on_an_older_log_of_its_role_is_refused,
);
