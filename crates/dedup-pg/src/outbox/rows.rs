//! The outbox's rows: one multi-row insert of everything a transaction queued, and the encoding
//! of a message's headers in one `bytea` (`headers`).
//!
//! Headers are stored as a sequence of entries, each a 4-byte big-endian name length, the name's
//! UTF-8 bytes, a 4-byte big-endian value length (`-1` for a null value) and the value's bytes:
//! Kafka's own shape (ordered, repeats allowed, null values), read back byte for byte.

use bytes::Bytes;
use dedup_core::IdempotencyKey;
use dedup_core::StoreError;
use dedup_core::outbox::OutboxMessage;
use sqlx::postgres::PgConnection;

use crate::classify::classify;

/// One row to insert.
#[derive(Debug)]
pub(super) struct Row {
    topic: String,
    key: Option<Bytes>,
    payload: Option<Bytes>,
    headers: Vec<u8>,
    idem_key: String,
    cause_scope: String,
    cause_key: Vec<u8>,
    event_ms: i64,
}

impl Row {
    pub(super) fn new(
        cause: &IdempotencyKey,
        event_ms: u64,
        idem_key: String,
        m: &OutboxMessage,
    ) -> Self {
        Self {
            topic: m.topic().to_owned(),
            key: m.key().cloned(),
            payload: m.payload().cloned(),
            headers: encode_headers(m.headers()),
            idem_key,
            cause_scope: cause.scope().as_str().to_owned(),
            cause_key: cause.key_bytes().to_vec(),
            event_ms: i64::try_from(event_ms).unwrap_or(i64::MAX),
        }
    }
}

/// The rows in one statement, `pos` in the order given: one value of the sequence for the
/// statement, shifted, plus each row's ordinal (a statement holds far fewer than 2^20 rows).
/// The ring is the one `dedup_outbox_relay` names as the statement reads it.
const INSERT_SQL: &str = "\
INSERT INTO dedup_outbox (pos, ring, topic, msg_key, payload, headers, idem_key, cause_scope, \
    cause_key, event_ms) \
SELECT s.base * 1048576 + u.n, r.ring, u.t, u.k, u.p, u.h, u.i, u.cs, u.ck, u.e \
FROM unnest($1::text[], $2::bytea[], $3::bytea[], $4::bytea[], $5::bytea[], $6::text[], \
    $7::bytea[], $8::int8[]) WITH ORDINALITY AS u(t, k, p, h, i, cs, ck, e, n), \
    (SELECT nextval('dedup_outbox_pos_seq') AS base) s, \
    (SELECT ring FROM dedup_outbox_relay WHERE id = 1) r";

/// Inserts `rows` in one statement.
pub(super) async fn insert(conn: &mut PgConnection, rows: &[Row]) -> Result<(), StoreError> {
    let topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
    let keys: Vec<Option<&[u8]>> = rows.iter().map(|r| r.key.as_deref()).collect();
    let payloads: Vec<Option<&[u8]>> = rows.iter().map(|r| r.payload.as_deref()).collect();
    let headers: Vec<&[u8]> = rows.iter().map(|r| r.headers.as_slice()).collect();
    let idem: Vec<&[u8]> = rows.iter().map(|r| r.idem_key.as_bytes()).collect();
    let scopes: Vec<&str> = rows.iter().map(|r| r.cause_scope.as_str()).collect();
    let causes: Vec<&[u8]> = rows.iter().map(|r| r.cause_key.as_slice()).collect();
    let times: Vec<i64> = rows.iter().map(|r| r.event_ms).collect();
    let done = sqlx::query(INSERT_SQL)
        .bind(&topics)
        .bind(&keys)
        .bind(&payloads)
        .bind(&headers)
        .bind(&idem)
        .bind(&scopes)
        .bind(&causes)
        .bind(&times)
        .execute(conn)
        .await
        .map_err(|e| classify(e, false))?;
    if done.rows_affected() != rows.len() as u64 {
        // No ring row: the outbox's migration has not run (its row is made with its table).
        return Err(StoreError::backend(NoRing));
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
#[error("dedup_outbox_relay has no row: run dedup's migrations")]
struct NoRing;

/// Encodes headers as the `headers` column holds them.
pub fn encode_headers(headers: &[(String, Option<Bytes>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        match value {
            Some(v) => {
                out.extend_from_slice(&i32::try_from(v.len()).unwrap_or(i32::MAX).to_be_bytes());
                out.extend_from_slice(v);
            }
            None => out.extend_from_slice(&(-1_i32).to_be_bytes()),
        }
    }
    out
}

/// Decodes the `headers` column; `None` for bytes no encoder wrote.
pub fn decode_headers(mut b: &[u8]) -> Option<Vec<(String, Option<Bytes>)>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, tail) = b.split_at(n);
        *b = tail;
        Some(head)
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let n = u32::from_be_bytes(take(&mut b, 4)?.try_into().ok()?);
        let name = std::str::from_utf8(take(&mut b, usize::try_from(n).ok()?)?).ok()?;
        let v = i32::from_be_bytes(take(&mut b, 4)?.try_into().ok()?);
        let value = match usize::try_from(v) {
            Ok(len) => Some(Bytes::copy_from_slice(take(&mut b, len)?)),
            Err(_) if v == -1 => None,
            Err(_) => return None,
        };
        out.push((name.to_owned(), value));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_come_back_as_they_were_queued() {
        let h = vec![
            ("a".to_owned(), Some(Bytes::from_static(b"1"))),
            ("a".to_owned(), None),
            ("empty".to_owned(), Some(Bytes::new())),
            ("ü".to_owned(), Some(Bytes::from_static(&[0, 255]))),
        ];
        assert_eq!(decode_headers(&encode_headers(&h)), Some(h));
        assert_eq!(decode_headers(&[]), Some(Vec::new()));
        assert_eq!(decode_headers(&[0, 0, 0, 9, b'a']), None);
        assert_eq!(
            decode_headers(&[0, 0, 0, 1, b'a', 255, 255, 255, 254]),
            None
        );
    }
}
