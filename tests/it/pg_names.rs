//! The range maintainer and the names it reads from the catalog (docs/ARCHITECTURE.md,
//! invariant 37): a table name is never SQL. A role that may create tables in dedup's schema
//! names one so that, formatted into a statement, it would call its own function as the role
//! that runs retention; and makes look-alikes of dedup's tables that dedup does not own. The
//! maintainer runs none of their SQL, touches none of them, and still makes and drops its ranges.

use dedup_pg::RangePolicy;
use sqlx::PgPool;

use crate::pg_migrate::exists;
use crate::pg_ranges::{DAY, at, switch};

/// Runs `sql` on `pool`, each statement on its own.
async fn run(pool: &PgPool, sql: &[String]) {
    for s in sql {
        sqlx::query(sqlx::AssertSqlSafe(s.clone()))
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{s}: {e}"));
    }
}

/// What the hostile function wrote: empty unless a maintainer ran it.
async fn canary(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT what FROM canary ORDER BY what")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Whether `table` still has a default on `kt` (a look-alike dedup must leave as it is).
async fn has_kt_default(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar(
        "SELECT a.atthasdef FROM pg_attribute a WHERE a.attrelid = to_regclass($1) \
         AND a.attname = 'kt'",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_table_named_to_run_sql_runs_none_and_look_alikes_are_left_alone(pool: PgPool) {
    let role = format!("dedup_hostile_{}", std::process::id());
    run(
        &pool,
        &[
            format!("DROP ROLE IF EXISTS {role}"),
            format!("CREATE ROLE {role}"),
            format!("GRANT CREATE, USAGE ON SCHEMA public TO {role}"),
            "CREATE TABLE canary (what text)".to_owned(),
            "GRANT INSERT ON canary TO PUBLIC".to_owned(),
        ],
    )
    .await;
    // The other role's function, its tables named to call it, and look-alikes of dedup's own:
    // a dropped range's name, a table with kt's default as generation 9 left them.
    let hostile = [
        "CREATE FUNCTION public.f() RETURNS text LANGUAGE sql \
         AS $f$ INSERT INTO canary VALUES ('f ran as ' || current_user) RETURNING 'x' $f$"
            .to_owned(),
        r#"CREATE TABLE "dedup_records_gone_'||public.f()||'" (x int)"#.to_owned(),
        r#"CREATE TABLE "dedup_records_'||public.f()||'" (kt date DEFAULT current_date)"#
            .to_owned(),
        "CREATE TABLE dedup_records_gone_20200106 (x int)".to_owned(),
        "CREATE TABLE dedup_records_lookalike (kt date DEFAULT current_date)".to_owned(),
    ];
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
        .execute(&mut *conn)
        .await
        .unwrap();
    for sql in &hostile {
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();

    // The single table's round (`dedup purge`, retention): clears what a drop left.
    let now = std::time::SystemTime::now();
    let r = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), now).await;
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        canary(&pool).await,
        Vec::<String>::new(),
        "the single table's round ran f()"
    );

    // The partitioned table's: ranges made and dropped, the look-alikes untouched.
    let t0 = switch(&pool).await;
    let r = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 30 * DAY))
        .await
        .unwrap();
    assert!(!r.made.is_empty() && !r.dropped.is_empty(), "{r:?}");
    let r = dedup_pg::maintain_ranges(&mut conn, &RangePolicy::default(), at(t0 + 31 * DAY))
        .await
        .unwrap();
    assert!(r.held_back.is_none(), "{r:?}");
    assert_eq!(canary(&pool).await, Vec::<String>::new(), "a round ran f()");
    assert!(exists(&pool, "dedup_records_gone_20200106").await);
    assert!(exists(&pool, r#"public."dedup_records_gone_'||public.f()||'""#).await);
    assert!(has_kt_default(&pool, "dedup_records_lookalike").await);
    assert!(has_kt_default(&pool, r#"public."dedup_records_'||public.f()||'""#).await);
    drop(conn);
    run(
        &pool,
        &[
            format!("REASSIGN OWNED BY {role} TO CURRENT_USER"),
            format!("DROP OWNED BY {role}"),
            format!("DROP ROLE {role}"),
        ],
    )
    .await;
}
