//! `postgres://` store addresses: what dexa reads from them itself (where
//! the password comes from, TLS verification, the pool size, a schema) and
//! what it hands to `tokio-postgres`.
//!
//! A password never comes from the address: `dexa.toml` is configuration
//! that gets committed and shown. It comes from `password_env=NAME` (an
//! environment variable), `password_file=PATH`, or else `PGPASSWORD`.

use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio_postgres::config::SslMode;

/// How the server's certificate is checked when TLS is used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsVerify {
    /// `sslmode=prefer|require` without `sslrootcert`: encrypted, the
    /// certificate not checked (what libpq does for these modes).
    None,
    /// `sslmode=verify-full`: checked against `sslrootcert`, or else the
    /// Mozilla roots.
    Full { root_cert: Option<String> },
}

/// A parsed `postgres://` address.
#[derive(Clone, Debug)]
pub struct PostgresUrl {
    /// The address as written (it holds no password).
    pub text: String,
    /// What `tokio-postgres` connects with, password included.
    pub config: tokio_postgres::Config,
    pub verify: TlsVerify,
    /// Connections in the pool.
    pub pool_size: usize,
    /// The schema the tables live in (`search_path`), if not the default.
    pub schema: Option<String>,
    /// Where the password came from, for error messages.
    pub password_source: Option<String>,
}

const OWN_KEYS: [&str; 5] = [
    "password_env",
    "password_file",
    "sslrootcert",
    "pool_size",
    "schema",
];

impl PostgresUrl {
    /// Parses `text` and reads the password from where it says. Errors are
    /// one sentence each, fit for a `dexa.toml` error.
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::parse_with(text, |name| std::env::var(name).ok())
    }

    /// [`Self::parse`] with the environment given (for tests).
    pub fn parse_with(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        // Every error shows the address with any password masked.
        let shown = redact(text);
        let shown = shown.as_str();
        if !(text.starts_with("postgres://") || text.starts_with("postgresql://")) {
            return Err(format!(
                "store {shown:?}: a PostgreSQL store starts with postgres://"
            ));
        }
        let (base, query) = match text.split_once('?') {
            Some((base, query)) => (base, query),
            None => (text, ""),
        };
        let mut passed = Vec::new();
        let mut own = std::collections::BTreeMap::new();
        let mut sslmode = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("store {shown:?}: parameter {pair:?} has no value"))?;
            if key == "password" {
                return Err(password_refused(shown));
            }
            if key == "sslmode" {
                sslmode = Some(value.to_string());
            } else if OWN_KEYS.contains(&key) {
                if own.insert(key, value.to_string()).is_some() {
                    return Err(format!("store {shown:?}: {key} is given twice"));
                }
            } else {
                passed.push(pair);
            }
        }
        let verify = match sslmode.as_deref() {
            None | Some("disable") | Some("prefer") | Some("require") => {
                match own.get("sslrootcert") {
                    // libpq checks the certificate when a root is named.
                    Some(root) => TlsVerify::Full {
                        root_cert: Some(root.clone()),
                    },
                    None => TlsVerify::None,
                }
            }
            Some("verify-full") | Some("verify-ca") => TlsVerify::Full {
                root_cert: own.get("sslrootcert").cloned(),
            },
            Some(other) => {
                return Err(format!(
                    "store {shown:?}: sslmode must be disable, prefer, require or verify-full, not {other:?}"
                ))
            }
        };
        let mode = match sslmode.as_deref() {
            Some("disable") => SslMode::Disable,
            Some("require") | Some("verify-full") | Some("verify-ca") => SslMode::Require,
            _ => SslMode::Prefer,
        };
        let handed = if passed.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", passed.join("&"))
        };
        let mut config =
            tokio_postgres::Config::from_str(&handed).map_err(
                |err| match std::error::Error::source(&err) {
                    Some(source) => format!("store {shown:?}: {err}: {source}"),
                    None => format!("store {shown:?}: {err}"),
                },
            )?;
        if config.get_password().is_some() {
            return Err(password_refused(shown));
        }
        config.ssl_mode(mode);
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(std::time::Duration::from_secs(5));
        }
        if config.get_application_name().is_none() {
            config.application_name("dexa");
        }
        let pool_size = match own.get("pool_size") {
            Some(size) => size
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=1024).contains(n))
                .ok_or_else(|| format!("store {shown:?}: pool_size must be 1 to 1024"))?,
            None => 16,
        };
        let schema = own.get("schema").cloned();
        if let Some(schema) = &schema {
            let plain = !schema.is_empty()
                && schema.len() <= 48
                && schema
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && !schema.starts_with(|c: char| c.is_ascii_digit());
            if !plain {
                return Err(format!(
                    "store {shown:?}: schema must be 1 to 48 lowercase letters, digits or '_'"
                ));
            }
        }
        // A transaction left open by a process that stopped (a machine cut
        // off mid-commit) would hold its flow's lock for as long as TCP
        // takes to notice: the server ends it after a minute instead, and a
        // lock wait gives up (and retries) after ten seconds.
        // Notices ("schema already exists, skipping") are not for the log.
        let mut options = "-c idle_in_transaction_session_timeout=60000 -c lock_timeout=10000 \
                           -c client_min_messages=warning"
            .to_string();
        if let Some(schema) = &schema {
            options.push_str(&format!(" -c search_path={schema}"));
        }
        config.options(options);
        config.keepalives_idle(std::time::Duration::from_secs(30));
        let password_source = match (own.get("password_env"), own.get("password_file")) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "store {shown:?}: give password_env or password_file, not both"
                ))
            }
            (Some(name), None) => {
                let value = env(name).ok_or_else(|| {
                    format!(
                        "store {shown:?}: the environment variable {name} (password_env) is not set"
                    )
                })?;
                config.password(value);
                Some(format!("${name}"))
            }
            (None, Some(path)) => {
                let value = std::fs::read_to_string(path).map_err(|err| {
                    format!("store {shown:?}: cannot read the password file {path}: {err}")
                })?;
                config.password(value.trim_end_matches(['\n', '\r']));
                Some(path.clone())
            }
            (None, None) => env("PGPASSWORD").map(|value| {
                config.password(value);
                "$PGPASSWORD".to_string()
            }),
        };
        Ok(Self {
            text: text.to_string(),
            config,
            verify,
            pool_size,
            schema,
            password_source,
        })
    }

    /// The TLS connector for this address.
    pub fn tls(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("TLS: {err}"))?;
        let config = match &self.verify {
            TlsVerify::None => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
                .with_no_client_auth(),
            TlsVerify::Full { root_cert } => {
                let mut roots = rustls::RootCertStore::empty();
                match root_cert {
                    Some(path) => {
                        let pem = std::fs::read(path)
                            .map_err(|err| format!("cannot read sslrootcert {path}: {err}"))?;
                        for cert in CertificateDer::pem_slice_iter(&pem) {
                            let cert = cert.map_err(|err| format!("sslrootcert {path}: {err}"))?;
                            roots
                                .add(cert)
                                .map_err(|err| format!("sslrootcert {path}: {err}"))?;
                        }
                        if roots.is_empty() {
                            return Err(format!("sslrootcert {path} holds no certificate"));
                        }
                    }
                    None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
        };
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
    }
}

