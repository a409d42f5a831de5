//! Statements counted by the server (`pg_stat_statements`): every statement a contender sent,
//! BEGIN, SAVEPOINT and COMMIT included, whoever sent it; the handler's own (the ledger rows)
//! apart.

use sqlx::PgPool;

/// Makes the counts readable in this database. False (and the bench prints no counts) where the
/// server was started without `pg_stat_statements` in `shared_preload_libraries`.
pub(super) async fn enable(pool: &PgPool) -> bool {
    if sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(pool)
        .await
        .is_err()
    {
        return false;
    }
    count(pool).await.is_some()
}

/// The server's counts at one moment ([`count`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counts {
    /// Statements this database ran so far.
    pub(super) all: u64,
    /// Those that wrote the bench's ledger.
    pub(super) handler: u64,
    /// Entries `pg_stat_statements` evicted so far (`pg_stat_statements_info.dealloc`): an
    /// evicted statement's calls leave the sums, so a count across an eviction is short.
    pub(super) evicted: u64,
}

impl Counts {
    /// What ran between `before` and `self`, and whether that is all of it (no eviction between).
    pub(super) fn since(self, before: Counts) -> (u64, u64, bool) {
        (
            self.all.saturating_sub(before.all),
            self.handler.saturating_sub(before.handler),
            self.evicted == before.evicted,
        )
    }
}

/// All statements this database ran so far, those that wrote the bench's ledger, and the
/// server's evictions.
pub(super) async fn count(pool: &PgPool) -> Option<Counts> {
    let row: (i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(calls), 0)::int8, \
         coalesce(sum(calls) FILTER (WHERE query ILIKE '%dedup_bench_ledger%'), 0)::int8, \
         (SELECT dealloc FROM pg_stat_statements_info) \
         FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .ok()?;
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    Some(Counts {
        all: n(row.0),
        handler: n(row.1),
        evicted: n(row.2),
    })
}
