//! The stored position: what a batch stores with its effects (its first message that does not
//! settle, or its end), forward only, read back as the assignment reads it. The database tests
//! run against a real Postgres (`DATABASE_URL`, as every `#[sqlx::test]`). What a batch tells its
//! writes (which messages settle) is `dedup_pg`'s, tested in `tests/it/pg_batch.rs`.

use bytes::Bytes;
use dedup_core::{ClaimRequest, HandlerError, IdempotencyKey, Lease, OwnerId, Scope};
use dedup_pg::{BatchBody, BatchRequest, ItemResult, PgStore};
use sqlx::PgPool;
use sqlx::postgres::PgConnection;

use super::{TxOffsets, store_offsets, stored_on};

fn offsets(offsets: Vec<i64>, end: i64) -> TxOffsets {
    TxOffsets::new("g".to_owned(), "t".to_owned(), 0, offsets, end)
}

#[test]
fn the_position_is_the_first_message_that_does_not_settle_or_the_end() {
    let o = offsets(vec![10, 11, 12, 13], 14);
    assert_eq!(o.position(&[true, true, true, true]), 14);
    assert_eq!(o.position(&[true, true, false, true]), 12);
    assert_eq!(o.position(&[true, true, false, false]), 12);
    assert_eq!(o.position(&[false, true, true, true]), 10);
    // A message the batch says nothing of does not settle.
    assert_eq!(o.position(&[true, true]), 12);
    assert_eq!(offsets(vec![], 7).position(&[]), 7);
}

/// `dedup_offsets`' position of g/t/0, read as the assignment reads it.
async fn position(pool: &PgPool) -> Option<i64> {
    let mut conn = pool.acquire().await.unwrap();
    stored_on(&mut conn, "g", &[("t".to_owned(), 0)])
        .await
        .unwrap()
        .get(&("t".to_owned(), 0))
        .copied()
}

fn reqs(names: &[&str]) -> Vec<ClaimRequest> {
    let scope = Scope::new("offsets").unwrap();
    names
        .iter()
        .map(|n| {
            ClaimRequest::new(
                IdempotencyKey::new(scope.clone(), *n).unwrap(),
                OwnerId::new("w#1"),
            )
        })
        .collect()
}

/// Answers every message done, except `refuse`d ones, which fail retryably.
fn body(
    refuse: &'static [&'static str],
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, String> + Send {
    move |_tx, leases| {
        Box::pin(async move {
            Ok(leases
                .iter()
                .map(|l| -> ItemResult<String> {
                    if refuse.iter().any(|r| r.as_bytes() == l.key.key_bytes()) {
                        Err(HandlerError::Retryable("refused".to_owned()))
                    } else {
                        Ok(Bytes::from_static(b"done"))
                    }
                })
                .collect())
        })
    }
}

/// A batch stores its partition's position with its effects, up to its first message that did
/// not settle; a later batch moves it on; a late batch of an earlier owner, or a position
/// stored on its own, cannot move it back.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_stores_its_position_with_its_effects_and_never_moves_it_back(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let groups = [0, 1, 2, 3];
    // "c" fails retryably: the position stops at it.
    let r = reqs(&["a", "b", "c", "d"]);
    let o = offsets(vec![10, 11, 12, 13], 14);
    store
        .transact_batch(
            BatchRequest::new(&r).ordered(&groups).with_writes(&o),
            body(&["c"]),
        )
        .await
        .unwrap();
    assert_eq!(position(&pool).await, Some(12));
    // Then everything settles: the position is the batch's end.
    let r = reqs(&["c", "e"]);
    let o = offsets(vec![12, 14], 15);
    store
        .transact_batch(
            BatchRequest::new(&r).ordered(&groups[..2]).with_writes(&o),
            body(&[]),
        )
        .await
        .unwrap();
    assert_eq!(position(&pool).await, Some(15));
    // A late batch of an earlier owner cannot move it back.
    let r = reqs(&["f"]);
    let o = offsets(vec![5], 6);
    store
        .transact_batch(BatchRequest::new(&r).with_writes(&o), body(&[]))
        .await
        .unwrap();
    assert_eq!(position(&pool).await, Some(15));
    // A position stored on its own (a dead letter acknowledged) moves it forward only.
    store_offsets(&store, "g", &[("t", 0, 17)]).await.unwrap();
    assert_eq!(position(&pool).await, Some(17));
    store_offsets(&store, "g", &[("t", 0, 3)]).await.unwrap();
    assert_eq!(position(&pool).await, Some(17), "never back");
    // Offsets that are not one per request are refused: nothing of the batch commits.
    let r = reqs(&["x"]);
    let o = offsets(vec![], 99);
    let err = store
        .transact_batch(BatchRequest::new(&r).with_writes(&o), body(&[]))
        .await
        .unwrap_err();
    assert!(matches!(err, dedup_core::StoreError::Input(_)), "{err:?}");
    assert_eq!(position(&pool).await, Some(17));
}