/// `text` with the password of its user part and any `password=` value
/// replaced by `***`.
pub fn redact(text: &str) -> String {
    let (base, query) = match text.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (text, None),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) => match user.split_once(':') {
                Some((name, _)) => format!("{scheme}://{name}:***@{host}"),
                None => base.to_string(),
            },
            None => base.to_string(),
        },
        None => base.to_string(),
    };
    match query {
        Some(query) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some(("password", _)) => "password=***".to_string(),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{base}?{}", pairs.join("&"))
        }
        None => base,
    }
}

fn password_refused(text: &str) -> String {
    format!(
        "store {text:?}: a password does not belong in the store address; put it in an \
         environment variable (password_env=NAME, or PGPASSWORD) or a file (password_file=PATH)"
    )
}

/// `sslmode=require`: the connection is encrypted, the certificate is not
/// checked (libpq's meaning of the mode); signatures still are, so the
/// handshake itself is sound.
#[derive(Debug)]
struct Unverified(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn a_password_in_the_address_is_refused() {
        for text in [
            "postgres://dexa:secret@db/dexa",
            "postgres://dexa@db/dexa?password=secret",
        ] {
            let err = PostgresUrl::parse_with(text, no_env)
                .map(|_| ())
                .unwrap_err();
            assert!(err.contains("does not belong"), "{err}");
        }
    }

    #[test]
    fn the_password_comes_from_the_named_variable() {
        let url = PostgresUrl::parse_with(
            "postgres://dexa@db:5433/dexa?password_env=DB_PW&sslmode=require&pool_size=4",
            |name| (name == "DB_PW").then(|| "pw".to_string()),
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(url.config.get_password(), Some(&b"pw"[..]));
        assert_eq!(url.config.get_ssl_mode(), SslMode::Require);
        assert_eq!(url.verify, TlsVerify::None);
        assert_eq!(url.pool_size, 4);
        assert_eq!(url.password_source.as_deref(), Some("$DB_PW"));
        let missing = PostgresUrl::parse_with("postgres://dexa@db/dexa?password_env=DB_PW", no_env)
            .map(|_| ())
            .unwrap_err();
        assert!(
            missing.contains("DB_PW (password_env) is not set"),
            "{missing}"
        );
    }

    #[test]
    fn the_password_comes_from_the_named_file_without_its_newline() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let file = dir.path().join("pw");
        std::fs::write(&file, "s3cret\n").unwrap_or_else(|err| panic!("{err}"));
        let text = format!("postgres://dexa@db/dexa?password_file={}", file.display());
        let url = PostgresUrl::parse_with(&text, no_env).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(url.config.get_password(), Some(&b"s3cret"[..]));
        let missing = format!(
            "postgres://dexa@db/dexa?password_file={}/nope",
            dir.path().display()
        );
        let err = PostgresUrl::parse_with(&missing, no_env)
            .map(|_| ())
            .unwrap_err();
        assert!(err.contains("cannot read the password file"), "{err}");
        // PGPASSWORD is the fallback when neither is named.
        let url = PostgresUrl::parse_with("postgres://dexa@db/dexa", |name| {
            (name == "PGPASSWORD").then(|| "from-env".to_string())
        })
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(url.config.get_password(), Some(&b"from-env"[..]));
    }

    #[test]
    fn bad_parameters_are_named() {
        for (text, expected) in [
            ("postgres://db/x?sslmode=always", "sslmode must be"),
            ("postgres://db/x?pool_size=0", "pool_size must be"),
            ("postgres://db/x?schema=Robert');DROP", "schema must be"),
            ("postgres://db/x?bogus=1", "unknown option"),
            (
                "postgres://db/x?password_env=A&password_file=/b",
                "not both",
            ),
        ] {
            let err = PostgresUrl::parse_with(text, no_env)
                .map(|_| ())
                .unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn verify_full_checks_against_the_named_root() {
        let url = PostgresUrl::parse_with(
            "postgres://db/x?sslmode=verify-full&sslrootcert=/etc/ca.pem",
            no_env,
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            url.verify,
            TlsVerify::Full {
                root_cert: Some("/etc/ca.pem".to_string())
            }
        );
        assert_eq!(url.config.get_ssl_mode(), SslMode::Require);
    }
}
