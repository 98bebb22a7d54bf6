//! A component built against another version of `dex:agents` is refused at
//! load with a message naming both versions and the way out, not with a
//! link error about a missing import.
//!
//! The old-version components are made from this release's own builds by
//! renaming the package version in their import names
//! ([`built_against`]): exactly what a guest built against 0.1.0 imports.

use dexa::plugin::{ComponentSettings, LoadError, WIT_PACKAGE};
use dexa_tests::versions::built_against;
use dexa_tests::{guest_bytes, test_engine};

fn assert_names_both_versions(err: &LoadError, name: &str) {
    assert!(matches!(err, LoadError::WitVersion { .. }), "{err:?}");
    let message = err.to_string();
    for part in [
        name,
        "dex:agents@0.1.0",
        WIT_PACKAGE,
        "rebuild it",
        "Upgrading a component to a new WIT version",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
}

#[tokio::test]
async fn a_tool_built_against_0_1_0_is_refused_with_both_versions_named() {
    let engine = test_engine();
    let old = built_against(&guest_bytes("tiny-tool"), "0.1.0");
    let err = match engine
        .load_tool(&old, ComponentSettings::named("old-tiny"))
        .await
    {
        Ok(_) => panic!("an old-version tool loaded"),
        Err(err) => err,
    };
    assert_names_both_versions(&err, "old-tiny");
    // The unpatched build of the same tool loads.
    engine
        .load_tool(&guest_bytes("tiny-tool"), ComponentSettings::named("tiny"))
        .await
        .unwrap_or_else(|err| panic!("{err}"));
}

#[tokio::test]
async fn a_runner_built_against_0_1_0_is_refused_with_both_versions_named() {
    let engine = test_engine();
    for guest in ["scripted-runner", "py-runner"] {
        let old = built_against(&guest_bytes(guest), "0.1.0");
        let err = match engine.load_runner(&old, ComponentSettings::named(guest)) {
            Ok(_) => panic!("{guest}: an old-version runner loaded"),
            Err(err) => err,
        };
        assert_names_both_versions(&err, guest);
    }
}
