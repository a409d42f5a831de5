//! Reading a row as a record, and the integer conversions the statements bind.

use bytes::Bytes;
use dedup_core::{
    FencingToken, Fingerprint, IdempotencyKey, OwnerId, Record, State, StoreError, Timestamp,
};
use sqlx::Row;
use sqlx::postgres::PgRow;

pub(crate) fn token_i64(token: FencingToken) -> i64 {
    // Tokens come from a bigint sequence with MINVALUE 1, so they always fit.
    i64::try_from(token.get()).unwrap_or(i64::MAX)
}

pub(crate) fn attempts_i32(n: u32) -> i32 {
    // Policy::validate keeps max_attempts within 31 bits.
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Reads a row as a record of `key`; anything that is not a dedup record is [`StoreError::Corrupt`].
pub(crate) fn record_from_row(key: &IdempotencyKey, row: &PgRow) -> Result<Record, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        key: key.clone(),
        detail,
    };
    let get_err = |e: sqlx::Error| corrupt(e.to_string());
    let scope: String = row.try_get("scope").map_err(get_err)?;
    let key_bytes: Vec<u8> = row.try_get("key").map_err(get_err)?;
    if scope != key.scope().as_str() || key_bytes != key.key_bytes() {
        return Err(corrupt("the row belongs to another key".into()));
    }
    let state: String = row.try_get("state").map_err(get_err)?;
    let state = State::parse(&state).ok_or_else(|| corrupt(format!("unknown state {state:?}")))?;
    let token: i64 = row.try_get("token").map_err(get_err)?;
    let token = u64::try_from(token).map_err(|_| corrupt(format!("negative token {token}")))?;
    let attempts: i32 = row.try_get("attempts").map_err(get_err)?;
    let attempts =
        u32::try_from(attempts).map_err(|_| corrupt(format!("negative attempts {attempts}")))?;
    let ts = |col: &str| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(col)
            .map(Timestamp::from_micros)
            .map_err(get_err)
    };
    let mut record = Record::new(
        key.clone(),
        state,
        FencingToken::new(token),
        attempts,
        ts("created_us")?,
        ts("expires_us")?,
    );
    record.updated_at = ts("updated_us")?;
    record.owner = row
        .try_get::<Option<String>, _>("owner")
        .map_err(get_err)?
        .map(OwnerId::new);
    record.lease_until = row
        .try_get::<Option<i64>, _>("lease_until_us")
        .map_err(get_err)?
        .map(Timestamp::from_micros);
    record.fingerprint = match row
        .try_get::<Option<Vec<u8>>, _>("fingerprint")
        .map_err(get_err)?
    {
        None => None,
        Some(b) => Some(
            Fingerprint::from_slice(&b)
                .ok_or_else(|| corrupt("fingerprint is not 32 bytes".into()))?,
        ),
    };
    record.result = row
        .try_get::<Option<Vec<u8>>, _>("result")
        .map_err(get_err)?
        .map(Bytes::from);
    record.failure = row.try_get("failure").map_err(get_err)?;
    Ok(record)
}
