//! The outbox's Postgres half (`dedup_pg::outbox`): what a batch's handler queues is written with
//! the messages that settle in the pass that commits, one statement for the batch, and nothing
//! from a part that rolled back; the relay's read by snapshot differences publishes a late commit
//! with a lower id and is not held back by a long transaction; a relay whose lease was taken over
//! cannot move the position; the ring is truncated only once every row in it is published.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::outbox::{OutboxMessage, derived_key, event_ms};
use dedup_core::{HandlerError, Lease};
use dedup_pg::outbox::{
    OutboxBuffer, OutboxDeadLetter, OutboxRow, OutboxWriter, Position, RelayStore, Rotation, Step,
    decode_headers,
};
use dedup_pg::{BatchAnswer, BatchBody, BatchRequest, PgStore};
use sqlx::{Connection, PgConnection, PgPool};

use crate::support::{Boom, key, req};

/// Every row published after `prev`, in order, page by page; answers them and the new position.
async fn drain(relay: &RelayStore, prev: &Position) -> (Vec<OutboxRow>, Position) {
    let cur = relay.snapshot().await.unwrap();
    let mut rows = Vec::new();
    let mut after = None;
    loop {
        let page = relay.read(prev, &cur, after, 3).await.unwrap();
        let Some(last) = page.last() else { break };
        after = Some((last.xid, last.pos));
        rows.extend(page);
    }
    (rows, cur)
}

fn payloads(rows: &[OutboxRow]) -> Vec<String> {
    rows.iter()
        .map(|r| String::from_utf8(r.payload.clone().unwrap().to_vec()).unwrap())
        .collect()
}

/// Writes one message under `cause` in a transaction of its own; answers the open transaction.
async fn queue_open(pool: &PgPool, cause: &str, payload: &str) -> PgConnection {
    let mut conn = pool.acquire().await.unwrap().detach();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let mut w = OutboxWriter::new(key(cause), 1_700_000_000_000);
    w.publish(OutboxMessage::new("t", payload.to_owned()))
        .unwrap();
    w.write(&mut conn).await.unwrap();
    conn
}

async fn queue(pool: &PgPool, cause: &str, payload: &str) {
    let mut conn = queue_open(pool, cause, payload).await;
    sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
}

