//! Store-level cases: every transition and answer, fencing, retention, bad input.

use std::sync::Arc;

use dedup_core::{
    AfterFailure, ClaimOutcome, ClaimRequest, Fingerprint, IdempotencyKey, InputError, Lease,
    Policy, State, Store, StoreError,
};
use tokio::time::sleep;

use crate::support::{acquired, bytes, key, ms, req, scope, short_lease};

pub(crate) async fn new_key_is_acquired<S: Store>(s: Arc<S>) {
    let k = key("order-1");
    let fp = Fingerprint::of(b"payload");
    let lease = acquired(
        s.claim(&req(&k, "a").with_fingerprint(Some(fp)))
            .await
            .unwrap(),
    );
    assert_eq!(lease.attempts, 1);
    assert_eq!(lease.key, k);
    let rec = s
        .get(&k)
        .await
        .unwrap()
        .expect("a claimed key has a record");
    assert_eq!(rec.state, State::InProgress);
    assert_eq!(rec.token, lease.token);
    assert_eq!(rec.owner.as_ref().map(|o| o.as_str()), Some("a"));
    assert_eq!(rec.fingerprint, Some(fp));
    assert_eq!(rec.lease_until, Some(lease.lease_until));
    // The lease is measured from the store's clock: about 30 s from the claim.
    let lease_len = lease.lease_until.since(rec.created_at);
    assert_eq!(lease_len, Policy::default().lease, "{lease_len:?}");
    assert!(rec.expires_at > lease.lease_until);
    assert_eq!(rec.result, None);
}

pub(crate) async fn absent_key_reads_none<S: Store>(s: Arc<S>) {
    assert_eq!(s.get(&key("never-claimed")).await.unwrap(), None);
}

pub(crate) async fn live_lease_answers_in_flight<S: Store>(s: Arc<S>) {
    let k = key("k");
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    match s.claim(&req(&k, "b")).await.unwrap() {
        ClaimOutcome::InFlight { owner, lease_until } => {
            assert_eq!(owner.as_ref().map(|o| o.as_str()), Some("a"));
            assert_eq!(lease_until, Some(lease.lease_until));
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    // The answer changed nothing.
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.token, rec.attempts), (lease.token, 1));
}

