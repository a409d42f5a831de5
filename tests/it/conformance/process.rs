//! `Dedup::process` on top of each store: the handler runs once, duplicates replay. Including a
//! 32-task storm and injected lost replies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dedup_core::{
    AfterHandlerError, Completion, Dedup, Fingerprint, HandlerError, Policy, ProcessError,
    Processed, State, Store,
};
use tokio::time::sleep;

use crate::support::{Boom, Faults, bytes, key, ms, until};

type Res = Result<Completion, HandlerError<Boom>>;

fn ok(result: &'static str) -> Res {
    Ok(Completion::store(bytes(result)))
}

pub(crate) async fn process_executes_once_and_replays<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(s);
    let k = key("evt-1");
    let runs = AtomicU32::new(0);
    for i in 0..3 {
        let done = dedup
            .process(&k, Some(Fingerprint::of(b"p")), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                ok("charged")
            })
            .await
            .unwrap();
        assert_eq!(done.result(), &bytes("charged"));
        assert_eq!(done.executed(), i == 0);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let err = dedup
        .process(&k, Some(Fingerprint::of(b"other")), |_| async { ok("x") })
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::PayloadMismatch { .. }) && !err.is_retryable(),
        "{err:?}"
    );
}

pub(crate) async fn process_releases_on_a_retryable_error<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(Arc::clone(&s));
    let k = key("evt");
    let err = dedup
        .process(&k, None, |_| async {
            Err::<Completion, _>(HandlerError::Retryable(Boom("503")))
        })
        .await
        .unwrap_err();
    match &err {
        ProcessError::Handler { after, source, .. } => {
            assert_eq!(*after, AfterHandlerError::Released { attempts: 1 });
            assert_eq!(source.0, "503");
        }
        other => panic!("expected Handler, got {other:?}"),
    }
    assert!(err.is_retryable());
    let done = dedup
        .process(&k, None, |_| async { ok("second time") })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 2, .. }),
        "{done:?}"
    );
}

pub(crate) async fn process_poisons_on_a_permanent_error<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(s);
    let k = key("evt");
    let err = dedup
        .process(&k, None, |_| async {
            Err::<Completion, _>(HandlerError::Permanent(Boom("bad iban")))
        })
        .await
        .unwrap_err();
    assert!(!err.is_retryable(), "{err:?}");
    let again = dedup
        .process(&k, None, |_| async { ok("never") })
        .await
        .unwrap_err();
    match again {
        ProcessError::Failed {
            reason, attempts, ..
        } => {
            assert_eq!((reason.as_str(), attempts), ("bad iban", 1));
        }
        other => panic!("expected Failed, got {other:?}"),
    }
}

pub(crate) async fn process_heartbeat_outlives_the_lease<S: Store + 'static>(s: Arc<S>) {
    // The handler runs until the heartbeat has carried its lease well past two lease lengths; a
    // duplicate that comes then is told InFlight instead of taking the key over. The handler
    // waits at a gate, not a timer, so no machine is too fast or too slow for it.
    let lease = Duration::from_secs(1);
    let policy = Policy::default().with_lease(lease);
    let dedup = Arc::new(
        Dedup::new(Arc::clone(&s))
            .with_policy(policy)
            .unwrap()
            .with_in_flight_wait(Duration::ZERO)
            .unwrap(),
    );
    let k = key("slow");
    let runs = Arc::new(AtomicU32::new(0));
    let (open, gate) = tokio::sync::oneshot::channel::<()>();
    let slow = {
        let (dedup, k, runs) = (Arc::clone(&dedup), k.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            dedup
                .process(&k, None, |ctx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.await;
                    assert!(!ctx.is_lost());
                    ok("slow result")
                })
                .await
        })
    };
    // The first lease's end, once the claim is in.
    let first = loop {
        if let Some(until) = s.get(&k).await.unwrap().and_then(|r| r.lease_until) {
            break until;
        }
        sleep(ms(10)).await;
    };
    until("the heartbeat to carry the lease past two lengths", || {
        let (s, k) = (Arc::clone(&s), k.clone());
        async move {
            let rec = s.get(&k).await.unwrap().unwrap();
            rec.lease_until.is_some_and(|u| u > first.plus(lease * 2))
        }
    })
    .await;
    let dup = dedup
        .process(&k, None, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok("duplicate ran")
        })
        .await;
    assert!(matches!(dup, Err(ProcessError::InFlight { .. })), "{dup:?}");
    open.send(()).unwrap();
    let done = slow.await.unwrap().unwrap();
    assert!(done.executed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Completed);
}

