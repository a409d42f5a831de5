//! `Dedup::process_batch` (lease mode by the batch) on top of each store: repeats, each failure
//! alone, no wait for a held key, one heartbeat past the lease, a batch taken over fenced whole,
//! its own leases adopted after lost replies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dedup_core::{
    AfterHandlerError, BatchItem, Completion, Dedup, Fingerprint, HandlerError, Policy,
    ProcessError, Processed, State, Store,
};
use tokio::sync::watch;

use crate::support::{Boom, Faults, bytes, key, ms, until};

type Res = Result<Completion, HandlerError<Boom>>;

fn item(name: &str, payload: &[u8]) -> BatchItem {
    BatchItem::new(key(name), Some(Fingerprint::of(payload)))
}

fn name_of(items: &[BatchItem], i: usize) -> String {
    String::from_utf8(items[i].key.key_bytes().to_vec()).unwrap()
}

/// New keys run once each; a key done before replays; a key reused with another payload is
/// refused; repeats in the batch are answered after their first appearance, as its duplicates.
pub(crate) async fn process_batch_runs_each_key_once_and_answers_repeats<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(s);
    let before = dedup
        .process(&key("done"), Some(Fingerprint::of(b"d")), |_| async {
            Ok::<_, HandlerError<Boom>>(Completion::store(bytes("old")))
        })
        .await
        .unwrap();
    assert!(before.executed());
    dedup
        .process(&key("other"), Some(Fingerprint::of(b"x")), |_| async {
            Ok::<_, HandlerError<Boom>>(Completion::store(bytes("x")))
        })
        .await
        .unwrap();
    let items = vec![
        item("a", b"a"),
        item("b", b"b"),
        item("a", b"a"),
        item("done", b"d"),
        item("other", b"y"),
        item("b", b"changed"),
    ];
    let runs = AtomicU32::new(0);
    let answers = dedup
        .process_batch(&items, |i, _lease| {
            runs.fetch_add(1, Ordering::SeqCst);
            let name = name_of(&items, i);
            async move { Ok::<_, HandlerError<Boom>>(Completion::store(format!("ran {name}"))) }
        })
        .await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "a and b ran once each");
    assert!(matches!(&answers[0], Ok(Processed::Executed { result, .. }) if result == "ran a"));
    assert!(matches!(&answers[1], Ok(Processed::Executed { result, .. }) if result == "ran b"));
    assert!(matches!(&answers[2], Ok(Processed::Replayed { result }) if result == "ran a"));
    assert!(matches!(&answers[3], Ok(Processed::Replayed { result }) if result == "old"));
    assert!(
        matches!(&answers[4], Err(ProcessError::PayloadMismatch { .. })),
        "{:?}",
        answers[4]
    );
    assert!(
        matches!(&answers[5], Err(ProcessError::PayloadMismatch { .. })),
        "{:?}",
        answers[5]
    );
    // And again: everything replays, nothing runs.
    let again = dedup
        .process_batch(&items[..2], |_, _| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<Boom>>(Completion::store(bytes("again")))
        })
        .await;
    assert!(
        again
            .iter()
            .all(|a| matches!(a, Ok(Processed::Replayed { .. })))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Each message's failure is its own: a retryable failure releases its key, a permanent one
/// makes it FAILED, a panic counts as retryable (also one before the handler's first await); the
/// neighbours complete.
pub(crate) async fn process_batch_fails_each_message_alone<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(Arc::clone(&s));
    let items: Vec<BatchItem> = ["ok1", "retry", "perm", "panic", "ok2", "panic_now"]
        .iter()
        .map(|n| item(n, n.as_bytes()))
        .collect();
    let answers = dedup
        .process_batch(&items, |i, _lease| {
            let name = name_of(&items, i);
            // Before its first await: the call itself panics.
            assert!(name != "panic_now", "the handler fell over at once");
            async move {
                match name.as_str() {
                    "retry" => Res::Err(HandlerError::Retryable(Boom("later"))),
                    "perm" => Res::Err(HandlerError::Permanent(Boom("never"))),
                    "panic" => panic!("the handler fell over"),
                    _ => Ok(Completion::store(format!("ran {name}"))),
                }
            }
        })
        .await;
    assert!(matches!(answers[0], Ok(Processed::Executed { .. })));
    assert!(matches!(
        answers[1],
        Err(ProcessError::Handler {
            after: AfterHandlerError::Released { attempts: 1 },
            ..
        })
    ));
    assert!(matches!(
        answers[2],
        Err(ProcessError::Handler {
            after: AfterHandlerError::Failed { attempts: 1 },
            ..
        })
    ));
    assert!(
        matches!(
            &answers[3],
            Err(ProcessError::Panicked { message, after: AfterHandlerError::Released { attempts: 1 }, .. })
                if message.contains("fell over")
        ),
        "{:?}",
        answers[3]
    );
    assert!(matches!(answers[4], Ok(Processed::Executed { .. })));
    assert!(
        matches!(
            &answers[5],
            Err(ProcessError::Panicked { message, after: AfterHandlerError::Released { attempts: 1 }, .. })
                if message.contains("at once")
        ),
        "{:?}",
        answers[5]
    );
    let state = |n: &'static str| {
        let s = Arc::clone(&s);
        async move { s.get(&key(n)).await.unwrap().unwrap().state }
    };
    assert_eq!(state("ok1").await, State::Completed);
    assert_eq!(state("retry").await, State::Released);
    assert_eq!(state("perm").await, State::Failed);
    assert_eq!(state("panic").await, State::Released);
    assert_eq!(state("ok2").await, State::Completed);
    assert_eq!(state("panic_now").await, State::Released);
}

