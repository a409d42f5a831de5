//! Instance identities: a restarted instance adopts what its dead predecessor left in flight.
//!
//! `adopt_ends_only_a_dead_predecessors_leases`: other identities, a name sharing a prefix, `_`
//! where LIKE has a wildcard, and this incarnation's own lease stay; the adopted key runs at once
//! as attempt 2 under a new token. `adopt_needs_a_valid_identity`. Processes killed with their
//! identity: `kill.rs`, `kafka.rs`, `pg_faults.rs`.

use std::sync::Arc;
use std::time::Duration;

use dedup_core::{
    Adoption, ClaimOutcome, ClaimRequest, Completion, Dedup, HandlerError, InstanceId, OwnerId,
    Policy, Processed, State, Store,
};

use crate::support::{Boom, bytes, key};

/// A claim held under `owner` with a long lease (a process that died holding it).
async fn held_by<S: Store>(s: &S, name: &str, owner: &str) -> u64 {
    let req = ClaimRequest::new(key(name), OwnerId::new(owner))
        .with_policy(Policy::default().with_lease(Duration::from_secs(600)));
    match s.claim(&req).await.unwrap() {
        ClaimOutcome::Acquired(lease) => lease.token.get(),
        other => panic!("expected to acquire {name}, got {other:?}"),
    }
}

fn id(s: &str) -> InstanceId {
    InstanceId::new(s).unwrap()
}

/// The predecessor's live leases end at once: the restarted instance takes the key over under a
/// new token without waiting; leases of other identities (including ones whose names share a
/// prefix, or differ only where LIKE has a wildcard) and of this incarnation are untouched.
pub(crate) async fn adopt_ends_only_a_dead_predecessors_leases<S: Store>(s: Arc<S>) {
    let old = held_by(&*s, "pay-1", "orders-1/dead0#0").await;
    held_by(&*s, "pay-2", "orders-10/live#0").await;
    held_by(&*s, "pay-3", "orders_1/live#0").await;
    held_by(&*s, "pay-4", "ordersX1/live#0").await;
    let me = Dedup::new(Arc::clone(&s))
        .with_instance(id("orders-1"))
        .with_in_flight_wait(Duration::ZERO)
        .unwrap();
    // A claim of this incarnation, made before adopting (a runner adopts first; a careless
    // caller must still not end its own leases).
    let mine = me
        .store()
        .claim(
            &ClaimRequest::new(
                key("pay-5"),
                OwnerId::new(format!("{}#99", owner_prefix(&me))),
            )
            .with_policy(Policy::default().with_lease(Duration::from_secs(600))),
        )
        .await
        .unwrap();
    assert!(matches!(mine, ClaimOutcome::Acquired(_)), "{mine:?}");

    let adoption = me.adopt().await.unwrap();
    let Adoption::Adopted(records) = &adoption else {
        panic!("expected an adoption, got {adoption:?}");
    };
    let adopted: Vec<Vec<u8>> = records.iter().map(|r| r.key.key_bytes().to_vec()).collect();
    assert_eq!(adopted, vec![b"pay-1".to_vec()], "{records:?}");

    // Taken over at once (no in-flight wait is allowed), under a new token, as a second attempt.
    let done = me
        .process(&key("pay-1"), None, |_| async {
            Ok::<_, HandlerError<Boom>>(Completion::store(bytes("paid")))
        })
        .await
        .unwrap();
    let Processed::Executed {
        token, attempts, ..
    } = done
    else {
        panic!("expected the adopted key to run, got {done:?}");
    };
    assert!(token.get() > old);
    assert_eq!(attempts, 2);

    // The others still stand.
    for name in ["pay-2", "pay-3", "pay-4", "pay-5"] {
        let rec = s.get(&key(name)).await.unwrap().unwrap();
        assert_eq!(rec.state, State::InProgress, "{name}");
        let again = me
            .process(&key(name), None, |_| async {
                Ok::<_, HandlerError<Boom>>(Completion::store(bytes("twice")))
            })
            .await;
        assert!(again.is_err(), "{name}: {again:?}");
    }
    // Adopting again finds nothing more.
    assert_eq!(me.adopt().await.unwrap().adopted(), 0);
}

/// Without an identity there is nothing to adopt; identities are checked.
pub(crate) async fn adopt_needs_a_valid_identity<S: Store>(s: Arc<S>) {
    let anonymous = Dedup::new(Arc::clone(&s));
    assert_eq!(anonymous.adopt().await.unwrap(), Adoption::Unsupported);
    for bad in [
        "",
        "has space",
        "slash/inside",
        "percent%",
        &"x".repeat(101),
    ] {
        assert!(InstanceId::new(bad).is_err(), "{bad:?}");
    }
    assert!(InstanceId::new("pod-7.orders_eu:1").is_ok());
}

/// This incarnation's owner prefix, as `with_instance` set it.
fn owner_prefix<S: Store>(d: &Dedup<S>) -> String {
    d.owner_prefix().to_owned()
}
