//! A real process killed with SIGKILL after its claim and before completing.
//!
//! The worker is `tests/bin/claim_and_hang.rs`. With an instance identity: a process holding
//! the identity and SIGSTOPped is not adopted (`HeldElsewhere`); SIGKILLed, it is, at once.

use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    Adoption, ClaimOutcome, Dedup, HandlerError, InstanceId, LeaseContext, Processed, State, Store,
};
use dedup_pg::PgStore;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::support::{effect_in_tx, effect_rows, effects_table, key, req, url_of};

/// Starts a `dedup-claim-and-hang` worker with `args` and waits for its claim: the process and
/// the token it holds.
async fn claim_and_hang(args: &[&str]) -> (tokio::process::Child, u64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedup-claim-and-hang"))
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut line = String::new();
    let stdout = child.stdout.take().unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .expect("the worker claims within 30 s")
    .unwrap();
    let token = line
        .trim()
        .strip_prefix("claimed token=")
        .unwrap()
        .parse()
        .unwrap();
    (child, token)
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_worker_killed_after_its_claim_is_taken_over_once(pool: PgPool) {
    effects_table(&pool).await;
    // An 8 s lease: long enough that the check right after the kill sees it standing on a
    // machine of any speed (one core included), short enough to wait out below.
    let (mut child, dead_token) =
        claim_and_hang(&[url_of(&pool).as_str(), "test", "order-7", "8000"]).await;

    child.kill().await.unwrap(); // SIGKILL: no cleanup, no release
    let status = child.wait().await.unwrap();
    assert!(!status.success());

    let store = PgStore::new(pool.clone());
    let k = key("order-7");
    // Its lease still stands right after the kill.
    let early = store.claim(&req(&k, "early")).await.unwrap();
    assert!(matches!(early, ClaimOutcome::InFlight { .. }), "{early:?}");

    // A consumer waits out the dead lease, takes over, and runs the effect once.
    let dedup = Dedup::new(store.clone())
        .with_in_flight_wait(Duration::from_secs(30))
        .unwrap();
    let run = |store: PgStore| {
        move |ctx: LeaseContext| async move {
            let result = Bytes::from_static(b"shipped");
            effect_in_tx(&store, &ctx, "order-7".into(), "taker".into(), result).await
        }
    };
    let done = dedup.process(&k, None, run(store.clone())).await.unwrap();
    let Processed::Executed {
        token, attempts, ..
    } = done
    else {
        panic!("expected the takeover to execute, got {done:?}");
    };
    assert!(token.get() > dead_token);
    assert_eq!(attempts, 2);
    // Another delivery replays.
    let again = dedup.process(&k, None, run(store.clone())).await.unwrap();
    assert!(!again.executed());

    let rows = effect_rows(&pool).await;
    let token_i64 = i64::try_from(token.get()).unwrap();
    assert_eq!(
        rows,
        vec![("order-7".to_owned(), token_i64, "taker".to_owned())]
    );
    let rec = store.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.token, rec.attempts),
        (State::Completed, token, 2)
    );
}

/// A worker with an instance identity, alive (stopped, even) while it holds a key: a second
/// process with the same identity adopts nothing. Killed: its successor adopts the lease at once
/// and runs the key under a new token, long before the lease would have ended.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_live_identity_is_not_adopted_and_a_dead_one_is_at_once(pool: PgPool) {
    // A 10-minute lease: waiting it out would fail the test.
    let (mut child, dead_token) = claim_and_hang(&[
        url_of(&pool).as_str(),
        "test",
        "order-9",
        "600000",
        "node-a",
    ])
    .await;
    let pid = child.id().unwrap().to_string();
    let signal = |s: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([s, &pid])
                .status()
                .unwrap()
                .success()
        );
    };
    // Stopped, not dead: its session (and the identity's lock) stands.
    signal("-STOP");
    let store = PgStore::new(pool.clone());
    let successor = Dedup::new(store.clone())
        .with_instance(InstanceId::new("node-a").unwrap())
        .with_in_flight_wait(Duration::ZERO)
        .unwrap();
    assert_eq!(successor.adopt().await.unwrap(), Adoption::HeldElsewhere);
    let k = key("order-9");
    let early = store.claim(&req(&k, "early")).await.unwrap();
    assert!(matches!(early, ClaimOutcome::InFlight { .. }), "{early:?}");

    child.kill().await.unwrap(); // SIGKILL (a stopped process dies too)
    child.wait().await.unwrap();
    let adopted = successor.adopt().await.unwrap();
    assert_eq!(adopted.adopted(), 1, "{adopted:?}");
    let done = successor
        .process(&k, None, |_| async {
            Ok::<_, HandlerError<String>>(dedup_core::Completion::store(Bytes::from_static(
                b"shipped",
            )))
        })
        .await
        .unwrap();
    let Processed::Executed {
        token, attempts, ..
    } = done
    else {
        panic!("expected the adopted key to run, got {done:?}");
    };
    assert!(token.get() > dead_token);
    assert_eq!(attempts, 2);
}
