//! Error answers as problem details (RFC 9457, `application/problem+json`).

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// The `type` of every problem this layer answers with: `urn:dedup:idempotency:<kind>`.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:dedup:idempotency:";

/// A problem details response.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
) -> Response<Bytes> {
    let body = serde_json::json!({
        "type": format!("{PROBLEM_TYPE_PREFIX}{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut r = Response::new(Bytes::from(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    r
}

/// With `Retry-After: 1`: the answer may change if the client tries again.
pub(crate) fn retry_later(mut r: Response<Bytes>) -> Response<Bytes> {
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}