/// `try_process` answers a key another holder runs at once, whatever the in-flight wait, with
/// the holder's lease end and without running its handler; once the holder is done it replays.
pub(crate) async fn try_process_answers_a_held_key_at_once<S: Store + 'static>(s: Arc<S>) {
    let dedup = Arc::new(
        Dedup::new(Arc::clone(&s))
            .with_in_flight_wait(Duration::from_secs(600))
            .unwrap(),
    );
    let k = key("k");
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (open, gate) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (dedup, k) = (Arc::clone(&dedup), k.clone());
        tokio::spawn(async move {
            dedup
                .process(&k, None, |_| async {
                    let _ = started_tx.send(());
                    let _ = gate.await;
                    ok("first")
                })
                .await
        })
    };
    started.await.unwrap();
    let runs = AtomicU32::new(0);
    let answer = tokio::time::timeout(
        Duration::from_secs(60),
        dedup.try_process(&k, None, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok("second")
        }),
    )
    .await
    .expect("try_process waited for the holder");
    match answer {
        Err(ProcessError::InFlight { lease_until, .. }) => {
            assert!(lease_until.is_some(), "the holder's lease end is answered");
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    open.send(()).unwrap();
    assert!(first.await.unwrap().unwrap().executed());
    assert_eq!(
        dedup
            .try_process(&k, None, |_| async { ok("third") })
            .await
            .unwrap(),
        Processed::Replayed {
            result: bytes("first")
        }
    );
}

pub(crate) async fn process_waits_for_an_in_flight_duplicate<S: Store + 'static>(s: Arc<S>) {
    // The first holder runs until the duplicate has been told InFlight (counted by the store);
    // the duplicate waits for it and replays its result.
    let s = Arc::new(Faults::new(s));
    let dedup = Arc::new(
        Dedup::new(Arc::clone(&s))
            .with_in_flight_wait(Duration::from_secs(30))
            .unwrap(),
    );
    let k = key("k");
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (open, gate) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (dedup, k) = (Arc::clone(&dedup), k.clone());
        tokio::spawn(async move {
            dedup
                .process(&k, None, |_| async {
                    let _ = started_tx.send(());
                    let _ = gate.await;
                    ok("first")
                })
                .await
        })
    };
    started.await.unwrap();
    let dup = {
        let (dedup, k) = (Arc::clone(&dedup), k.clone());
        tokio::spawn(async move { dedup.process(&k, None, |_| async { ok("second") }).await })
    };
    until("the duplicate told InFlight", || {
        let n = s.in_flight.load(Ordering::SeqCst);
        async move { n > 0 }
    })
    .await;
    open.send(()).unwrap();
    assert_eq!(
        dup.await.unwrap().unwrap(),
        Processed::Replayed {
            result: bytes("first")
        }
    );
    assert!(first.await.unwrap().unwrap().executed());
}

pub(crate) async fn process_fails_a_key_whose_result_is_too_large<S: Store>(s: Arc<S>) {
    // The effect ran, but its result cannot be stored: the key becomes FAILED with the reason,
    // so a redelivery does not run the effect a second time.
    let dedup = Dedup::new(Arc::clone(&s))
        .with_policy(Policy::default().with_max_result_bytes(4))
        .unwrap();
    let k = key("k");
    let err = dedup
        .process(&k, None, |_| async { ok("too long") })
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProcessError::Store(ref e) if !e.is_retryable()),
        "{err:?}"
    );
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!(rec.state, State::Failed);
    assert!(
        rec.failure
            .as_deref()
            .unwrap()
            .contains("8 bytes long; the limit is 4"),
        "{:?}",
        rec.failure
    );
    let again = dedup
        .process(&k, None, |_| async { ok("x") })
        .await
        .unwrap_err();
    assert!(matches!(again, ProcessError::Failed { .. }), "{again:?}");
}

