//! The steps [`prepare`](super::prepare) takes: the statements it sends (they serve start-up only
//! and name sqlx's tables, so they live here, not in `sql.rs`), and what it reads and checks.

use std::collections::HashMap;

use sqlx::migrate::Migration;
use sqlx::postgres::PgPool;
use tracing::info;

use super::{MIGRATOR, SCHEMA_GENERATION, SchemaError, SchemaVersion};

/// Which of the tables involved exist (as unqualified names resolve on the search path, as sqlx
/// resolves them).
pub(super) const TABLES_SQL: &str = "SELECT to_regclass('_sqlx_migrations') IS NOT NULL, \
     to_regclass('dedup_migrations') IS NOT NULL, to_regclass('dedup_schema') IS NOT NULL";

pub(super) const LEGACY_EXISTS_SQL: &str = "SELECT to_regclass('_sqlx_migrations') IS NOT NULL";

pub(super) const CURRENT_DATABASE_SQL: &str = "SELECT current_database()";

/// sqlx's migration lock, for the transaction: waits while a migrator (dedup's or the
/// application's) runs, and holds them off while dedup's rows move.
pub(super) const LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1)";

/// dedup's versions in `_sqlx_migrations`: version and checksum both one of the embedded ones.
pub(super) const LEGACY_OURS_SQL: &str = "SELECT m.version FROM _sqlx_migrations m \
     JOIN unnest($1::bigint[], $2::bytea[]) AS o(version, checksum) \
     ON m.version = o.version AND m.checksum = o.checksum ORDER BY m.version";

/// The table as sqlx creates it (so that sqlx's own `CREATE TABLE IF NOT EXISTS` finds it).
pub(super) const CREATE_MIGRATIONS_SQL: &str = "CREATE TABLE IF NOT EXISTS dedup_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
    success BOOLEAN NOT NULL,
    checksum BYTEA NOT NULL,
    execution_time BIGINT NOT NULL
)";

/// Moves dedup's rows from `_sqlx_migrations` to `dedup_migrations` (a version already there
/// stays as it is), answering the versions moved.
pub(super) const MOVE_SQL: &str = "WITH ours AS (
    SELECT * FROM unnest($1::bigint[], $2::bytea[]) AS o(version, checksum)
), moved AS (
    DELETE FROM _sqlx_migrations m USING ours o
    WHERE m.version = o.version AND m.checksum = o.checksum
    RETURNING m.version, m.description, m.installed_on, m.success, m.checksum, m.execution_time
), kept AS (
    INSERT INTO dedup_migrations (version, description, installed_on, success, checksum, execution_time)
    SELECT version, description, installed_on, success, checksum, execution_time FROM moved
    ON CONFLICT (version) DO NOTHING
)
SELECT version FROM moved ORDER BY version";

pub(super) const RECORDED_SQL: &str =
    "SELECT version, checksum FROM dedup_migrations WHERE success";

pub(super) const LEGACY_HOLDS_SQL: &str =
    "SELECT EXISTS (SELECT 1 FROM _sqlx_migrations WHERE version = $1 AND checksum = $2)";

pub(super) const SCHEMA_SQL: &str = "SELECT generation, compat_floor FROM dedup_schema WHERE id";

/// The embedded migrations that run forward (all of dedup's so far).
pub(super) fn up_migrations() -> impl Iterator<Item = &'static Migration> {
    MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
}

