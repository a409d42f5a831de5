//! dedup's integration tests: one binary, a module per area.
//!
//! Every test that needs Postgres gets its own fresh database from `#[sqlx::test]` (which reads
//! `DATABASE_URL`, a superuser on the cluster `scripts/test` starts). Nothing is skipped: a missing
//! server fails the run.

#![allow(clippy::unwrap_used)]

mod support;

mod conformance;
mod http;
mod kafka;
mod kill;
mod pg;
mod pg_batch;
mod pg_faults;
mod pg_migrate;
mod pg_parked;
mod pg_tls;
mod redis;