pub(crate) async fn process_reads_back_an_unknown_completion<S: Store>(s: Arc<S>) {
    // The completion lands but its reply is lost: process reads the record back and reports the
    // truth (executed), instead of failing or running the handler again.
    let flaky = Faults::new(Arc::clone(&s)).losing_completions(1);
    let dedup = Dedup::new(&flaky);
    let k = key("k");
    let runs = AtomicU32::new(0);
    let done = dedup
        .process(&k, None, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok("done")
        })
        .await
        .unwrap();
    assert!(done.executed());
    assert_eq!(
        flaky.lost_completes.load(Ordering::SeqCst),
        0,
        "the fault was injected"
    );
    let again = dedup
        .process(&k, None, |_| async { ok("again") })
        .await
        .unwrap();
    assert_eq!(
        again,
        Processed::Replayed {
            result: bytes("done")
        }
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

pub(crate) async fn process_reads_back_an_unknown_claim<S: Store>(s: Arc<S>) {
    // The claim lands but its reply is lost: the record holds our owner id, so the lease is ours
    // and the handler runs (once) instead of waiting out our own lease.
    let flaky = Faults::new(Arc::clone(&s)).losing_claims(1);
    let dedup = Dedup::new(&flaky)
        .with_in_flight_wait(Duration::ZERO)
        .unwrap();
    let k = key("k");
    let done = dedup
        .process(&k, None, |_| async { ok("done") })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 1, .. }),
        "{done:?}"
    );
    assert_eq!(
        flaky.lost_claims.load(Ordering::SeqCst),
        0,
        "the fault was injected"
    );
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Completed);
}

pub(crate) async fn process_storm_runs_each_key_once<S: Store + 'static>(s: Arc<S>) {
    // 32 tasks, 2,000 deliveries over 200 keys, duplicates racing each other.
    let dedup = Arc::new(
        Dedup::new(s)
            .with_in_flight_wait(Duration::from_secs(30))
            .unwrap(),
    );
    let effects: Arc<Mutex<HashMap<u32, u32>>> = Arc::default();
    let mut tasks = Vec::new();
    for t in 0..32u32 {
        let (dedup, effects) = (Arc::clone(&dedup), Arc::clone(&effects));
        tasks.push(tokio::spawn(async move {
            let mut executed = 0u32;
            for i in 0..62u32 {
                let n = (t * 7 + i * 13) % 200;
                let effects = Arc::clone(&effects);
                let done = dedup
                    .process(&key(format!("storm-{n}")), None, |_| async move {
                        *effects.lock().unwrap().entry(n).or_default() += 1;
                        tokio::task::yield_now().await;
                        Ok::<_, HandlerError<Boom>>(Completion::store(format!("r{n}")))
                    })
                    .await
                    .unwrap();
                assert_eq!(done.result(), format!("r{n}").as_bytes());
                executed += u32::from(done.executed());
            }
            executed
        }));
    }
    let mut executed = 0;
    for t in tasks {
        executed += t.await.unwrap();
    }
    let effects = effects.lock().unwrap();
    assert_eq!(effects.len(), 200, "every key ran");
    assert!(
        effects.values().all(|&n| n == 1),
        "a key ran twice: {effects:?}"
    );
    assert_eq!(executed, 200);
}

pub(crate) async fn process_adopts_its_own_claim_after_a_failed_read_back<S: Store>(s: Arc<S>) {
    // The claim lands, its reply is lost, and the read-back fails too: the retried claim finds
    // our own owner id in flight and adopts that lease instead of waiting it out.
    let flaky = Faults::new(Arc::clone(&s))
        .losing_claims(1)
        .refusing_gets(1);
    let dedup = Dedup::new(&flaky)
        .with_in_flight_wait(Duration::ZERO)
        .unwrap();
    let k = key("k");
    let done = dedup
        .process(&k, None, |_| async { ok("done") })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 1, .. }),
        "{done:?}"
    );
    assert_eq!(
        flaky.lost_claims.load(Ordering::SeqCst),
        0,
        "the lost reply was injected"
    );
    assert_eq!(
        flaky.refused_gets.load(Ordering::SeqCst),
        0,
        "the failed read was injected"
    );
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Completed);
}

