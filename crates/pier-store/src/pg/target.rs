//! Where a PostgreSQL store lives and how pier reaches it: the URL, the password from
//! libpq's sources, and TLS.
//!
//! TLS follows the URL's `sslmode` as tokio-postgres reads it (`disable`; `prefer`, the
//! default, which falls back to plain text only when the server offers no TLS; `require`).
//! Whenever TLS is used the server's certificate chain and name are verified (rustls does
//! nothing less), against the system's roots and the CA file `sslrootcert` names (URL
//! parameter, or `PGSSLROOTCERT`). libpq's `verify-ca` and `verify-full` are therefore
//! accepted as `require`: what they ask is what pier always does. A Unix socket never
//! carries TLS (PostgreSQL declines it there), so local stores are unaffected.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio_postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::StoreError;

/// A store's connection settings and the TLS connector they use.
#[derive(Clone)]
pub(crate) struct Target {
    pub config: Config,
    pub tls: MakeRustlsConnect,
}

impl Target {
    /// The settings `url` names, with the password from `PGPASSWORD` or the passfile when
    /// the URL has none.
    pub fn parse(url: &str) -> Result<Target, StoreError> {
        let (plain, root) = tls_params(url);
        let mut config: Config =
            plain.parse().map_err(|e| StoreError::Db(format!("{} is not a PostgreSQL URL: {e}", redacted(url))))?;
        if config.get_password().is_none()
            && let Some(password) = password_for(&config)
        {
            config.password(password);
        }
        let root = root.or_else(|| std::env::var_os("PGSSLROOTCERT").map(PathBuf::from));
        // The system's roots are read only where TLS can happen: never over a Unix socket
        // (PostgreSQL declines it there) or with `sslmode=disable`.
        let tcp = config.get_hosts().iter().any(|h| matches!(h, tokio_postgres::config::Host::Tcp(_)));
        let system = tcp && config.get_ssl_mode() != tokio_postgres::config::SslMode::Disable;
        Ok(Target { config, tls: connector(root.as_deref(), system)? })
    }
}

/// The store's address without its password (in the user part or a `password` parameter),
/// for messages and logs.
pub fn redacted(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = match base.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((cred, host)) => {
                let user = cred.split(':').next().unwrap_or("");
                format!("{scheme}://{user}@{host}")
            }
            None => base.to_owned(),
        },
        None => base.to_owned(),
    };
    if let Some(query) = query {
        let kept: Vec<&str> = query.split('&').filter(|p| !p.starts_with("password=")).collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    out
}

/// What to do about a connection error TLS caused, if it did (no retry cures those).
pub(crate) fn tls_advice(error: &str) -> Option<&'static str> {
    if error.contains("certificate") || error.contains("UnknownIssuer") {
        Some(
            "name the server's CA with `sslrootcert=PATH` in the store URL (or PGSSLROOTCERT), or use \
             `sslmode=disable` on a network you trust",
        )
    } else if error.contains("does not support TLS") {
        Some("enable `ssl` on the server, or use `sslmode=prefer` (or `disable`) in the store URL")
    } else {
        None
    }
}

/// `url` without the TLS parameters tokio-postgres does not read (`sslrootcert`; `sslmode`
/// `verify-ca`/`verify-full`, which become `require`), and the CA file named.
fn tls_params(url: &str) -> (String, Option<PathBuf>) {
    let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None) };
    let mut root = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslrootcert", path)) => {
                root = Some(PathBuf::from(percent_encoding::percent_decode_str(path).decode_utf8_lossy().as_ref()))
            }
            Some(("sslmode", "verify-ca" | "verify-full")) => kept.push("sslmode=require".to_owned()),
            _ => kept.push(pair.to_owned()),
        }
    }
    let url = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    (url, root)
}

/// The system's trusted roots, read once per process.
fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::debug!(error = %e, "a system certificate could not be read");
        }
        found.certs
    })
}

/// A verifying connector: the system's roots (with `system`), and `root`'s certificates (PEM)
/// if named.
fn connector(root: Option<&Path>, system: bool) -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    if system {
        roots.add_parsable_certificates(system_roots().iter().cloned());
    }
    if let Some(path) = root {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| StoreError::Db(format!("cannot read the CA file {} (sslrootcert): {e}", path.display())))?;
        if certs.is_empty() {
            return Err(StoreError::Db(format!("the CA file {} (sslrootcert) holds no certificate", path.display())));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| {
                StoreError::Db(format!("a certificate in {} (sslrootcert) is not usable: {e}", path.display()))
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Db(format!("cannot set up TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

/// The password for `config` from `PGPASSWORD`, else from the passfile (`PGPASSFILE`, or
/// `~/.pgpass`), in libpq's format: `host:port:database:user:password`, `*` matching any.
fn password_for(config: &Config) -> Option<String> {
    if let Ok(p) = std::env::var("PGPASSWORD") {
        return Some(p);
    }
    let path = std::env::var_os("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pgpass")))?;
    let text = std::fs::read_to_string(path).ok()?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = config.get_user().unwrap_or_default().to_owned();
    let db = config.get_dbname().map_or_else(|| user.clone(), str::to_owned);
    let wanted = [host, port, db, user];
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let fields: Vec<&str> = line.splitn(5, ':').collect();
        let [h, p, d, u, password] = fields.as_slice() else { return None };
        let matches = [h, p, d, u].iter().zip(&wanted).all(|(f, w)| **f == "*" || *f == w);
        matches.then(|| password.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_tokio_postgres_does_not_read_are_taken_out() {
        assert_eq!(tls_params("postgres://u@h/db"), ("postgres://u@h/db".into(), None));
        assert_eq!(
            tls_params("postgres://u@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x"),
            ("postgres://u@h/db?sslmode=require&application_name=x".into(), Some(PathBuf::from("/etc/ca.pem")))
        );
        assert_eq!(
            tls_params("postgres://u@h/db?sslrootcert=ca.pem"),
            ("postgres://u@h/db".into(), Some("ca.pem".into()))
        );
    }

    #[test]
    fn a_password_never_shows() {
        assert_eq!(redacted("postgres://me:secret@db.example/pier"), "postgres://me@db.example/pier");
        assert_eq!(redacted("postgres://me@db.example/pier"), "postgres://me@db.example/pier");
        assert_eq!(
            redacted("postgres://me@db.example/pier?password=secret&sslmode=require"),
            "postgres://me@db.example/pier?sslmode=require"
        );
    }
}