/// The embedded versions and checksums, as the arrays the statements take.
pub(super) fn ours() -> (Vec<i64>, Vec<&'static [u8]>) {
    up_migrations().map(|m| (m.version, &*m.checksum)).unzip()
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Tables {
    /// `_sqlx_migrations`.
    pub(super) legacy: bool,
    /// `dedup_migrations`.
    pub(super) ours: bool,
    /// `dedup_schema`.
    pub(super) schema: bool,
}

pub(super) async fn tables(pool: &PgPool) -> Result<Tables, sqlx::Error> {
    let (legacy, ours, schema): (bool, bool, bool) =
        sqlx::query_as(TABLES_SQL).fetch_one(pool).await?;
    Ok(Tables {
        legacy,
        ours,
        schema,
    })
}

/// The schema's row, if `dedup_schema` exists and holds one.
pub(super) async fn schema(pool: &PgPool) -> Result<Option<SchemaVersion>, sqlx::Error> {
    if !tables(pool).await?.schema {
        return Ok(None);
    }
    schema_row(pool).await
}

pub(super) async fn schema_row(pool: &PgPool) -> Result<Option<SchemaVersion>, sqlx::Error> {
    let row: Option<(i32, i32)> = sqlx::query_as(SCHEMA_SQL).fetch_optional(pool).await?;
    Ok(row.map(|(generation, compat_floor)| SchemaVersion {
        generation,
        compat_floor,
    }))
}

/// The versions recorded in `dedup_migrations` (which must exist), with their checksums.
pub(super) async fn recorded(pool: &PgPool) -> Result<HashMap<i64, Vec<u8>>, sqlx::Error> {
    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(RECORDED_SQL).fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// Refuses a schema whose floor is above this binary.
pub(super) fn within_floor(v: SchemaVersion) -> Result<SchemaVersion, SchemaError> {
    if v.compat_floor > SCHEMA_GENERATION {
        return Err(SchemaError::BinaryTooOld {
            schema_generation: v.generation,
            compat_floor: v.compat_floor,
            binary_generation: SCHEMA_GENERATION,
        });
    }
    Ok(v)
}

/// The floor check, the refusal of an older schema, and the info log for a newer one.
pub(super) fn accept(v: SchemaVersion) -> Result<SchemaVersion, SchemaError> {
    let v = within_floor(v)?;
    if v.generation < SCHEMA_GENERATION {
        return Err(SchemaError::SchemaTooOld {
            schema_generation: v.generation,
            binary_generation: SCHEMA_GENERATION,
        });
    }
    if v.generation > SCHEMA_GENERATION {
        info!(
            schema_generation = v.generation,
            compat_floor = v.compat_floor,
            binary_generation = SCHEMA_GENERATION,
            "the dedup schema is newer than this binary and compatible with it (a rollback, or a \
             deploy under way)"
        );
    }
    Ok(v)
}

/// Moves dedup's versions from `_sqlx_migrations` to `dedup_migrations`, in one transaction
/// under sqlx's migration lock; nothing (and no DDL) when there is none to move.
pub(super) async fn move_legacy(pool: &PgPool) -> Result<Vec<i64>, SchemaError> {
    let mut tx = pool.begin().await?;
    let database: String = sqlx::query_scalar(CURRENT_DATABASE_SQL)
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query(LOCK_SQL)
        .bind(sqlx_lock_id(&database))
        .execute(&mut *tx)
        .await?;
    let legacy: bool = sqlx::query_scalar(LEGACY_EXISTS_SQL)
        .fetch_one(&mut *tx)
        .await?;
    if !legacy {
        tx.rollback().await?;
        return Ok(Vec::new());
    }
    let (versions, checksums) = ours();
    let found: Vec<i64> = sqlx::query_scalar(LEGACY_OURS_SQL)
        .bind(&versions)
        .bind(&checksums)
        .fetch_all(&mut *tx)
        .await?;
    if found.is_empty() {
        tx.rollback().await?;
        return Ok(Vec::new());
    }
    sqlx::query(CREATE_MIGRATIONS_SQL).execute(&mut *tx).await?;
    let moved: Vec<i64> = sqlx::query_scalar(MOVE_SQL)
        .bind(&versions)
        .bind(&checksums)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    info!(
        versions = ?moved,
        "moved dedup's migrations from _sqlx_migrations to dedup_migrations"
    );
    Ok(moved)
}

/// Runs [`MIGRATOR`] on a connection of its own. A failed run can leave sqlx's session-level
/// migration lock held on its connection (sqlx unlocks only on success), so that connection is
/// closed instead of going back to the pool.
pub(super) async fn run_migrator(pool: &PgPool) -> Result<(), SchemaError> {
    let mut conn = pool.acquire().await?;
    // `run_direct` takes the connection itself (what `#[sqlx::test]` calls); `run` goes through
    // `Acquire`, whose future is not `Send` (launchbadge/sqlx#954).
    let ran = MIGRATOR.run_direct(None, &mut *conn, false).await;
    if let Err(e) = ran {
        // Best effort: the error to report is the migration's.
        let _closed = conn.close().await;
        return Err(e.into());
    }
    Ok(())
}

/// Every embedded migration recorded in `dedup_migrations` with its checksum.
pub(super) async fn verify(pool: &PgPool, present: Tables) -> Result<Vec<i64>, SchemaError> {
    let recorded = if present.ours {
        recorded(pool).await?
    } else {
        HashMap::new()
    };
    let mut verified = Vec::new();
    for m in up_migrations() {
        match recorded.get(&m.version) {
            Some(sum) if sum.as_slice() == &*m.checksum => verified.push(m.version),
            Some(_) => {
                return Err(SchemaError::Mismatch {
                    version: m.version,
                    description: m.description.to_string(),
                });
            }
            None => {
                if present.legacy {
                    let held: bool = sqlx::query_scalar(LEGACY_HOLDS_SQL)
                        .bind(m.version)
                        .bind(&*m.checksum)
                        .fetch_one(pool)
                        .await?;
                    if held {
                        return Err(SchemaError::NotMoved { version: m.version });
                    }
                }
                return Err(SchemaError::Missing {
                    version: m.version,
                    description: m.description.to_string(),
                });
            }
        }
    }
    Ok(verified)
}

/// The advisory lock sqlx's Postgres migrator takes (`generate_lock_id` in sqlx-postgres's
/// `migrate.rs`): CRC-32 (ISO-HDLC) of the database's name times `0x3d32ad9e`.
pub(super) fn sqlx_lock_id(database: &str) -> i64 {
    0x3d32_ad9e_i64 * i64::from(crc32(database.as_bytes()))
}

/// CRC-32/ISO-HDLC (the zlib and Ethernet CRC), bit by bit: a database name is short.
pub(super) fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFF_u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    !crc
}
