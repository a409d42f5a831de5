//! Connecting from a URL, TLS included, with errors that name the server and never a password.
//!
//! The URL's `sslmode` (`disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full`) and
//! `sslrootcert` (a PEM file of the certificate authorities to trust) are libpq's, read by sqlx;
//! TLS itself needs this crate's `tls` feature (sqlx's rustls support). `verify-full` is what a
//! managed Postgres should get: the server's certificate must chain to `sslrootcert` (or a public
//! root) and name the host connected to.

use std::str::FromStr;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

/// Why [`connect`] could not give a pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL cannot be read: a configuration error, retrying cannot help.
    #[error("the Postgres URL ({url}) is not valid: {reason}")]
    Url {
        /// The URL without its user and password.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS handshake failed: a certificate that does not chain to a trusted root or does not
    /// name the host, a missing root certificate file, or a server without TLS under
    /// `sslmode=require` or stricter. A configuration error: retrying cannot help.
    #[error("TLS to Postgres at {place} failed (sslmode={mode}): {reason}")]
    Tls {
        /// `host:port` as configured.
        place: String,
        /// The URL's `sslmode`.
        mode: String,
        /// The TLS library's reason.
        reason: String,
    },
    /// The server refused the credentials. Retrying cannot help.
    #[error("Postgres at {place} refused the login (sslmode={mode}): {reason}")]
    Refused {
        /// `host:port` as configured.
        place: String,
        /// The URL's `sslmode`.
        mode: String,
        /// The server's message.
        reason: String,
    },
    /// The server cannot be reached now (down, starting, out of connections): retrying may help.
    #[error("cannot connect to Postgres at {place} (sslmode={mode}): {reason}")]
    Unreachable {
        /// `host:port` as configured.
        place: String,
        /// The URL's `sslmode`.
        mode: String,
        /// Why.
        reason: String,
    },
}

impl ConnectError {
    /// Whether trying again later can help (the server may come up); a bad URL, certificate or
    /// password needs a change of configuration.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }
}

/// `url` without its user and password, for messages.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{}", &url[..s + 3], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// A pool on the Postgres at `url` (with `options`' limits), checked by opening its first
/// connection, so that a bad certificate or password is an error now rather than at the first
/// claim.
pub async fn connect(url: &str, options: PgPoolOptions) -> Result<PgPool, ConnectError> {
    let bad_url = |reason: String| ConnectError::Url {
        url: redact_url(url),
        reason,
    };
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(bad_url("it must start with postgres://".to_owned()));
    }
    // sqlx's parse errors quote no part of the URL; ours quote it redacted.
    let connect = PgConnectOptions::from_str(url).map_err(|e| bad_url(e.to_string()))?;
    let place = format!("{}:{}", connect.get_host(), connect.get_port());
    let mode = mode_name(connect.get_ssl_mode()).to_owned();
    options.connect_with(connect).await.map_err(|e| match e {
        // sqlx says only "No such file or directory": name the root certificate file.
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::NotFound => {
            match root_cert_path(url) {
                Some(path) => ConnectError::Tls {
                    place,
                    mode,
                    reason: format!(
                        "the root certificate file {path} (sslrootcert) cannot be read: {io}"
                    ),
                },
                None => classify_connect(sqlx::Error::Io(io), place, mode),
            }
        }
        e => classify_connect(e, place, mode),
    })
}

/// The `sslrootcert` the URL (or else `PGSSLROOTCERT`) names, for a message (as written in the
/// URL: sqlx has already read it).
fn root_cert_path(url: &str) -> Option<String> {
    let query = url.split_once('?').map(|(_, q)| q).unwrap_or_default();
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| matches!(*k, "sslrootcert" | "ssl-root-cert" | "ssl-ca"))
        .map(|(_, v)| v.to_owned())
        .or_else(|| std::env::var("PGSSLROOTCERT").ok())
        .filter(|p| !p.is_empty())
}

fn mode_name(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

fn classify_connect(e: sqlx::Error, place: String, mode: String) -> ConnectError {
    match e {
        sqlx::Error::Tls(source) => ConnectError::Tls {
            place,
            mode,
            reason: chain(&*source),
        },
        sqlx::Error::Database(db) => {
            // 28P01 invalid password, 28000 no pg_hba.conf entry or role: configuration.
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let reason = format!("{} ({code})", db.message());
            if code.starts_with("28") || code == "3D000" {
                ConnectError::Refused {
                    place,
                    mode,
                    reason,
                }
            } else {
                ConnectError::Unreachable {
                    place,
                    mode,
                    reason,
                }
            }
        }
        sqlx::Error::Io(io) if is_tls_failure(&io) => ConnectError::Tls {
            place,
            mode,
            reason: chain(&io),
        },
        other => ConnectError::Unreachable {
            place,
            mode,
            reason: chain(&other),
        },
    }
}

/// sqlx reports a certificate the client refused as an I/O error carrying rustls's error.
#[cfg(feature = "tls")]
fn is_tls_failure(io: &std::io::Error) -> bool {
    io.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
}

#[cfg(not(feature = "tls"))]
fn is_tls_failure(_: &std::io::Error) -> bool {
    false
}

/// An error with its sources, `a: b: c`.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        next = s.source();
    }
    out
}
