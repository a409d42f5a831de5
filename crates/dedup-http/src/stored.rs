//! A response as it is stored for replay (a typed envelope, bincode), and the response a replay
//! builds from it.

use std::sync::LazyLock;

use bytes::Bytes;
use dedup_core::ResultCodec;
use dedup_core::typed::{Bincode, CodecError};
use http::response::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

use crate::config::IdempotencyConfig;

/// Marks a replayed response (`Idempotent-Replayed: true`, as Stripe names it).
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// On a replay of a response whose body was too large to store: the body's original length.
/// The replay carries the original status and stored headers and an empty body.
pub const BODY_NOT_STORED: HeaderName = HeaderName::from_static("idempotent-replayed-body-omitted");

/// A response as it is stored: status, the allowlisted headers, and the body (none when it was
/// too large to keep).
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    status: u16,
    headers: Vec<(String, Bytes)>,
    body: Option<Bytes>,
    body_len: u64,
}

/// Responses are stored with bincode under this tag: a later layout gets a new tag, and old
/// records then answer a clear error instead of a wrong response.
static CODEC: LazyLock<ResultCodec<StoredResponse, Bincode>> = LazyLock::new(|| {
    ResultCodec::bincode("dedup-http/response/v1").unwrap_or_else(|_| unreachable!())
});

/// The stored form of a response, within `max` bytes: without its body when the whole does
/// not fit, and without its headers too when even they do not.
pub(crate) fn encode(
    config: &IdempotencyConfig,
    status: StatusCode,
    headers: &HeaderMap,
    body: &Bytes,
    max: usize,
) -> Result<Bytes, CodecError> {
    let kept: Vec<(String, Bytes)> = headers
        .iter()
        .filter(|(name, _)| config.stores_header(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect();
    let mut stored = StoredResponse {
        status: status.as_u16(),
        headers: kept,
        body: Some(body.clone()),
        body_len: body.len() as u64,
    };
    let bytes = CODEC.encode(&stored)?;
    if bytes.len() <= max {
        return Ok(bytes);
    }
    stored.body = None;
    let bytes = CODEC.encode(&stored)?;
    if bytes.len() <= max {
        return Ok(bytes);
    }
    stored.headers.clear();
    CODEC.encode(&stored)
}

/// Headers that describe a body: not replayed when the body was not stored.
const ABOUT_THE_BODY: [HeaderName; 5] = [
    http::header::CONTENT_TYPE,
    http::header::CONTENT_ENCODING,
    http::header::CONTENT_LANGUAGE,
    http::header::CONTENT_DISPOSITION,
    http::header::ETAG,
];

/// Why a stored response cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error(transparent)]
    Codec(#[from] CodecError),
    #[error("the stored status {0} is not an HTTP status")]
    Status(u16),
}

/// The response a replay answers with.
pub(crate) fn replay(bytes: &[u8]) -> Result<Response<Bytes>, ReplayError> {
    let stored = CODEC.decode(bytes)?;
    let status =
        StatusCode::from_u16(stored.status).map_err(|_| ReplayError::Status(stored.status))?;
    let mut response = Response::new(stored.body.clone().unwrap_or_default());
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) && (stored.body.is_some() || !ABOUT_THE_BODY.contains(&name))
        {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    if stored.body.is_none() {
        headers.insert(BODY_NOT_STORED, HeaderValue::from(stored.body_len));
    }
    Ok(response)
}

/// A fresh response as the first caller gets it: the handler's own head and whole body.
pub(crate) fn fresh(parts: Parts, body: Bytes) -> Response<Bytes> {
    Response::from_parts(parts, body)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_keeps_status_allowed_headers_and_body() {
        let config = IdempotencyConfig::default();
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("location", HeaderValue::from_static("/orders/7"));
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        headers.insert("connection", HeaderValue::from_static("close"));
        headers.insert("x-internal", HeaderValue::from_static("1"));
        let body = Bytes::from_static(b"{\"id\":7}");
        let bytes = encode(&config, StatusCode::CREATED, &headers, &body, 64 * 1024).unwrap();
        let r = replay(&bytes).unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        assert_eq!(r.body(), &body);
        assert_eq!(r.headers()["content-type"], "application/json");
        assert_eq!(r.headers()["location"], "/orders/7");
        assert_eq!(r.headers()[REPLAYED], "true");
        for gone in ["set-cookie", "connection", "x-internal"] {
            assert!(!r.headers().contains_key(gone), "{gone}");
        }
    }

    #[test]
    fn a_body_too_large_is_not_stored_and_the_replay_says_so() {
        let config = IdempotencyConfig::default();
        let body = Bytes::from(vec![b'x'; 5000]);
        let bytes = encode(&config, StatusCode::OK, &HeaderMap::new(), &body, 1000).unwrap();
        assert!(bytes.len() <= 1000);
        let r = replay(&bytes).unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.body().is_empty());
        assert_eq!(r.headers()[BODY_NOT_STORED], "5000");
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("location", HeaderValue::from_static("/big/1"));
        let bytes = encode(&config, StatusCode::OK, &headers, &body, 1000).unwrap();
        let r = replay(&bytes).unwrap();
        assert!(
            !r.headers().contains_key("content-type"),
            "it described the body"
        );
        assert_eq!(r.headers()["location"], "/big/1");
    }
}