/// A key another holder runs answers InFlight at once (the batch does not wait for it, however
/// long the in-flight wait), and the batch's other keys run.
pub(crate) async fn process_batch_does_not_wait_for_a_held_key<S: Store>(s: Arc<S>) {
    let holder = Dedup::new(Arc::clone(&s));
    let dedup = Dedup::new(Arc::clone(&s))
        .with_in_flight_wait(Duration::from_secs(600))
        .unwrap();
    let (release, released) = watch::channel(false);
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let held_key = key("held");
    let held = holder.process(&held_key, None, move |_| async move {
        let _ = started_tx.send(());
        let mut released = released;
        let _ = released.wait_for(|r| *r).await;
        Ok::<_, HandlerError<Boom>>(Completion::store(bytes("theirs")))
    });
    let items = vec![
        BatchItem::new(key("held"), None),
        BatchItem::new(key("x"), None),
    ];
    let batch = async {
        started.await.unwrap();
        let answers = tokio::time::timeout(
            Duration::from_secs(60),
            dedup.process_batch(&items, |_, _| async {
                Ok::<_, HandlerError<Boom>>(Completion::store(bytes("ours")))
            }),
        )
        .await
        .expect("the batch waited for the held key");
        release.send(true).unwrap();
        answers
    };
    let (held, answers) = tokio::join!(held, batch);
    assert!(
        matches!(answers[0], Err(ProcessError::InFlight { .. })),
        "{:?}",
        answers[0]
    );
    assert!(matches!(answers[1], Ok(Processed::Executed { .. })));
    assert!(held.unwrap().executed());
}

/// One heartbeat keeps every lease of the batch alive while its handlers outlive the lease: a
/// second instance claiming one of the keys meanwhile is told it is in flight.
pub(crate) async fn process_batch_heartbeat_outlives_the_lease<S: Store>(s: Arc<S>) {
    // 1.5 s: a 300 ms lease lapsed once on two loaded cores (the whole suite running), when a
    // heartbeat came more than 200 ms late; the case is about outliving the lease, not about
    // how late a starved timer may fire.
    let policy = Policy::default().with_lease(ms(1500));
    let dedup = Dedup::new(Arc::clone(&s)).with_policy(policy).unwrap();
    let other = Dedup::new(Arc::clone(&s)).with_policy(policy).unwrap();
    let items: Vec<BatchItem> = ["h1", "h2", "h3"].iter().map(|n| item(n, b"p")).collect();
    let probes = AtomicU32::new(0);
    let answers = dedup
        .process_batch(&items, |i, _lease| {
            let (other, items, probes) = (&other, &items, &probes);
            async move {
                // Several lease lengths long, probing from another instance on the way.
                for _ in 0..4 {
                    tokio::time::sleep(ms(1500)).await;
                    if i == 0 {
                        let probe = other
                            .process(&items[0].key, items[0].fingerprint, |_| async {
                                Ok::<_, HandlerError<Boom>>(Completion::store(bytes("stolen")))
                            })
                            .await;
                        assert!(
                            matches!(probe, Err(ProcessError::InFlight { .. })),
                            "{probe:?}"
                        );
                        probes.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Ok::<_, HandlerError<Boom>>(Completion::store(bytes("ours")))
            }
        })
        .await;
    assert_eq!(probes.load(Ordering::SeqCst), 4);
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(Processed::Executed { .. }))),
        "{answers:?}"
    );
}