/// A batch handler that queues two messages per message, each naming its attempt; a key named
/// "poison" fails the whole call, then fails on its own.
fn publishing(
    outbox: Arc<OutboxBuffer>,
    calls: Arc<std::sync::atomic::AtomicU32>,
) -> impl for<'c> FnMut(&'c mut PgConnection, &'c [Lease]) -> BatchBody<'c, Boom> + Send {
    move |_tx, leases| {
        let call = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let outbox = outbox.clone();
        Box::pin(async move {
            let mut out = Vec::new();
            for l in leases {
                let name = String::from_utf8(l.key.key_bytes().to_vec()).unwrap();
                for n in 0..2 {
                    let m = OutboxMessage::new("charged", format!("{name}/{n}/call{call}"))
                        .with_key(name.clone());
                    outbox.publish(l, 1_700_000_000_000, m).unwrap();
                }
                if name == "poison" {
                    if leases.len() > 1 {
                        return Err(HandlerError::Permanent(Boom("poisoned batch")));
                    }
                    out.push(Err(HandlerError::Permanent(Boom("poison"))));
                } else {
                    out.push(Ok(Bytes::from(name)));
                }
            }
            Ok(out)
        })
    }
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_batch_publishes_only_what_its_committed_attempt_queued(pool: PgPool) {
    batch_publishes(pool).await;
}

/// The same over `dedup_records` partitioned by the key's time (the records' layout is the
/// batch's concern, the outbox's rows the same).
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn over_partitioned_records_a_batch_publishes_only_what_its_committed_attempt_queued(
    pool: PgPool,
) {
    crate::support::partition_records(&pool).await;
    batch_publishes(pool).await;
}

async fn batch_publishes(pool: PgPool) {
    let store = PgStore::new(pool.clone());
    let relay = RelayStore::new(store.clone());
    let start = relay.position().await.unwrap();
    let reqs: Vec<_> = ["a", "poison", "b"]
        .iter()
        .map(|n| req(&key(n), "w"))
        .collect();
    let outbox = Arc::new(OutboxBuffer::new());
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let answers = store
        .transact_batch(
            BatchRequest::new(&reqs).with_outbox(&outbox),
            publishing(outbox.clone(), calls.clone()),
        )
        .await
        .unwrap();
    assert!(matches!(answers[0], BatchAnswer::Executed { .. }));
    assert!(
        matches!(answers[1], BatchAnswer::Handler { .. }),
        "{:?}",
        answers[1]
    );
    assert!(matches!(answers[2], BatchAnswer::Executed { .. }));
    // Call 0: the whole batch (rolled back); then parts: "a", "poison" alone, "b".
    assert!(calls.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    let (rows, _) = drain(&relay, &start).await;
    let got = payloads(&rows);
    assert_eq!(
        got.len(),
        4,
        "two per settled message, none from a rolled-back call: {got:?}"
    );
    assert!(
        got.iter()
            .all(|p| !p.contains("poison") && !p.ends_with("call0")),
        "{got:?}"
    );
    assert!(
        got[0].starts_with("a/0/") && got[1].starts_with("a/1/"),
        "{got:?}"
    );
    assert!(
        got[2].starts_with("b/0/") && got[3].starts_with("b/1/"),
        "{got:?}"
    );
    // One transaction, in queued order; the derived keys by ordinal, stable across the attempts.
    assert!(
        rows.windows(2)
            .all(|w| w[0].xid == w[1].xid && w[0].pos < w[1].pos)
    );
    for (r, (cause, n)) in rows.iter().zip([("a", 0), ("a", 1), ("b", 0), ("b", 1)]) {
        let want = derived_key(
            &key(cause),
            "charged",
            n,
            event_ms(&key(cause), 1_700_000_000_000),
        );
        assert_eq!(r.idem_key, Bytes::from(want));
        assert_eq!(r.cause_key, Bytes::from(cause.to_owned()));
        assert_eq!(r.cause_scope, "test");
        assert_eq!(r.key, Some(Bytes::from(cause.to_owned())));
        assert_eq!(decode_headers(&r.headers), Some(Vec::new()));
    }
    // The same batch again: replays, nothing queued, nothing written.
    let again = store
        .transact_batch(
            BatchRequest::new(&reqs[..1]).with_outbox(&outbox),
            publishing(outbox.clone(), calls.clone()),
        )
        .await
        .unwrap();
    assert!(matches!(again[0], BatchAnswer::Replayed { .. }));
    let (rows, _) = drain(&relay, &start).await;
    assert_eq!(rows.len(), 4);
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_late_commit_with_a_lower_id_is_read_and_a_long_transaction_holds_nothing_back(
    pool: PgPool,
) {
    let store = PgStore::new(pool.clone());
    let relay = RelayStore::new(store.clone());
    let p0 = relay.position().await.unwrap();
    // An unrelated long transaction with an id, open throughout.
    let mut long = pool.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id()")
        .execute(&mut long)
        .await
        .unwrap();
    // "late" takes its id (and its row's id) first and commits last.
    let mut late = queue_open(&pool, "late", "late").await;
    queue(&pool, "early", "early").await;
    let (rows, p1) = drain(&relay, &p0).await;
    assert_eq!(
        payloads(&rows),
        ["early"],
        "the committed row, not held back"
    );
    // Late commits: the next read has it, and only it.
    sqlx::query("COMMIT").execute(&mut late).await.unwrap();
    queue(&pool, "after", "after").await;
    let (rows, p2) = drain(&relay, &p1).await;
    assert_eq!(payloads(&rows), ["late", "after"], "in (xid, pos) order");
    let (rows, _) = drain(&relay, &p2).await;
    assert!(rows.is_empty(), "nothing read twice");
    // The long transaction is still open, and stayed in the positions' in-progress lists.
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut long).await;
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_relay_whose_lease_was_taken_over_cannot_move_the_position(pool: PgPool) {
    let relay = RelayStore::new(PgStore::new(pool.clone()));
    let first = relay
        .acquire("one", Duration::from_millis(300))
        .await
        .unwrap()
        .expect("a free lease");
    assert_eq!(
        relay.acquire("two", Duration::from_secs(5)).await.unwrap(),
        None,
        "held"
    );
    assert!(
        relay
            .renew(&first, Duration::from_millis(300))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = relay
        .acquire("two", Duration::from_secs(5))
        .await
        .unwrap()
        .expect("a lease that ran out");
    assert!(second.epoch > first.epoch);
    queue(&pool, "x", "x").await;
    let p0 = relay.position().await.unwrap();
    let (rows, p1) = drain(&relay, &p0).await;
    assert_eq!(rows.len(), 1);
    assert!(!relay.renew(&first, Duration::from_secs(5)).await.unwrap());
    assert!(
        !relay
            .advance(&first, Step::Done(&p1), 1, &[])
            .await
            .unwrap(),
        "stale epoch"
    );
    assert_eq!(relay.position().await.unwrap(), p0);
    // A page of a round is its progress: a relay taking over resumes after it; a stale epoch
    // records none.
    let at = (rows[0].xid, rows[0].pos);
    assert!(
        !relay
            .advance(&first, Step::Page(&p1, at), 1, &[])
            .await
            .unwrap()
    );
    assert!(
        relay
            .advance(&second, Step::Page(&p1, at), 1, &[])
            .await
            .unwrap()
    );
    let progress = relay.progress().await.unwrap();
    assert_eq!(
        (progress.position, progress.round),
        (p0.clone(), Some((p1.clone(), at)))
    );
    assert_eq!(
        relay.status().await.unwrap().unpublished,
        0,
        "the page recorded is published"
    );
    assert!(
        relay
            .advance(&second, Step::Done(&p1), 0, &[])
            .await
            .unwrap()
    );
    assert_eq!(relay.progress().await.unwrap().round, None);
    assert_eq!(relay.position().await.unwrap(), p1);
    let status = relay.status().await.unwrap();
    assert_eq!(status.leader.as_deref(), Some("two"));
    assert_eq!((status.published, status.unpublished), (1, 0));
    // Let go: a stand-by takes over at once.
    relay.release(&second).await.unwrap();
    assert!(
        relay
            .acquire("three", Duration::from_secs(5))
            .await
            .unwrap()
            .is_some()
    );
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_ring_is_truncated_only_once_every_row_in_it_is_published(pool: PgPool) {
    let relay = RelayStore::new(PgStore::new(pool.clone()));
    let lease = relay
        .acquire("r", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    let wait = Duration::from_millis(200);
    let p0 = relay.position().await.unwrap();
    queue(&pool, "in-ring-0", "in-ring-0").await;
    assert_eq!(
        relay
            .rotate(&lease, Duration::from_secs(3600), wait)
            .await
            .unwrap(),
        Rotation::NotDue
    );
    let now = Duration::ZERO;
    assert_eq!(
        relay.rotate(&lease, now, wait).await.unwrap(),
        Rotation::Rotated { ring: 1 }
    );
    queue(&pool, "in-ring-1", "in-ring-1").await;
    assert_eq!(
        relay.rotate(&lease, now, wait).await.unwrap(),
        Rotation::Rotated { ring: 2 }
    );
    // Ring 0 holds a committed row not yet published: kept.
    assert_eq!(
        relay.rotate(&lease, now, wait).await.unwrap(),
        Rotation::NotYet
    );
    let status = relay.status().await.unwrap();
    assert_eq!((status.unpublished, status.ring), (2, 2));
    let (rows, p1) = drain(&relay, &p0).await;
    assert_eq!(payloads(&rows), ["in-ring-0", "in-ring-1"]);
    // One dead letter among them, kept with its reason.
    let dead = [OutboxDeadLetter {
        row: rows[1].clone(),
        reason: "too large".to_owned(),
    }];
    assert!(
        relay
            .advance(&lease, Step::Done(&p1), 1, &dead)
            .await
            .unwrap()
    );
    // A writer still holding ring 0 (a transaction that named it before the switch) is waited
    // for no longer than the bound.
    let mut holder = pool.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN; LOCK TABLE dedup_outbox_0 IN ROW EXCLUSIVE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    assert_eq!(
        relay.rotate(&lease, now, wait).await.unwrap(),
        Rotation::NotYet
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    assert_eq!(
        relay.rotate(&lease, now, wait).await.unwrap(),
        Rotation::Rotated { ring: 0 }
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM dedup_outbox_0")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "ring 0 emptied once published");
    let kept: HashMap<String, String> =
        sqlx::query_as::<_, (Vec<u8>, String)>("SELECT payload, reason FROM dedup_outbox_dead")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(p, r)| (String::from_utf8(p).unwrap(), r))
            .collect();
    assert_eq!(kept.get("in-ring-1").map(String::as_str), Some("too large"));
    let status = relay.status().await.unwrap();
    assert_eq!(
        (status.unpublished, status.dead_letters, status.ring),
        (0, 1, 0)
    );
    // New writes land in ring 0 and are read.
    queue(&pool, "next", "next").await;
    let (rows, _) = drain(&relay, &p1).await;
    assert_eq!(payloads(&rows), ["next"]);
    let _ = Connection::close(holder).await;
}
