//! The `dedup.decision` span of a claim: the tier that answered, the outcome, the token and the
//! latency in µs. Behind `Batched` the tier is `l1` or `batched`, and the batch's own
//! `dedup.claim_batch` span says which tiers it asked.

use std::time::Instant;

use tracing::{debug, info_span};

use crate::key::IdempotencyKey;
use crate::record::{ClaimOutcome, FencingToken};

/// The `dedup.decision` span of one claim, its answer recorded by [`record_decision`].
pub(crate) fn decision_span(key: &IdempotencyKey) -> tracing::Span {
    info_span!(
        "dedup.decision",
        key = %key,
        tier = tracing::field::Empty,
        outcome = tracing::field::Empty,
        token = tracing::field::Empty,
        latency_us = tracing::field::Empty,
    )
}

/// Records who answered a claim, what, and how long it took. Recording costs allocations and
/// clock reads: only for a span someone listens to.
pub(crate) fn record_decision(
    span: &tracing::Span,
    tier: &'static str,
    outcome: &ClaimOutcome,
    started: Instant,
) {
    if span.is_disabled() {
        return;
    }
    span.record("tier", tier);
    span.record("outcome", outcome_name(outcome));
    if let Some(token) = lease_token(outcome) {
        span.record("token", token.get());
    }
    span.record(
        "latency_us",
        u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
    );
    debug!(parent: span, "decided");
}

pub(super) fn outcome_name(o: &ClaimOutcome) -> &'static str {
    match o {
        ClaimOutcome::Acquired(_) => "acquired",
        ClaimOutcome::Completed { .. } => "completed",
        ClaimOutcome::InFlight { .. } => "in_flight",
        ClaimOutcome::Failed { .. } => "failed",
        ClaimOutcome::PayloadMismatch => "payload_mismatch",
    }
}

pub(super) fn lease_token(o: &ClaimOutcome) -> Option<FencingToken> {
    match o {
        ClaimOutcome::Acquired(lease) => Some(lease.token),
        ClaimOutcome::Completed { token, .. } => Some(*token),
        _ => None,
    }
}