/// A batch whose heartbeat cannot reach the store loses its leases: another instance takes the
/// keys over and runs them, and the batch's completions are fenced out, every one of them.
pub(crate) async fn process_batch_taken_over_is_fenced_whole<S: Store>(s: Arc<S>) {
    let policy = Policy::default().with_lease(ms(300));
    let down = Faults::new(Arc::clone(&s)).refusing_extends(u32::MAX);
    let dedup = Dedup::new(&down).with_policy(policy).unwrap();
    let other = Dedup::new(Arc::clone(&s))
        .with_policy(Policy::default().with_lease(Duration::from_secs(30)))
        .unwrap();
    let items: Vec<BatchItem> = ["t1", "t2"].iter().map(|n| item(n, b"p")).collect();
    let (taken, taken_rx) = watch::channel(false);
    let started = AtomicU32::new(0);
    let batch = dedup.process_batch(&items, |_, _lease| {
        let mut taken_rx = taken_rx.clone();
        started.fetch_add(1, Ordering::SeqCst);
        async move {
            let _ = taken_rx.wait_for(|t| *t).await;
            Ok::<_, HandlerError<Boom>>(Completion::store(bytes("late")))
        }
    });
    let takeover = async {
        // Only once the batch holds both keys.
        until("the batch's handlers started", || async {
            started.load(Ordering::SeqCst) == 2
        })
        .await;
        for it in &items {
            until("the other instance took the key over", || async {
                other
                    .process(&it.key, it.fingerprint, |_| async {
                        Ok::<_, HandlerError<Boom>>(Completion::store(bytes("theirs")))
                    })
                    .await
                    .is_ok()
            })
            .await;
        }
        taken.send(true).unwrap();
    };
    let (answers, ()) = tokio::join!(batch, takeover);
    for a in &answers {
        assert!(matches!(a, Err(ProcessError::LeaseLost { .. })), "{a:?}");
    }
    for it in &items {
        let r = s.get(&it.key).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.result.as_deref()),
            (State::Completed, Some(&b"theirs"[..]))
        );
    }
}

/// The replies of two claims are lost after they applied: the batch reads them back and adopts
/// its own leases (its owner ids) at once, rather than waiting them out as someone else's.
pub(crate) async fn process_batch_adopts_its_own_claims_after_lost_replies<S: Store>(s: Arc<S>) {
    let lossy = Faults::new(Arc::clone(&s)).losing_claims(2);
    let dedup = Dedup::new(&lossy)
        .with_policy(Policy::default().with_lease(Duration::from_secs(30)))
        .unwrap();
    let items: Vec<BatchItem> = ["l1", "l2", "l3"].iter().map(|n| item(n, b"p")).collect();
    let runs = AtomicU32::new(0);
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        dedup.process_batch(&items, |_, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError<Boom>>(Completion::store(bytes("ran"))) }
        }),
    )
    .await
    .expect("the batch waited out its own leases");
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, Ok(Processed::Executed { .. }))),
        "{answers:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// Two batches run at once with handlers that outlive their leases: one heartbeat extends the
/// leases of both (a call carries both batches' leases), not one heartbeat per batch.
pub(crate) async fn process_batch_one_heartbeat_serves_every_running_batch<S: Store>(s: Arc<S>) {
    let counted = Faults::new(Arc::clone(&s));
    let dedup = Dedup::new(&counted)
        .with_policy(Policy::default().with_lease(ms(300)))
        .unwrap();
    let first = vec![item("hb1", b"p")];
    let second = vec![item("hb2", b"p")];
    let slow = |_, _| async {
        tokio::time::sleep(ms(1200)).await;
        Ok::<_, HandlerError<Boom>>(Completion::store(bytes("ran")))
    };
    let (a, b) = tokio::join!(
        dedup.process_batch(&first, slow),
        dedup.process_batch(&second, slow)
    );
    assert!(matches!(a[0], Ok(Processed::Executed { .. })), "{a:?}");
    assert!(matches!(b[0], Ok(Processed::Executed { .. })), "{b:?}");
    assert!(
        counted.extend_batch_max.load(Ordering::SeqCst) >= 2,
        "no heartbeat carried both batches' leases"
    );
}
