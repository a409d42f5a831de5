//! dedup's migrations beside an application's own (docs/MIGRATIONS.md): dedup records into
//! `dedup_migrations`, moves its versions out of `_sqlx_migrations` on an old database, and checks
//! the schema's compatibility floor; `verify` and `off` change nothing.

use dedup_pg::{MIGRATOR, MigrationMode, SCHEMA_GENERATION, SchemaError, prepare};
use sqlx::migrate::{MigrateError, Migration, MigrationType, Migrator};
use sqlx::{PgPool, SqlSafeStr};

use crate::support::{acquired, key, req};

/// Migrations that have run before this change: dedup's deployments up to then recorded them
/// into `_sqlx_migrations`.
const BEFORE_OWN_TABLE: i64 = 20_261_126_000_000;

/// An application's own migrations, with sqlx's default table (`_sqlx_migrations`).
fn app_migrator() -> Migrator {
    Migrator::with_migrations(vec![
        Migration::new(
            1,
            "customers".into(),
            MigrationType::Simple,
            "CREATE TABLE app_customers (id bigint PRIMARY KEY, name text NOT NULL)".into_sql_str(),
            false,
        ),
        Migration::new(
            2,
            "orders".into(),
            MigrationType::Simple,
            "CREATE TABLE app_orders (id bigint PRIMARY KEY, \
             customer bigint NOT NULL REFERENCES app_customers)"
                .into_sql_str(),
            false,
        ),
    ])
}

fn dedup_versions() -> Vec<i64> {
    MIGRATOR.iter().map(|m| m.version).collect()
}

