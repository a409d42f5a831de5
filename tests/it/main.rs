//! dedup's integration tests: one binary, a module per area.
//!
//! Every test that needs Postgres gets its own fresh database from `#[sqlx::test]` (which reads
//! `DATABASE_URL`, a superuser on the cluster `scripts/test` starts). Nothing is skipped: a missing
//! server fails the run.
//!
//! No test races the clock: a scenario that needs something to happen mid-run (a second member
//! assigned while messages are in flight, Redis killed while handlers run, a handler outliving its
//! lease) makes it happen, holding handlers at a gate or waiting for an observable event (a lock
//! wait in `pg_stat_activity`, a counter), and never makes an assertion conditional. The tests'
//! tiered stores use a 2 s fast-path timeout (`support::test_config`), so tier counters do not
//! depend on Redis answering within 50 ms on a loaded core; the timeout tests use the default.
//! Processes the tests start and kill are in `tests/bin/`.

#![allow(clippy::unwrap_used)]

mod support;

mod conformance;
mod http;
mod kafka;
mod kill;
mod pg;
mod pg_batch;
mod pg_begin_claim;
mod pg_faults;
mod pg_freeze;
mod pg_key_time;
mod pg_kt_guard;
mod pg_migrate;
mod pg_names;
mod pg_outbox;
mod pg_partitioned;
mod pg_plans;
mod pg_range_locks;
mod pg_ranges;
mod pg_retention;
mod pg_tls;
mod redis;
