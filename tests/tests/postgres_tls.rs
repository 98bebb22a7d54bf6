//! TLS to PostgreSQL, against a cluster of the test's own that accepts TLS
//! connections only: `sslmode=require` encrypts (as a managed database
//! needs), `verify-full` checks the certificate against `sslrootcert` and
//! refuses one it cannot check, and `disable` is refused by the server.

use dexa::store::postgres::{PostgresStore, PostgresUrl};
use dexa_tests::pg_cluster::Cluster;

async fn connect(address: &str) -> Result<PostgresStore, String> {
    let url = PostgresUrl::parse(address)?;
    PostgresStore::connect(url)
        .await
        .map_err(|err| err.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_and_verify_full_connect_and_a_plain_or_unverifiable_one_does_not() {
    let cluster = Cluster::start_tls();
    let base = format!("{}?schema=tls", cluster.url);

    // The server refuses every connection without TLS, so a store that
    // opens (schema created, listener up) went through TLS.
    connect(&format!("{base}&sslmode=require"))
        .await
        .unwrap_or_else(|err| panic!("sslmode=require: {err}"));
    connect(&base)
        .await
        .unwrap_or_else(|err| panic!("the default (prefer) takes TLS when offered: {err}"));
    let ca = cluster.ca_cert();
    connect(&format!(
        "{base}&sslmode=verify-full&sslrootcert={}",
        ca.display()
    ))
    .await
    .unwrap_or_else(|err| panic!("verify-full against the test CA: {err}"));

    let unverifiable = connect(&format!("{base}&sslmode=verify-full"))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        unverifiable.to_lowercase().contains("certificate"),
        "the Mozilla roots do not know the test CA: {unverifiable}"
    );
    let plain = connect(&format!("{base}&sslmode=disable"))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(plain.contains("no encryption"), "{plain}");
}
