//! The key of a request (from its `Idempotency-Key` header, its route and its tenant) and its
//! fingerprint.
//!
//! The header is a Structured Field string or a bare token. The key is
//! `len:tenant|len:METHOD route|key`, digested when it is longer than a key may be.

use dedup_core::{Fingerprint, IdempotencyKey, InputError, MAX_KEY_LEN};
use http::HeaderMap;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::config::IdempotencyConfig;

/// The longest key a client may send (Stripe's limit).
pub const MAX_CLIENT_KEY_LEN: usize = 255;

/// Why a request's key header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The header appears more than once.
    #[error("the header appears more than once")]
    Repeated,
    /// The value is empty.
    #[error("the key is empty")]
    Empty,
    /// The value is longer than [`MAX_CLIENT_KEY_LEN`].
    #[error("the key is {0} bytes long; the limit is 255")]
    TooLong(usize),
    /// Not a Structured Field string, nor a bare token.
    #[error("the key is neither a quoted string nor a bare token: {0}")]
    Malformed(&'static str),
}

/// The key the client sent, if any.
pub(crate) fn client_key(
    headers: &HeaderMap,
    name: &http::HeaderName,
) -> Result<Option<String>, KeyHeaderError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    parse(value.as_bytes()).map(Some)
}

/// A Structured Field string (RFC 8941: `"..."` with `\"` and `\\` escapes, printable ASCII;
/// parameters after it are ignored), or a bare token of visible ASCII as Stripe's clients send
/// (`Idempotency-Key: 5d1f...`).
pub(crate) fn parse(raw: &[u8]) -> Result<String, KeyHeaderError> {
    let raw = raw.trim_ascii();
    let key = if let Some(rest) = raw.strip_prefix(b"\"") {
        let mut out = Vec::with_capacity(rest.len());
        let mut bytes = rest.iter();
        loop {
            match bytes.next() {
                None => return Err(KeyHeaderError::Malformed("the closing quote is missing")),
                Some(b'"') => break,
                Some(b'\\') => match bytes.next() {
                    Some(&c @ (b'"' | b'\\')) => out.push(c),
                    _ => {
                        return Err(KeyHeaderError::Malformed(
                            "only \\\" and \\\\ may be escaped",
                        ));
                    }
                },
                Some(&c @ 0x20..=0x7e) => out.push(c),
                Some(_) => {
                    return Err(KeyHeaderError::Malformed(
                        "a string holds printable ASCII only",
                    ));
                }
            }
        }
        let after = bytes.as_slice();
        if !after.is_empty() && !after.starts_with(b";") {
            return Err(KeyHeaderError::Malformed("text after the closing quote"));
        }
        out
    } else {
        if let Some(c) = raw
            .iter()
            .find(|&&c| !(0x21..=0x7e).contains(&c) || c == b'"' || c == b',')
        {
            return Err(if c.is_ascii_whitespace() {
                KeyHeaderError::Malformed("a bare key holds no spaces")
            } else if *c == b',' {
                KeyHeaderError::Malformed("a bare key holds no commas (send one key)")
            } else {
                KeyHeaderError::Malformed("a bare key is visible ASCII without quotes")
            });
        }
        raw.to_vec()
    };
    if key.is_empty() {
        return Err(KeyHeaderError::Empty);
    }
    if key.len() > MAX_CLIENT_KEY_LEN {
        return Err(KeyHeaderError::TooLong(key.len()));
    }
    // Printable ASCII only, so this cannot fail.
    String::from_utf8(key).map_err(|_| KeyHeaderError::Malformed("not ASCII"))
}

/// Why no key could be made for a request.
#[derive(Debug)]
pub(crate) enum KeyError {
    /// A tenant extractor is set and found no tenant: keys of different tenants must never meet.
    NoTenant,
    /// The key itself was refused.
    Input(InputError),
}