/// The store refuses the completion eight times (about 1.3 s of backoff: far longer than the
/// five tries over 200 ms that gave up before); dedup keeps the lease and keeps trying, and the
/// effect runs once.
pub(crate) async fn process_keeps_completing_while_the_lease_holds<S: Store>(s: Arc<S>) {
    let down = Faults::new(Arc::clone(&s)).refusing_completions(8);
    let dedup = Dedup::new(&down)
        .with_policy(Policy::default().with_lease(Duration::from_secs(10)))
        .unwrap();
    let k = key("k");
    let runs = AtomicU32::new(0);
    let done = dedup
        .process(&k, None, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok("booked")
        })
        .await
        .unwrap();
    assert!(done.executed());
    assert_eq!(
        down.complete_tries.load(Ordering::SeqCst),
        9,
        "8 refusals, then it landed"
    );
    let again = dedup
        .process(&k, None, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            ok("again")
        })
        .await
        .unwrap();
    assert_eq!(again.result(), &bytes("booked"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Completed);
}

/// With a completion deadline shorter than the lease, dedup gives up at that deadline (the error
/// says a retry may help) and leaves the key in flight under its lease; it does not release it,
/// since the effect ran.
pub(crate) async fn process_gives_up_completing_at_the_callers_deadline<S: Store>(s: Arc<S>) {
    let down = Faults::new(Arc::clone(&s)).refusing_completions(u32::MAX);
    let dedup = Dedup::new(&down)
        .with_policy(Policy::default().with_lease(Duration::from_secs(30)))
        .unwrap()
        .with_completion_deadline(ms(300))
        .unwrap();
    let k = key("k");
    let started = tokio::time::Instant::now();
    let err = dedup
        .process(&k, None, |_| async { ok("booked") })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ProcessError::Store(e) if e.is_retryable()),
        "{err:?}"
    );
    assert!(started.elapsed() >= ms(300), "gave up before the deadline");
    assert!(down.complete_tries.load(Ordering::SeqCst) >= 2);
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::InProgress);
}

/// A handler that panics: the panic is caught, the key released with the attempt counted, and the
/// next delivery runs it as attempt 2.
pub(crate) async fn process_catches_a_panicking_handler<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(Arc::clone(&s));
    let k = key("k");
    let err = dedup
        .process(&k, None, |_| async {
            if k.key_bytes() == b"k" {
                panic!("handler bug");
            }
            ok("unreachable")
        })
        .await
        .unwrap_err();
    match &err {
        ProcessError::Panicked { message, after, .. } => {
            assert_eq!(message, "handler bug");
            assert_eq!(*after, AfterHandlerError::Released { attempts: 1 });
        }
        other => panic!("expected Panicked, got {other:?}"),
    }
    assert!(err.is_retryable());
    assert!(
        err.to_string().starts_with("handler panicked: handler bug"),
        "{err}"
    );
    let rec = s.get(&k).await.unwrap().unwrap();
    assert_eq!((rec.state, rec.attempts), (State::Released, 1));
    let done = dedup
        .process(&k, None, |_| async { ok("fixed") })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 2, .. }),
        "{done:?}"
    );
}

/// A handler that withdraws: no attempt is spent, and a first attempt leaves the key as if it
/// had never been claimed, so the next call runs it as attempt 1 again.
pub(crate) async fn process_withdraw_spends_no_attempt<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(Arc::clone(&s));
    let k = key("k");
    for _ in 0..3 {
        let err = dedup
            .process(&k, None, |_| async {
                Err::<Completion, _>(HandlerError::Withdraw(Boom("not kept")))
            })
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ProcessError::Handler {
                    after: AfterHandlerError::Released { attempts: 0 },
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.is_retryable());
        assert!(
            s.get(&k).await.unwrap().is_none(),
            "the key stands as if never claimed"
        );
    }
    let done = dedup
        .process(&k, None, |_| async { ok("kept") })
        .await
        .unwrap();
    assert!(
        matches!(done, Processed::Executed { attempts: 1, .. }),
        "{done:?}"
    );
}