async fn versions_in(pool: &PgPool, table: &str) -> Vec<i64> {
    let sql = format!("SELECT version FROM {table} WHERE success ORDER BY version");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Whether `table` resolves on the search path.
pub(crate) async fn exists(pool: &PgPool, table: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Both migrators, in the order given, twice: neither fails the other, and each table holds only
/// its own versions.
async fn side_by_side(pool: &PgPool, app_first: bool) {
    let app = app_migrator();
    for _ in 0..2 {
        if app_first {
            app.run(pool).await.unwrap();
            prepare(pool, MigrationMode::Apply).await.unwrap();
        } else {
            prepare(pool, MigrationMode::Apply).await.unwrap();
            app.run(pool).await.unwrap();
        }
    }
    assert_eq!(versions_in(pool, "_sqlx_migrations").await, vec![1, 2]);
    assert_eq!(
        versions_in(pool, "dedup_migrations").await,
        dedup_versions()
    );
    assert!(exists(pool, "app_orders").await && exists(pool, "dedup_records").await);
    // A second apply had nothing to do; verify agrees.
    let again = prepare(pool, MigrationMode::Apply).await.unwrap();
    assert!(
        again.applied.is_empty() && again.moved.is_empty(),
        "{again:?}"
    );
    let verified = prepare(pool, MigrationMode::Verify).await.unwrap();
    assert_eq!(verified.verified, dedup_versions());
}

#[sqlx::test(migrations = false)]
async fn app_migrator_first_then_dedup(pool: PgPool) {
    side_by_side(&pool, true).await;
}

#[sqlx::test(migrations = false)]
async fn dedup_first_then_app_migrator(pool: PgPool) {
    side_by_side(&pool, false).await;
}

#[sqlx::test(migrations = false)]
async fn a_fresh_apply_records_every_migration_and_the_generation(pool: PgPool) {
    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert_eq!(status.applied, dedup_versions());
    assert!(status.moved.is_empty());
    let schema = status.schema.unwrap();
    assert_eq!(
        (schema.generation, schema.compat_floor),
        (SCHEMA_GENERATION, 1)
    );
    assert!(!status.newer_than_binary());
    // dedup never creates sqlx's default table.
    assert!(!exists(&pool, "_sqlx_migrations").await);
}

#[sqlx::test(migrations = false)]
async fn an_old_deployment_moves_its_versions_out_of_sqlx_migrations(pool: PgPool) {
    // An old deployment: dedup's migrations of the time, recorded into `_sqlx_migrations`.
    let old: Vec<Migration> = MIGRATOR
        .iter()
        .filter(|m| m.version < BEFORE_OWN_TABLE)
        .cloned()
        .collect();
    let old_versions: Vec<i64> = old.iter().map(|m| m.version).collect();
    assert!(!old_versions.is_empty());
    Migrator::with_migrations(old).run(&pool).await.unwrap();
    // The application's migrator fails on dedup's versions (the defect). Run it on a connection
    // that is closed afterwards: sqlx leaves its migration lock held on a failed run's session.
    let mut conn = pool.acquire().await.unwrap();
    let err = app_migrator().run(&mut *conn).await.unwrap_err();
    assert!(matches!(err, MigrateError::VersionMissing(_)), "{err:?}");
    conn.close().await.unwrap();
    // Verify changes nothing and says what to do.
    let err = prepare(&pool, MigrationMode::Verify).await.unwrap_err();
    assert!(
        matches!(err, SchemaError::NotMoved { version } if version == old_versions[0]),
        "{err:?}"
    );
    assert!(!exists(&pool, "dedup_migrations").await);

    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert_eq!(status.moved, old_versions);
    let rest: Vec<i64> = dedup_versions()
        .into_iter()
        .filter(|v| *v >= BEFORE_OWN_TABLE)
        .collect();
    assert_eq!(status.applied, rest);
    assert!(versions_in(&pool, "_sqlx_migrations").await.is_empty());
    assert_eq!(
        versions_in(&pool, "dedup_migrations").await,
        dedup_versions()
    );

    // The application's migrator now runs, and both keep running.
    app_migrator().run(&pool).await.unwrap();
    prepare(&pool, MigrationMode::Apply).await.unwrap();
    app_migrator().run(&pool).await.unwrap();
    assert_eq!(versions_in(&pool, "_sqlx_migrations").await, vec![1, 2]);
    assert_eq!(
        versions_in(&pool, "dedup_migrations").await,
        dedup_versions()
    );
}

#[sqlx::test(migrations = false)]
async fn an_app_row_with_a_dedup_version_but_another_checksum_stays(pool: PgPool) {
    // Only rows whose version and checksum are dedup's move.
    let first = MIGRATOR.iter().next().unwrap().version;
    sqlx::query(
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL, \
         installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL, \
         checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, 'not dedup''s', true, '\\x00', 0)",
    )
    .bind(first)
    .execute(&pool)
    .await
    .unwrap();
    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert!(status.moved.is_empty());
    assert_eq!(versions_in(&pool, "_sqlx_migrations").await, vec![first]);
    assert_eq!(
        versions_in(&pool, "dedup_migrations").await,
        dedup_versions()
    );
}

#[sqlx::test(migrations = false)]
async fn a_newer_schema_is_used_until_its_floor_passes_this_binary(pool: PgPool) {
    prepare(&pool, MigrationMode::Apply).await.unwrap();
    // A newer dedup (the next generation, still usable by this one) applied a migration this
    // binary does not have.
    let newer = SCHEMA_GENERATION + 1;
    sqlx::query(
        "INSERT INTO dedup_migrations (version, description, success, checksum, execution_time) \
         VALUES (29991231000001, 'from a newer dedup', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE dedup_schema SET generation = $1, compat_floor = $2")
        .bind(newer)
        .bind(SCHEMA_GENERATION)
        .execute(&pool)
        .await
        .unwrap();
    for mode in [
        MigrationMode::Apply,
        MigrationMode::Verify,
        MigrationMode::Off,
    ] {
        let status = prepare(&pool, mode).await.unwrap();
        let schema = status.schema.unwrap();
        assert_eq!(
            (schema.generation, schema.compat_floor),
            (newer, SCHEMA_GENERATION),
            "{mode}"
        );
        assert!(status.newer_than_binary(), "{mode}");
    }
    assert!(dedup_pg::migrate(&pool).await.is_ok());

    // The newer dedup contracted the schema: this generation may no longer use it.
    sqlx::query("UPDATE dedup_schema SET compat_floor = $1")
        .bind(newer)
        .execute(&pool)
        .await
        .unwrap();
    for mode in [
        MigrationMode::Apply,
        MigrationMode::Verify,
        MigrationMode::Off,
    ] {
        let err = prepare(&pool, mode).await.unwrap_err();
        assert!(
            matches!(
                err,
                SchemaError::BinaryTooOld {
                    schema_generation,
                    compat_floor,
                    binary_generation: SCHEMA_GENERATION,
                } if schema_generation == newer && compat_floor == newer
            ),
            "{mode}: {err:?}"
        );
        assert!(!err.is_retryable());
        let message = err.to_string();
        assert!(
            message.contains(&format!("generation {newer} or later"))
                && message.contains(&format!("this binary is generation {SCHEMA_GENERATION}")),
            "{message}"
        );
    }
}

#[sqlx::test(migrations = false)]
async fn verify_names_what_is_missing_or_edited_and_off_refuses_an_unmigrated_database(
    pool: PgPool,
) {
    // An empty database: verify names the first migration and creates nothing.
    let first = MIGRATOR.iter().next().unwrap();
    let err = prepare(&pool, MigrationMode::Verify).await.unwrap_err();
    match &err {
        SchemaError::Missing {
            version,
            description,
        } => {
            assert_eq!(
                (*version, description.as_str()),
                (first.version, &*first.description)
            );
        }
        other => panic!("expected Missing, got {other:?}"),
    }
    assert!(err.to_string().contains(&first.version.to_string()));
    assert!(!err.is_retryable());
    for table in [
        "dedup_migrations",
        "dedup_schema",
        "dedup_records",
        "_sqlx_migrations",
    ] {
        assert!(!exists(&pool, table).await, "verify created {table}");
    }
    // Off on an empty database: refused, naming what is missing, nothing made (every claim
    // would fail on a missing table).
    let err = prepare(&pool, MigrationMode::Off).await.unwrap_err();
    assert!(
        matches!(&err, SchemaError::NotMigrated { missing }
            if missing.contains("dedup_schema") && missing.contains("dedup_records")),
        "{err:?}"
    );
    assert!(err.to_string().contains("dedup migrate"), "{err}");
    assert!(!err.is_retryable());
    assert!(!exists(&pool, "dedup_migrations").await);

    // A recorded migration whose checksum differs (edited after it landed) is named.
    prepare(&pool, MigrationMode::Apply).await.unwrap();
    let last = MIGRATOR.iter().last().unwrap();
    sqlx::query("UPDATE dedup_migrations SET checksum = '\\x00' WHERE version = $1")
        .bind(last.version)
        .execute(&pool)
        .await
        .unwrap();
    let err = prepare(&pool, MigrationMode::Verify).await.unwrap_err();
    assert!(
        matches!(err, SchemaError::Mismatch { version, .. } if version == last.version),
        "{err:?}"
    );
    // And one that is not recorded at all.
    sqlx::query("DELETE FROM dedup_migrations WHERE version = $1")
        .bind(last.version)
        .execute(&pool)
        .await
        .unwrap();
    let err = prepare(&pool, MigrationMode::Verify).await.unwrap_err();
    assert!(
        matches!(err, SchemaError::Missing { version, .. } if version == last.version),
        "{err:?}"
    );
}

#[test]
fn modes_read_and_print_as_their_names() {
    for (text, mode) in [
        ("apply", MigrationMode::Apply),
        ("verify", MigrationMode::Verify),
        ("off", MigrationMode::Off),
    ] {
        assert_eq!(text.parse::<MigrationMode>().unwrap(), mode);
        assert_eq!(mode.to_string(), text);
    }
    assert_eq!(MigrationMode::default(), MigrationMode::Apply);
    let err = "sometimes".parse::<MigrationMode>().unwrap_err();
    assert!(err.to_string().contains("sometimes"), "{err}");
    assert_eq!(MIGRATOR.table_name, "dedup_migrations");
    assert!(MIGRATOR.ignore_missing);
}

/// A deploy whose migration step has not run yet: the schema is one migration behind this
/// binary. Off must refuse it at start (it would otherwise run against a schema that lacks what
/// this binary uses: every batch completion failing, effects running again), verify names the
/// missing migration, and apply brings it up to date, after which every mode accepts it.
#[sqlx::test(migrations = false)]
async fn a_schema_older_than_the_binary_is_refused_until_it_is_migrated(pool: PgPool) {
    // The migrations up to the last one of the generation before this binary's.
    let all: Vec<&Migration> = MIGRATOR.iter().collect();
    let cut = all
        .iter()
        .position(|m| of_this_generation(m))
        .expect("a migration of this generation");
    let (before, newest) = all.split_at(cut);
    MIGRATOR
        .run_to(before.last().unwrap().version, &pool)
        .await
        .unwrap();
    let (generation,): (i32,) = sqlx::query_as("SELECT generation FROM dedup_schema")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(generation < SCHEMA_GENERATION, "{generation}");

    let err = prepare(&pool, MigrationMode::Off).await.unwrap_err();
    assert!(
        matches!(
            err,
            SchemaError::SchemaTooOld {
                schema_generation,
                binary_generation: SCHEMA_GENERATION,
            } if schema_generation == generation
        ),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    let message = err.to_string();
    assert!(
        message.contains("dedup migrate")
            && message.contains(&format!("generation {generation}"))
            && message.contains(&format!("(generation {SCHEMA_GENERATION})")),
        "{message}"
    );
    let err = prepare(&pool, MigrationMode::Verify).await.unwrap_err();
    assert!(
        matches!(err, SchemaError::Missing { version, .. } if version == newest[0].version),
        "{err:?}"
    );

    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert_eq!(
        status.applied,
        newest.iter().map(|m| m.version).collect::<Vec<_>>()
    );
    for mode in [
        MigrationMode::Apply,
        MigrationMode::Verify,
        MigrationMode::Off,
    ] {
        let status = prepare(&pool, mode).await.unwrap();
        assert_eq!(
            status.schema.unwrap().generation,
            SCHEMA_GENERATION,
            "{mode}"
        );
    }
}

/// Whether `m` raises the schema to this binary's generation.
fn of_this_generation(m: &Migration) -> bool {
    let g = SCHEMA_GENERATION;
    m.sql
        .as_str()
        .contains(&format!("SET generation = greatest(generation, {g})"))
        || m.sql.as_str().contains(&format!("SET generation = {g};"))
}

/// The generation after each statement below.
async fn generation(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT generation FROM dedup_schema")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A schema newer than this binary, written by a dedup that never ran (or withdrew) one of this
/// binary's migrations: apply runs none of this binary's DDL on it (which would undo the newer
/// one's and lower the generation), and says which it left.
#[sqlx::test(migrations = false)]
async fn apply_runs_nothing_on_a_newer_schema_that_lacks_one_of_its_migrations(pool: PgPool) {
    prepare(&pool, MigrationMode::Apply).await.unwrap();
    let newer = SCHEMA_GENERATION + 1;
    let newest = MIGRATOR.iter().last().unwrap();
    sqlx::query("DELETE FROM dedup_migrations WHERE version = $1")
        .bind(newest.version)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE dedup_schema SET generation = $1")
        .bind(newer)
        .execute(&pool)
        .await
        .unwrap();
    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert_eq!(status.not_applied, vec![newest.version], "{status:?}");
    assert!(status.applied.is_empty(), "{status:?}");
    assert_eq!(generation(&pool).await, newer);
    assert!(
        !versions_in(&pool, "dedup_migrations")
            .await
            .contains(&newest.version),
        "the migration ran on a newer schema"
    );
}

/// A version this binary does not know recorded on a schema that is not newer: apply refuses,
/// running none of its own around it (a version it knows as withdrawn, 20261204000001, is no
/// bar); and an embedded migration older than one applied is refused, not run out of order.
#[sqlx::test(migrations = false)]
async fn apply_refuses_unknown_versions_and_runs_nothing_out_of_order(pool: PgPool) {
    prepare(&pool, MigrationMode::Apply).await.unwrap();
    let newest = MIGRATOR.iter().last().unwrap();
    sqlx::query("DELETE FROM dedup_migrations WHERE version = $1")
        .bind(newest.version)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO dedup_migrations (version, description, success, checksum, execution_time) \
         VALUES (20261204000001, 'withdrawn', true, '\\x00', 0), \
         (20261205500001, 'from a build that is not a release', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let err = prepare(&pool, MigrationMode::Apply).await.unwrap_err();
    assert!(
        matches!(&err, SchemaError::Unknown { versions, .. } if versions == &[20_261_205_500_001]),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert!(
        !versions_in(&pool, "dedup_migrations")
            .await
            .contains(&newest.version)
    );
    // The withdrawn version alone does not stand in the way: the upgrade goes on.
    sqlx::query("DELETE FROM dedup_migrations WHERE version = 20261205500001")
        .execute(&pool)
        .await
        .unwrap();
    let status = prepare(&pool, MigrationMode::Apply).await.unwrap();
    assert_eq!(status.applied, vec![newest.version], "{status:?}");
    sqlx::query("DELETE FROM dedup_migrations WHERE version = 20261204000001")
        .execute(&pool)
        .await
        .unwrap();
    // An older embedded migration not recorded while newer ones are: not run again.
    let older = MIGRATOR
        .iter()
        .find(|m| m.description.contains("complete batch fn"))
        .unwrap();
    sqlx::query("DELETE FROM dedup_migrations WHERE version = $1")
        .bind(older.version)
        .execute(&pool)
        .await
        .unwrap();
    let err = prepare(&pool, MigrationMode::Apply).await.unwrap_err();
    assert!(
        matches!(err, SchemaError::OutOfOrder { version, .. } if version == older.version),
        "{err:?}"
    );
    assert!(
        !versions_in(&pool, "dedup_migrations")
            .await
            .contains(&older.version),
        "a migration ran out of order"
    );
}

/// Whatever runs an old migration's `UPDATE dedup_schema SET generation = N` (a binary already
/// out there), the generation does not go down.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_generation_only_rises(pool: PgPool) {
    assert_eq!(generation(&pool).await, SCHEMA_GENERATION);
    sqlx::query("UPDATE dedup_schema SET generation = 10")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(generation(&pool).await, SCHEMA_GENERATION);
    sqlx::query("UPDATE dedup_schema SET generation = generation + 1")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(generation(&pool).await, SCHEMA_GENERATION + 1);
}

/// A column added to `dedup_records` (an expand step of a later migration, or an application's
/// own) leaves the batch claim working: `dedup_claim_batch` names every column it answers. New
/// keys, a key taken over, and a done key answered from its record, in one statement.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_column_added_to_the_records_leaves_batch_claims_working(pool: PgPool) {
    use dedup_core::{ClaimOutcome, Store};
    let store = dedup_pg::PgStore::new(pool.clone());
    let (done, failed, fresh) = (key("done"), key("failed"), key("fresh"));
    let lease = acquired(store.claim(&req(&done, "a")).await.unwrap());
    store.complete(&lease, b"result").await.unwrap();
    let lease = acquired(store.claim(&req(&failed, "a")).await.unwrap());
    store.fail_retryable(&lease, "boom").await.unwrap();
    sqlx::query("ALTER TABLE dedup_records ADD COLUMN app_note text")
        .execute(&pool)
        .await
        .unwrap();
    let reqs = vec![req(&done, "b"), req(&failed, "b"), req(&fresh, "b")];
    let before = store.statements();
    let outcomes: Vec<ClaimOutcome> = store
        .claim_batch(&reqs)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        matches!(&outcomes[0], ClaimOutcome::Completed { result, .. } if result == "result"),
        "{:?}",
        outcomes[0]
    );
    assert_eq!(acquired(outcomes[1].clone()).attempts, 2);
    assert_eq!(acquired(outcomes[2].clone()).attempts, 1);
    // One statement: a failed batch statement would fall back to a claim per key.
    assert_eq!(
        store.statements() - before,
        1,
        "the batch claim answered all three"
    );
}