pub(crate) async fn completed_key_replays_its_result<S: Store>(s: Arc<S>) {
    let k = key("k");
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    s.complete(&lease, b"receipt-77").await.unwrap();
    for owner in ["b", "c"] {
        assert_eq!(
            s.claim(&req(&k, owner)).await.unwrap(),
            ClaimOutcome::Completed {
                result: bytes("receipt-77"),
                token: lease.token,
                fingerprint: None,
            }
        );
    }
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(rec.result, Some(bytes("receipt-77")));
    assert_eq!(rec.lease_until, None);
    // A completed record keeps no owner: nothing reads it once the effect is recorded, and it
    // would take 20 to 40 bytes on every record of the window.
    assert_eq!(rec.owner, None);
    // A second completion, even under the right token, is refused.
    assert!(
        s.complete(&lease, b"again")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

pub(crate) async fn payload_mismatch_is_refused_in_every_state<S: Store>(s: Arc<S>) {
    let k = key("k");
    let one = Some(Fingerprint::of(b"one"));
    let two = Some(Fingerprint::of(b"two"));
    let lease = acquired(s.claim(&req(&k, "a").with_fingerprint(one)).await.unwrap());
    assert_eq!(
        s.claim(&req(&k, "b").with_fingerprint(two)).await.unwrap(),
        ClaimOutcome::PayloadMismatch
    );
    s.complete(&lease, b"ok").await.unwrap();
    assert_eq!(
        s.claim(&req(&k, "b").with_fingerprint(two)).await.unwrap(),
        ClaimOutcome::PayloadMismatch
    );
    // The same payload, or none, replays.
    for fp in [one, None] {
        assert!(matches!(
            s.claim(&req(&k, "c").with_fingerprint(fp)).await.unwrap(),
            ClaimOutcome::Completed { .. }
        ));
    }
    // A released key is not taken over by a different payload either.
    let k2 = key("k2");
    let l2 = acquired(s.claim(&req(&k2, "a").with_fingerprint(one)).await.unwrap());
    s.fail_retryable(&l2, "flaky").await.unwrap();
    assert_eq!(
        s.claim(&req(&k2, "b").with_fingerprint(two)).await.unwrap(),
        ClaimOutcome::PayloadMismatch
    );
    assert_eq!(s.get(&k2).await.unwrap().unwrap().state, State::Released);
}

pub(crate) async fn stale_token_is_fenced_out_of_every_call<S: Store>(s: Arc<S>) {
    let k = key("k");
    let zombie = acquired(
        s.claim(&req(&k, "zombie").with_policy(short_lease(150)))
            .await
            .unwrap(),
    );
    sleep(ms(300)).await;
    let fresh = acquired(s.claim(&req(&k, "fresh")).await.unwrap());
    assert!(
        fresh.token > zombie.token,
        "{:?} !> {:?}",
        fresh.token,
        zombie.token
    );
    assert_eq!(fresh.attempts, 2);

    let lost = |e: StoreError| assert!(e.is_lease_lost() && !e.is_retryable(), "{e:?}");
    lost(s.complete(&zombie, b"late").await.unwrap_err());
    lost(s.extend(&zombie).await.unwrap_err());
    lost(s.fail_retryable(&zombie, "x").await.unwrap_err());
    lost(s.fail_permanent(&zombie, "x").await.unwrap_err());

    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.state, State::InProgress);
    assert_eq!(rec.token, fresh.token);
    assert_eq!(rec.owner.as_ref().map(|o| o.as_str()), Some("fresh"));
    s.complete(&fresh, b"ok").await.unwrap();
}

pub(crate) async fn retryable_failures_release_then_fail<S: Store>(s: Arc<S>) {
    let k = key("k");
    let policy = Policy::default().with_max_attempts(3);
    let mut last_token = None;
    for attempt in 1..=3u32 {
        let lease = acquired(s.claim(&req(&k, "a").with_policy(policy)).await.unwrap());
        assert_eq!(lease.attempts, attempt);
        assert!(last_token < Some(lease.token));
        last_token = Some(lease.token);
        let after = s.fail_retryable(&lease, "upstream 503").await.unwrap();
        let rec = s.get(&k).await.unwrap().unwrap();
        if attempt < 3 {
            assert_eq!(after, AfterFailure::Released { attempts: attempt });
            assert_eq!(rec.state, State::Released);
            assert_eq!(rec.failure.as_deref(), Some("upstream 503"));
            assert_eq!(rec.lease_until, None);
        } else {
            assert_eq!(after, AfterFailure::Failed { attempts: 3 });
            assert_eq!(rec.state, State::Failed);
        }
        // A released or failed record keeps its last holder (who failed it, for an operator).
        assert_eq!(rec.owner.as_ref().map(|o| o.as_str()), Some("a"));
        assert_eq!(rec.attempts, attempt);
    }
    match s.claim(&req(&k, "b").with_policy(policy)).await.unwrap() {
        ClaimOutcome::Failed { reason, attempts } => {
            assert_eq!(attempts, 3);
            assert!(
                reason.contains("out of attempts") && reason.contains("upstream 503"),
                "{reason}"
            );
        }
        other => panic!("expected Failed, got {other:?}"),
    }
}

pub(crate) async fn permanent_failure_makes_poison<S: Store>(s: Arc<S>) {
    let k = key("k");
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    s.fail_permanent(&lease, "amount is negative")
        .await
        .unwrap();
    assert_eq!(
        s.claim(&req(&k, "b")).await.unwrap(),
        ClaimOutcome::Failed {
            reason: "amount is negative".into(),
            attempts: 1
        }
    );
    assert!(
        s.complete(&lease, b"late")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

pub(crate) async fn expiring_leases_exhaust_the_attempts<S: Store>(s: Arc<S>) {
    // A message that kills its consumer every time must not loop forever.
    let k = key("k");
    let policy = short_lease(100).with_max_attempts(2);
    let first = acquired(s.claim(&req(&k, "a").with_policy(policy)).await.unwrap());
    sleep(ms(200)).await;
    let second = acquired(s.claim(&req(&k, "b").with_policy(policy)).await.unwrap());
    assert_eq!(second.attempts, 2);
    assert!(second.token > first.token);
    sleep(ms(200)).await;
    match s.claim(&req(&k, "c").with_policy(policy)).await.unwrap() {
        ClaimOutcome::Failed { reason, attempts } => {
            assert_eq!(attempts, 2);
            assert!(reason.contains("lease expired"), "{reason}");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.state, State::Failed);
    assert!(
        s.complete(&second, b"late")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

pub(crate) async fn extend_keeps_the_lease_alive<S: Store>(s: Arc<S>) {
    let k = key("k");
    let lease = acquired(
        s.claim(&req(&k, "a").with_policy(short_lease(400)))
            .await
            .unwrap(),
    );
    let mut until = lease.lease_until;
    for _ in 0..3 {
        sleep(ms(200)).await;
        let next = s.extend(&lease).await.unwrap();
        assert!(next > until, "{next:?} !> {until:?}");
        until = next;
    }
    // 600 ms after a 400 ms claim, the lease still holds.
    assert!(matches!(
        s.claim(&req(&k, "b").with_policy(short_lease(400)))
            .await
            .unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    s.complete(&lease, b"ok").await.unwrap();
}

pub(crate) async fn concurrent_claims_have_one_winner<S: Store + 'static>(s: Arc<S>) {
    for round in 0..5 {
        let k = key(format!("hot-{round}"));
        let mut tasks = Vec::new();
        for i in 0..16 {
            let (s, k) = (Arc::clone(&s), k.clone());
            tasks.push(tokio::spawn(async move {
                s.claim(&req(&k, &format!("w{i}"))).await
            }));
        }
        let mut won = 0;
        for t in tasks {
            match t.await.unwrap().unwrap() {
                ClaimOutcome::Acquired(_) => won += 1,
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(won, 1, "round {round}: exactly one claimer may win");
    }
}

async fn completed<S: Store>(s: &S, k: &IdempotencyKey, policy: Policy) -> Lease {
    let lease = acquired(s.claim(&req(k, "a").with_policy(policy)).await.unwrap());
    s.complete(&lease, b"ok").await.unwrap();
    lease
}

pub(crate) async fn purge_is_bounded_and_takes_only_expired_records<S: Store>(s: Arc<S>) {
    let gone = Policy::default().with_retention(ms(0));
    for i in 0..5 {
        completed(&*s, &key(format!("old-{i}")), gone).await;
    }
    let kept = key("kept");
    completed(&*s, &kept, Policy::default()).await;
    let live = key("live");
    acquired(s.claim(&req(&live, "a")).await.unwrap());
    sleep(ms(20)).await;

    assert_eq!(s.purge(2).await.unwrap(), 2, "at most the limit");
    assert_eq!(s.purge(10).await.unwrap(), 3);
    assert_eq!(s.purge(10).await.unwrap(), 0);
    for i in 0..5 {
        assert_eq!(s.get(&key(format!("old-{i}"))).await.unwrap(), None);
    }
    assert_eq!(s.get(&kept).await.unwrap().unwrap().state, State::Completed);
    assert_eq!(
        s.get(&live).await.unwrap().unwrap().state,
        State::InProgress
    );
}

pub(crate) async fn a_record_past_retention_runs_again<S: Store>(s: Arc<S>) {
    // Documented behaviour: a duplicate delivered after the retention window runs again, whether
    // or not the purge has removed the record yet.
    let k = key("k");
    let old = completed(&*s, &k, Policy::default().with_retention(ms(50))).await;
    sleep(ms(100)).await;
    let again = acquired(s.claim(&req(&k, "b")).await.unwrap());
    assert_eq!(again.attempts, 1);
    assert!(again.token > old.token);
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.result.clone()), (State::InProgress, None));
}

pub(crate) async fn tokens_never_repeat_after_a_purge<S: Store>(s: Arc<S>) {
    let k = key("k");
    let policy = short_lease(50).with_retention(ms(0));
    let first = acquired(s.claim(&req(&k, "a").with_policy(policy)).await.unwrap());
    sleep(ms(100)).await;
    assert_eq!(
        s.purge(100).await.unwrap(),
        1,
        "the abandoned claim is purged"
    );
    let second = acquired(s.claim(&req(&k, "b")).await.unwrap());
    assert!(second.token > first.token);
    // The first holder, back from a long pause, is still fenced out.
    assert!(
        s.complete(&first, b"zombie")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
    s.complete(&second, b"ok").await.unwrap();
}

pub(crate) async fn scopes_are_isolated<S: Store>(s: Arc<S>) {
    let a = IdempotencyKey::new(scope("tenant-a"), b"invoice-1").unwrap();
    let b = IdempotencyKey::new(scope("tenant-b"), b"invoice-1").unwrap();
    let la = acquired(s.claim(&req(&a, "x")).await.unwrap());
    acquired(s.claim(&req(&b, "y")).await.unwrap());
    s.complete(&la, b"a-done").await.unwrap();
    assert_eq!(s.get(&b).await.unwrap().unwrap().state, State::InProgress);
}

pub(crate) async fn binary_keys_are_kept_as_bytes<S: Store>(s: Arc<S>) {
    let raw = key(b"\xff\xfe\x00id");
    let lossy = key("\u{fffd}\u{fffd}\u{0}id");
    let lr = acquired(s.claim(&req(&raw, "a")).await.unwrap());
    acquired(s.claim(&req(&lossy, "b")).await.unwrap());
    s.complete(&lr, b"\x00\x01binary result").await.unwrap();
    let rec = s.get(&raw).await.unwrap().unwrap();
    assert_eq!(rec.key.key_bytes(), b"\xff\xfe\x00id");
    assert_eq!(rec.result.as_deref(), Some(&b"\x00\x01binary result"[..]));
    assert_eq!(
        s.get(&lossy).await.unwrap().unwrap().state,
        State::InProgress
    );
}

pub(crate) async fn oversized_result_is_refused_and_changes_nothing<S: Store>(s: Arc<S>) {
    let k = key("k");
    let policy = Policy::default().with_max_result_bytes(8);
    let lease = acquired(s.claim(&req(&k, "a").with_policy(policy)).await.unwrap());
    let err = s.complete(&lease, b"123456789").await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Input(InputError::ResultTooLarge { len: 9, max: 8 })
        ),
        "{err:?}"
    );
    assert!(!err.is_retryable() && !err.is_outcome_unknown());
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::InProgress);
    s.complete(&lease, b"12345678").await.unwrap();
}

pub(crate) async fn invalid_policy_is_refused<S: Store>(s: Arc<S>) {
    let k = key("k");
    let zero = ClaimRequest::new(k.clone(), dedup_core::OwnerId::new("a"))
        .with_policy(Policy::default().with_max_attempts(0));
    assert!(matches!(
        s.claim(&zero).await,
        Err(StoreError::Input(InputError::Policy(_)))
    ));
    assert_eq!(s.get(&k).await.unwrap(), None);
}

pub(crate) async fn batch_calls_answer_in_order<S: Store>(s: Arc<S>) {
    let (a, b) = (key("a"), key("b"));
    let out = s
        .claim_batch(&[req(&a, "x"), req(&b, "x"), req(&a, "y")])
        .await;
    let la = acquired(out[0].clone().unwrap());
    let lb = acquired(out[1].clone().unwrap());
    assert!(
        matches!(out[2], Ok(ClaimOutcome::InFlight { .. })),
        "{:?}",
        out[2]
    );
    let done = s
        .complete_batch(&[
            (la.clone(), bytes("ra")),
            (lb, bytes("rb")),
            (la, bytes("again")),
        ])
        .await;
    assert!(done[0].is_ok() && done[1].is_ok());
    assert!(done[2].as_ref().unwrap_err().is_lease_lost());
    assert!(matches!(
        s.claim(&req(&b, "z")).await.unwrap(),
        ClaimOutcome::Completed { result, .. } if result == bytes("rb")
    ));
    // Completed by the batch, as one by one: no owner kept.
    for k in [&a, &b] {
        let rec = s.get(k).await.unwrap().unwrap();
        assert_eq!((rec.state, rec.owner), (State::Completed, None), "{k}");
    }
}

pub(crate) async fn longest_key_and_scope_round_trip<S: Store>(s: Arc<S>) {
    let long_scope = scope(&"s".repeat(dedup_core::MAX_SCOPE_LEN));
    let k = IdempotencyKey::new(long_scope, vec![0xabu8; dedup_core::MAX_KEY_LEN]).unwrap();
    let lease = acquired(s.claim(&req(&k, "a")).await.unwrap());
    s.complete(&lease, &[0u8; 1024]).await.unwrap();
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.key, k);
    assert_eq!(rec.result.as_deref().map(<[u8]>::len), Some(1024));
}

/// A batch answers every kind of key exactly as single claims made one after the other would.
pub(crate) async fn batch_claim_answers_like_single_claims<S: Store>(s: Arc<S>) {
    let fp = Fingerprint::of(b"payload");
    let other_fp = Fingerprint::of(b"another payload");
    let quick = short_lease(100).with_max_attempts(2);
    // Set up one key in each state.
    let done = key("done");
    let l = acquired(s.claim(&req(&done, "a")).await.unwrap());
    s.complete(&l, b"receipt").await.unwrap();
    let busy = key("busy");
    let busy_lease = acquired(s.claim(&req(&busy, "a")).await.unwrap());
    let released = key("released");
    let l = acquired(s.claim(&req(&released, "a")).await.unwrap());
    s.fail_retryable(&l, "503").await.unwrap();
    let poison = key("poison");
    let l = acquired(s.claim(&req(&poison, "a")).await.unwrap());
    s.fail_permanent(&l, "negative amount").await.unwrap();
    let fingerprinted = key("fingerprinted");
    let l = acquired(
        s.claim(&req(&fingerprinted, "a").with_fingerprint(Some(fp)))
            .await
            .unwrap(),
    );
    s.complete(&l, b"fp-done").await.unwrap();
    let expired = key("expired");
    let first = acquired(
        s.claim(&req(&expired, "a").with_policy(quick))
            .await
            .unwrap(),
    );
    let exhausted = key("exhausted");
    acquired(
        s.claim(&req(&exhausted, "a").with_policy(quick))
            .await
            .unwrap(),
    );
    sleep(ms(150)).await;
    acquired(
        s.claim(&req(&exhausted, "b").with_policy(quick))
            .await
            .unwrap(),
    );
    sleep(ms(150)).await;

    let fresh = key("fresh");
    let twice = key("twice");
    let bad = Policy::default().with_max_attempts(0);
    let out = s
        .claim_batch(&[
            req(&fresh, "x"),
            req(&done, "x"),
            req(&busy, "x"),
            req(&released, "x"),
            req(&poison, "x"),
            req(&fingerprinted, "x").with_fingerprint(Some(other_fp)),
            req(&fingerprinted, "x").with_fingerprint(Some(fp)),
            req(&expired, "x").with_policy(quick),
            req(&exhausted, "x").with_policy(quick),
            req(&twice, "x"),
            req(&twice, "y"),
            req(&key("bad-policy"), "x").with_policy(bad),
            req(&done, "y"),
        ])
        .await;
    assert_eq!(out.len(), 13);
    let fresh_lease = acquired(out[0].clone().unwrap());
    assert_eq!((fresh_lease.attempts, fresh_lease.key.clone()), (1, fresh));
    assert_eq!(
        out[1].clone().unwrap(),
        ClaimOutcome::Completed {
            result: bytes("receipt"),
            token: s.get(&done).await.unwrap().unwrap().token,
            fingerprint: None,
        }
    );
    match out[2].clone().unwrap() {
        ClaimOutcome::InFlight { owner, lease_until } => {
            assert_eq!(owner.as_ref().map(|o| o.as_str()), Some("a"));
            assert_eq!(lease_until, Some(busy_lease.lease_until));
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    let retried = acquired(out[3].clone().unwrap());
    assert_eq!(retried.attempts, 2);
    assert_eq!(
        out[4].clone().unwrap(),
        ClaimOutcome::Failed {
            reason: "negative amount".into(),
            attempts: 1
        }
    );
    assert_eq!(out[5].clone().unwrap(), ClaimOutcome::PayloadMismatch);
    assert!(matches!(
        out[6].clone().unwrap(),
        ClaimOutcome::Completed { result, .. } if result == bytes("fp-done")
    ));
    let takeover = acquired(out[7].clone().unwrap());
    assert_eq!(takeover.attempts, 2);
    assert!(takeover.token > first.token);
    assert!(
        matches!(out[8], Ok(ClaimOutcome::Failed { attempts: 2, .. })),
        "{:?}",
        out[8]
    );
    let twice_lease = acquired(out[9].clone().unwrap());
    match out[10].clone().unwrap() {
        ClaimOutcome::InFlight { owner, .. } => {
            assert_eq!(owner.as_ref().map(|o| o.as_str()), Some("x"));
        }
        other => panic!("the repeat of a key is its duplicate, got {other:?}"),
    }
    assert!(matches!(
        out[11],
        Err(StoreError::Input(InputError::Policy(_)))
    ));
    assert!(matches!(out[12], Ok(ClaimOutcome::Completed { .. })));
    // What the batch granted is held, fenced, in the store.
    let rec = s.get(&twice).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.token),
        (State::InProgress, twice_lease.token)
    );
    assert_eq!(s.get(&key("bad-policy")).await.unwrap(), None);
    assert!(
        s.complete(&first, b"zombie")
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

/// Completions in a batch are fenced one by one: a stale lease and an oversized result fail
/// alone, the others commit; the same lease twice completes once.
pub(crate) async fn batch_completion_is_fenced_per_item<S: Store>(s: Arc<S>) {
    let quick = short_lease(100);
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let la = acquired(s.claim(&req(&a, "x")).await.unwrap());
    let stale = acquired(s.claim(&req(&b, "x").with_policy(quick)).await.unwrap());
    sleep(ms(150)).await;
    let fresh = acquired(s.claim(&req(&b, "y").with_policy(quick)).await.unwrap());
    let small = Policy::default().with_max_result_bytes(4);
    let lc = acquired(s.claim(&req(&c, "x").with_policy(small)).await.unwrap());
    let out = s
        .complete_batch(&[
            (stale.clone(), bytes("zombie")),
            (la.clone(), bytes("ra")),
            (lc.clone(), bytes("too large")),
            (la.clone(), bytes("again")),
        ])
        .await;
    assert!(out[0].as_ref().unwrap_err().is_lease_lost(), "{:?}", out[0]);
    assert!(out[1].is_ok(), "{:?}", out[1]);
    assert!(
        matches!(
            out[2],
            Err(StoreError::Input(InputError::ResultTooLarge { .. }))
        ),
        "{:?}",
        out[2]
    );
    assert!(out[3].as_ref().unwrap_err().is_lease_lost(), "{:?}", out[3]);
    let rec = s.get(&a).await.unwrap().unwrap();
    assert_eq!(rec.result, Some(bytes("ra")));
    let rec = s.get(&b).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.token), (State::InProgress, fresh.token));
    let rec = s.get(&c).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.result), (State::InProgress, None));
    // The live holders still complete.
    let out = s
        .complete_batch(&[(fresh, bytes("rb")), (lc, bytes("rc"))])
        .await;
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

/// Batches over the same keys in opposite orders, at once: every key is granted exactly once,
/// and no batch fails (no deadlock between them).
pub(crate) async fn concurrent_batches_grant_each_key_once<S: Store + 'static>(s: Arc<S>) {
    let keys: Vec<IdempotencyKey> = (0..60).map(|i| key(format!("k{i}"))).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8usize {
        let s = Arc::clone(&s);
        let mut order = keys.clone();
        order.rotate_left(t * 7);
        if t % 2 == 1 {
            order.reverse();
        }
        tasks.spawn(async move {
            let reqs: Vec<ClaimRequest> = order.iter().map(|k| req(k, &format!("t{t}"))).collect();
            let out = s.claim_batch(&reqs).await;
            let mut won = Vec::new();
            for (r, o) in reqs.iter().zip(out) {
                match o.unwrap() {
                    ClaimOutcome::Acquired(lease) => won.push(lease),
                    ClaimOutcome::InFlight { .. } => {}
                    other => panic!("{}: unexpected {other:?}", r.key),
                }
            }
            won
        });
    }
    let mut granted = Vec::new();
    while let Some(won) = tasks.join_next().await {
        granted.extend(won.unwrap());
    }
    granted.sort_by(|a, b| a.key.key_bytes().cmp(b.key.key_bytes()));
    let names: Vec<&[u8]> = granted.iter().map(|l| l.key.key_bytes()).collect();
    let mut expected: Vec<&[u8]> = keys.iter().map(IdempotencyKey::key_bytes).collect();
    expected.sort();
    assert_eq!(names, expected, "each key granted exactly once");
    let items: Vec<(Lease, bytes::Bytes)> =
        granted.into_iter().map(|l| (l, bytes("done"))).collect();
    assert!(s.complete_batch(&items).await.iter().all(Result::is_ok));
}

/// A lease granted but never used is given back with its attempt: a first attempt's record goes
/// (fingerprint included), a later one's key is released with one attempt fewer. Fenced.
pub(crate) async fn withdraw_gives_the_attempt_back<S: Store>(s: Arc<S>) {
    let k = key("k");
    let fp = Fingerprint::of(b"one");
    let lease = acquired(
        s.claim(&req(&k, "a").with_fingerprint(Some(fp)))
            .await
            .unwrap(),
    );
    s.withdraw(&lease).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap(), None, "as if never claimed");
    assert!(matches!(
        s.withdraw(&lease).await,
        Err(StoreError::LeaseLost { .. })
    ));
    // Claimed again, even with another payload: nothing ran under the withdrawn claim.
    let other = Fingerprint::of(b"two");
    let again = acquired(
        s.claim(&req(&k, "b").with_fingerprint(Some(other)))
            .await
            .unwrap(),
    );
    assert_eq!(again.attempts, 1);
    assert!(again.token > lease.token);
    // A withdrawal after a real failure keeps that failure's attempt.
    s.fail_retryable(&again, "503").await.unwrap();
    let third = acquired(
        s.claim(&req(&k, "c").with_fingerprint(Some(other)))
            .await
            .unwrap(),
    );
    assert_eq!(third.attempts, 2);
    s.withdraw(&third).await.unwrap();
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.attempts), (State::Released, 1));
    assert_eq!(rec.fingerprint, Some(other));
    assert!(matches!(
        s.withdraw(&third).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let fourth = acquired(
        s.claim(&req(&k, "d").with_fingerprint(Some(other)))
            .await
            .unwrap(),
    );
    assert_eq!(fourth.attempts, 2);
}
