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

/// All statements this database ran so far, and those that wrote the bench's ledger.
pub(super) async fn count(pool: &PgPool) -> Option<(u64, u64)> {
    let row: (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(calls), 0)::int8, \
         coalesce(sum(calls) FILTER (WHERE query ILIKE '%dedup_bench_ledger%'), 0)::int8 \
         FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .ok()?;
    Some((
        u64::try_from(row.0).unwrap_or(0),
        u64::try_from(row.1).unwrap_or(0),
    ))
}