/// The idempotency key: the tenant, the method and route, and the client's key, each with its
/// length in front so that no two different triples meet (`4:acme|11:POST /orders|k-1`). Past
/// [`MAX_KEY_LEN`] it is digested.
pub(crate) fn idempotency_key(
    config: &IdempotencyConfig,
    parts: &Parts,
    client_key: &str,
) -> Result<IdempotencyKey, KeyError> {
    let tenant = match &config.tenant {
        Some(f) => f(parts).ok_or(KeyError::NoTenant)?,
        None => String::new(),
    };
    let route = config
        .route
        .as_ref()
        .and_then(|f| f(parts))
        .unwrap_or_else(|| parts.uri.path().to_owned());
    let route = format!("{} {route}", parts.method);
    let key = format!(
        "{}:{tenant}|{}:{route}|{client_key}",
        tenant.len(),
        route.len()
    );
    if key.len() > MAX_KEY_LEN {
        IdempotencyKey::digest(config.scope.clone(), key)
    } else {
        IdempotencyKey::new(config.scope.clone(), key)
    }
    .map_err(KeyError::Input)
}

/// SHA-256 over the method, the path, the query and the body's bytes, each with its length in
/// front. Nothing is canonicalised: a body re-serialised with other whitespace or key order, or
/// a query with its parameters in another order, is another payload (422). Headers are not
/// part of it.
pub(crate) fn fingerprint(parts: &Parts, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    for field in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or("").as_bytes(),
        body,
    ] {
        h.update((field.len() as u64).to_le_bytes());
        h.update(field);
    }
    let digest = h.finalize();
    // A SHA-256 digest is 32 bytes, as a fingerprint is.
    Fingerprint::from_slice(&digest).unwrap_or_else(|| Fingerprint::of(digest))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn structured_strings_and_bare_tokens_are_keys() {
        assert_eq!(
            parse(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        assert_eq!(parse(b"  \"a b\\\"c\\\\d\"  ").unwrap(), "a b\"c\\d");
        assert_eq!(parse(b"\"k\";v=1").unwrap(), "k");
        assert_eq!(
            parse(b"5d1f6a8e-Stripe_style:key").unwrap(),
            "5d1f6a8e-Stripe_style:key"
        );
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert_eq!(parse(b"").unwrap_err(), KeyHeaderError::Empty);
        assert_eq!(parse(b"\"\"").unwrap_err(), KeyHeaderError::Empty);
        for bad in [
            &b"\"open"[..],
            b"\"a\\nb\"",
            b"\"a\"x",
            b"two words",
            b"a,b",
            b"a\"b",
            b"\"\xc3\xa9\"",
        ] {
            assert!(
                matches!(parse(bad), Err(KeyHeaderError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse(&[b'k'; 256]).unwrap_err(),
            KeyHeaderError::TooLong(256)
        );
        assert!(parse(&[b'k'; 255]).is_ok());
    }

    #[test]
    fn keys_carry_tenant_and_route_without_ambiguity() {
        let config = IdempotencyConfig::default().with_tenant(|p| {
            p.headers
                .get("x-tenant")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        let parts = |tenant: &str, path: &str| {
            http::Request::post(path)
                .header("x-tenant", tenant)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let a = idempotency_key(&config, &parts("a|1", "/x"), "k").unwrap();
        let b = idempotency_key(&config, &parts("a", "/x"), "1|k").unwrap();
        assert_ne!(a, b);
        assert_eq!(a.key_bytes(), b"3:a|1|7:POST /x|k");
        let long = idempotency_key(&config, &parts("t", &format!("/{}", "p".repeat(600))), "k");
        assert!(long.is_ok(), "a long route is digested");
        let anonymous = http::Request::post("/x").body(()).unwrap().into_parts().0;
        assert!(matches!(
            idempotency_key(&config, &anonymous, "k"),
            Err(KeyError::NoTenant)
        ));
    }

    #[test]
    fn the_fingerprint_covers_method_path_query_and_body() {
        let p = |m: &str, uri: &str| {
            http::Request::builder()
                .method(m)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        let base = fingerprint(&p("POST", "/o?a=1"), b"{}");
        assert_eq!(base, fingerprint(&p("POST", "/o?a=1"), b"{}"));
        assert_ne!(base, fingerprint(&p("PATCH", "/o?a=1"), b"{}"));
        assert_ne!(base, fingerprint(&p("POST", "/p?a=1"), b"{}"));
        assert_ne!(base, fingerprint(&p("POST", "/o?a=2"), b"{}"));
        assert_ne!(base, fingerprint(&p("POST", "/o?a=1"), b"{ }"));
    }
}
