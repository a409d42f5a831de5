//! Connecting from a URL, TLS included, with errors that name the server and never a password.
//!
//! The URL's `sslmode` (`disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full`) and
//! `sslrootcert` (a PEM file of the certificate authorities to trust) are libpq's, read by sqlx;
//! TLS itself needs this crate's `tls` feature (sqlx's rustls support). `verify-full` is what a
//! managed Postgres should get: the server's certificate must chain to `sslrootcert` (or a public
//! root) and name the host connected to.
//!
//! `connect` gives a pool, checked by its first connection. `ConnectError` names `host:port` and
//! the mode, never the password, and tells a bad certificate or login from a server that is down.

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

/// What a redacted secret reads as.
const REDACTED: &str = "REDACTED";

/// `url` without its user and password, for messages: the user information goes, and the value
/// of every query parameter that names a password (`password`, `sslpassword`, any spelling or
/// percent-encoding of a name holding "password" or "passwd") reads `REDACTED`. Done on the raw
/// string, so a URL that does not parse (the one an error is about) is redacted as well; a
/// libpq keyword string (`host=db password=...`) gets its password values redacted too. Where
/// the text is ambiguous, more is removed rather than less.
pub fn redact_url(url: &str) -> String {
    if !url.contains("://") && url.contains('=') && url.contains(char::is_whitespace) {
        return redact_keywords(url);
    }
    let start = url.find("://").map_or(0, |s| s + 3);
    let (head, rest) = url.split_at(start);
    let rest = match userinfo_end(rest) {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    match rest.split_once('?') {
        None => format!("{head}{rest}"),
        Some((base, query)) => {
            let query: Vec<String> = query.split('&').map(redact_param).collect();
            format!("{head}{base}?{}", query.join("&"))
        }
    }
}

/// Where the user information of `rest` (what follows `scheme://`) ends: its last `@` before the
/// query, or, where there is none there (a `?` inside a password), its last `@` at all.
fn userinfo_end(rest: &str) -> Option<usize> {
    match rest.find('?') {
        Some(q) => rest[..q].rfind('@').or_else(|| rest.rfind('@')),
        None => rest.rfind('@'),
    }
}

/// One `name=value` of a query, its value redacted where its name is a password's.
fn redact_param(param: &str) -> String {
    match param.split_once('=') {
        Some((name, _)) if is_secret_name(name) => format!("{name}={REDACTED}"),
        _ => param.to_owned(),
    }
}

/// Whether a parameter name (percent-encoded or not, any case) names a password.
fn is_secret_name(name: &str) -> bool {
    let name = percent_decoded(name).to_ascii_lowercase();
    name.contains("password") || name.contains("passwd")
}

/// `s` with its `%XX` escapes decoded (others kept as they are), lossily as UTF-8.
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A libpq keyword string (`host=db user=app password=secret`, values possibly quoted, `=`
/// possibly spaced) with the values of its password keywords redacted.
fn redact_keywords(s: &str) -> String {
    // ASCII lowercasing keeps every byte offset.
    let lower = s.to_ascii_lowercase();
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut copied = 0;
    let mut i = 0;
    while i < b.len() {
        // A keyword starts the string or follows whitespace (so `i` is on a char boundary).
        if i == 0 || b[i - 1].is_ascii_whitespace() {
            let word_end = lower[i..]
                .find(|c: char| c == '=' || c.is_whitespace())
                .map_or(b.len(), |n| i + n);
            let word = &lower[i..word_end];
            if word.contains("password") || word.contains("passwd") {
                let mut j = word_end;
                while j < b.len() && b[j].is_ascii_whitespace() {
                    j += 1;
                }
                if j < b.len() && b[j] == b'=' {
                    j += 1;
                    while j < b.len() && b[j].is_ascii_whitespace() {
                        j += 1;
                    }
                    let end = keyword_value_end(b, j);
                    out.push_str(&s[copied..j]);
                    out.push_str(REDACTED);
                    copied = end;
                    i = end.max(i + 1);
                    continue;
                }
            }
        }
        i += 1;
    }
    out.push_str(&s[copied..]);
    out
}

/// Where a keyword's value starting at `start` ends: after its closing quote (backslash escapes
/// honoured), or at the next whitespace.
fn keyword_value_end(b: &[u8], start: usize) -> usize {
    if b.get(start) == Some(&b'\'') {
        let mut j = start + 1;
        while j < b.len() {
            match b[j] {
                b'\\' => j += 2,
                b'\'' => return j + 1,
                _ => j += 1,
            }
        }
        return b.len();
    }
    let mut j = start;
    while j < b.len() && !b[j].is_ascii_whitespace() {
        j += 1;
    }
    j
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `redact_url(url)`, checked to hold none of `secrets`.
    fn redacted(url: &str, secrets: &[&str]) -> String {
        let out = redact_url(url);
        for s in secrets {
            assert!(!out.contains(s), "{s:?} left in {out:?} (from {url:?})");
        }
        out
    }

    #[test]
    fn the_user_information_goes() {
        assert_eq!(
            redacted("postgres://app:s3cret@db:5432/app", &["s3cret", "app:"]),
            "postgres://db:5432/app"
        );
        assert_eq!(
            redacted("postgres://app:p@ss@db/app", &["p@ss"]),
            "postgres://db/app"
        );
        assert_eq!(
            redact_url("postgres://db:5432/app?sslmode=disable"),
            "postgres://db:5432/app?sslmode=disable"
        );
    }

    #[test]
    fn password_parameters_are_redacted() {
        assert_eq!(
            redacted(
                "postgres://app@db/app?sslmode=require&password=hunter2&application_name=x",
                &["hunter2"]
            ),
            "postgres://db/app?sslmode=require&password=REDACTED&application_name=x"
        );
        assert_eq!(
            redacted(
                "postgresql://db/app?sslpassword=k3y&PassWord=hunter2",
                &["k3y", "hunter2"]
            ),
            "postgresql://db/app?sslpassword=REDACTED&PassWord=REDACTED"
        );
        // A percent-encoded name is a password's too (the URL parser decodes it).
        redacted("postgres://db/app?pass%77ord=hunter2", &["hunter2"]);
        redacted("postgres://db/app?ssl-password=hunter2#frag", &["hunter2"]);
    }

    #[test]
    fn a_url_that_does_not_parse_is_redacted_too() {
        redacted(
            "postgres://app:s3cret@db:notaport/app?password=hunter2",
            &["s3cret", "hunter2"],
        );
        // A '?' inside an unencoded password.
        redacted("postgres://app:s3?cret@db/app", &["s3?cret", "cret"]);
        // An '@' in a query value does not let the password through.
        redacted(
            "postgres://app:s3cret@db/app?application_name=a@b&password=hunter2",
            &["s3cret", "hunter2"],
        );
        // No scheme separator (a typo), and not a URL at all.
        redacted("postgres:s3cret@db/app", &["s3cret"]);
        redacted("mysql://app:s3cret@host/x", &["s3cret"]);
    }

    #[test]
    fn keyword_strings_have_their_passwords_redacted() {
        assert_eq!(
            redacted("host=db user=app password=hunter2 dbname=x", &["hunter2"]),
            "host=db user=app password=REDACTED dbname=x"
        );
        redacted(
            "host=db password = 'hun ter2' sslpassword='k\\'3y' port=5432",
            &["hun", "ter2", "3y"],
        );
    }
}
