//! dedup's schema: its own migrations table, the move out of sqlx's default table, the schema's
//! generation and compatibility floor, and the three ways to prepare a database
//! (docs/MIGRATIONS.md).
//!
//! - **Its own table.** [`MIGRATOR`] records into `dedup_migrations`, never into sqlx's default
//!   `_sqlx_migrations`, so an application that keeps its own tables in the same database and runs
//!   its own `sqlx::migrate!` never sees dedup's versions (nor dedup the application's), and
//!   neither migrator fails the other with `VersionMissing`. It ignores versions it does not know
//!   (`ignore_missing`): only dedup's versions live in that table, so an unknown one is a newer
//!   dedup's, and an older binary (a rollback) still starts.
//! - **The move.** Databases migrated before `dedup_migrations` existed have dedup's versions in
//!   `_sqlx_migrations`. [`prepare`] in [`MigrationMode::Apply`] moves the rows whose version and
//!   checksum are one of dedup's embedded migrations into `dedup_migrations`, in one transaction
//!   under sqlx's migration lock, before it runs anything.
//! - **The floor.** `dedup_schema` holds the schema's `generation` (the generation of the binary
//!   whose migrations wrote it) and its `compat_floor` (the oldest generation of binary that can
//!   still use it). A binary of generation [`SCHEMA_GENERATION`] refuses a schema whose floor is
//!   above it ([`SchemaError::BinaryTooOld`]), refuses a schema older than itself once its
//!   migrations had their chance to run ([`SchemaError::SchemaTooOld`]), and accepts, with an
//!   info log, a newer schema whose floor it meets.
//!
//! The migrations are this crate's `migrations/`: timestamped SQL, embedded by
//! `sqlx::migrate!` (`build.rs` reruns on change; `.gitattributes` keeps them LF, since migration
//! checksums hash the bytes). They make `dedup_records`, keyed by `(scope, key)` and indexed on
//! `expires_at` for the purge; one sequence, `dedup_token_seq`; `dedup_offsets`, consumer
//! positions per `(consumer_group, topic, partition)` for offsets in the transaction;
//! `dedup_parked` (parked messages, keyed by `(consumer_group, topic, partition, offset)`,
//! indexed by the ordering key's digest and offset, and by the dedup record they carry) and
//! `dedup_parked_owners` (each partition's parking epoch); `dedup_dead_letters` (dead letters the
//! dead-letter topic refused for good); `dedup_schema` (one row: the generation and the floor);
//! and the PL/pgSQL functions that the pooled statements joining `dedup_records` to a batch's
//! arrays go through, each keeping one generic plan per connection that is safe by its shape
//! whatever the table's statistics said when it was made: `dedup_complete_batch` (batch
//! completions), `dedup_get_many`, `dedup_extend_batch` (batch heartbeats) and
//! `dedup_regrant_batch` (bitmap probes only), `dedup_claim_batch` and `dedup_fresh_batch` (a
//! `LATERAL` probe per key). Beside them,
//! `dedup_uuid7_ms_v1` (the time of a UUIDv7 key, the same function of the bytes as
//! `IdempotencyKey::uuid7_millis`, inlined where it is called; no statement calls it yet: it is
//! the first piece of the window partitioned by the key's time,
//! docs/design/window-partitions.md), `dedup_kt` (a key's partition day, which every statement
//! writes to and asks of `dedup_records.kt`; `-infinity` for every key on the single table,
//! docs/ARCHITECTURE.md invariant 36) and `dedup_key_ms_v1` (the time the partitioned layout
//! takes a key's day from, `layout.rs`).
//!
//! The statements are here, not in `sql.rs`: they serve start-up only and name sqlx's tables.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use sqlx::migrate::{MigrateError, Migration, Migrator};
use sqlx::postgres::PgPool;
use tracing::info;

/// This binary's schema generation: the generation its newest migration writes to
/// `dedup_schema`. A schema whose `compat_floor` is above it is refused.
pub const SCHEMA_GENERATION: i32 = 12;

/// Versions of migrations that landed and were withdrawn: a database migrated by such a build
/// records them, and this binary knows them (their DDL is superseded by a later migration, never
/// run again). `20261204000001` (generation 10: withdrawn fourteen minutes after it landed,
/// docs/MIGRATIONS.md).
pub(crate) const WITHDRAWN: &[i64] = &[20_261_204_000_001];

/// The table [`MIGRATOR`] records dedup's applied migrations in.
pub const MIGRATIONS_TABLE: &str = "dedup_migrations";

/// The embedded migrations as `sqlx::migrate!` builds them (sqlx's default table).
const EMBEDDED: Migrator = sqlx::migrate!("./migrations");

/// The embedded migrations (this crate's `migrations/`), recorded in
/// `dedup_migrations` ([`MIGRATIONS_TABLE`]), ignoring versions recorded there that this binary
/// does not have (a newer dedup's: only dedup's versions live in that table).
///
/// Prefer [`prepare`] (or [`migrate()`]), which also moves dedup's versions out of
/// `_sqlx_migrations` and checks the compatibility floor; this value is for
/// `#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]`.
pub static MIGRATOR: Migrator = Migrator {
    table_name: Cow::Borrowed(MIGRATIONS_TABLE),
    ignore_missing: true,
    ..EMBEDDED
};

/// How [`prepare`] treats the database's schema.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MigrationMode {
    /// Move dedup's versions out of `_sqlx_migrations`, apply the migrations not applied yet, then
    /// check the compatibility floor. Needs the rights to create tables.
    #[default]
    Apply,
    /// Change nothing: check that every embedded migration is recorded in `dedup_migrations` with
    /// its checksum, then the floor. For roles without DDL rights, with the migrations applied by
    /// a deploy step (`dedup migrate`).
    Verify,
    /// Change nothing and check only `dedup_schema`: it must be there (a database dedup never
    /// migrated is refused, [`SchemaError::NotMigrated`], naming what is missing), its floor
    /// must allow this binary, and its generation must not be older than this binary's (a
    /// deploy step that has not migrated yet is refused, [`SchemaError::SchemaTooOld`], rather
    /// than run against a schema missing what this binary uses).
    Off,
}

impl MigrationMode {
    /// `"apply"`, `"verify"` or `"off"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Apply => "apply",
            Self::Verify => "verify",
            Self::Off => "off",
        }
    }
}

impl fmt::Display for MigrationMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MigrationMode {
    type Err = ParseMigrationModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "apply" => Ok(Self::Apply),
            "verify" => Ok(Self::Verify),
            "off" => Ok(Self::Off),
            _ => Err(ParseMigrationModeError(s.to_owned())),
        }
    }
}

/// A [`MigrationMode`] that is not `apply`, `verify` or `off`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown migration mode {0:?}: expected apply, verify or off")]
pub struct ParseMigrationModeError(String);

/// The schema's row in `dedup_schema`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchemaVersion {
    /// The generation of the binary whose migrations last wrote the schema.
    pub generation: i32,
    /// The oldest binary generation that can use the schema.
    pub compat_floor: i32,
}

/// What [`prepare`] did and found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SchemaStatus {
    /// The mode it ran in.
    pub mode: MigrationMode,
    /// The versions moved from `_sqlx_migrations` to `dedup_migrations` (apply only).
    pub moved: Vec<i64>,
    /// The versions that were not recorded before the migrations ran, and are now (apply only; one
    /// applied by a concurrent instance meanwhile is listed too).
    pub applied: Vec<i64>,
    /// The versions found recorded with their checksums (verify only: every embedded migration).
    pub verified: Vec<i64>,
    /// Embedded versions not recorded that this binary did not apply because the schema is
    /// newer than it (apply only): a newer binary's migrations wrote the schema without them
    /// (a migration withdrawn since, or one run out of order), and an older binary's DDL is
    /// never run on a newer schema.
    pub not_applied: Vec<i64>,
    /// The schema's generation and floor (always there once [`prepare`] succeeded: a database
    /// without `dedup_schema` is refused in every mode).
    pub schema: Option<SchemaVersion>,
}

impl SchemaStatus {
    /// Whether the schema was written by a newer binary than this one (and is compatible with it).
    pub fn newer_than_binary(&self) -> bool {
        self.schema
            .is_some_and(|s| s.generation > SCHEMA_GENERATION)
    }
}

/// Why [`prepare`] refused the database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The schema's compatibility floor is above this binary's generation: the schema has dropped
    /// or changed something this binary uses. Deploy a binary of generation `compat_floor` or later.
    #[error(
        "the dedup schema (generation {schema_generation}) needs a binary of generation \
         {compat_floor} or later; this binary is generation {binary_generation}"
    )]
    BinaryTooOld {
        /// The schema's generation.
        schema_generation: i32,
        /// The schema's compatibility floor.
        compat_floor: i32,
        /// This binary's generation ([`SCHEMA_GENERATION`]).
        binary_generation: i32,
    },
    /// The schema is older than this binary: a migration this binary needs has not been applied
    /// (the binary would fail on what it is missing, or worse, run effects it cannot record).
    /// Apply dedup's migrations (`dedup migrate`) before starting this binary.
    #[error(
        "the dedup schema is generation {schema_generation}, older than this binary (generation \
         {binary_generation}): apply dedup's migrations (`dedup migrate`) before starting it"
    )]
    SchemaTooOld {
        /// The schema's generation.
        schema_generation: i32,
        /// This binary's generation ([`SCHEMA_GENERATION`]).
        binary_generation: i32,
    },
    /// An embedded migration is not recorded in `dedup_migrations` (verify).
    #[error(
        "dedup's migration {version} ({description}) is not applied (not recorded in \
         dedup_migrations): run the migrations in apply mode (`dedup migrate`)"
    )]
    Missing {
        /// Its version.
        version: i64,
        /// Its description.
        description: String,
    },
    /// An embedded migration is recorded in `dedup_migrations` with another checksum: it was
    /// edited after it was applied (verify).
    #[error(
        "dedup's migration {version} ({description}) was applied with a different checksum: it \
         was edited after it was applied"
    )]
    Mismatch {
        /// Its version.
        version: i64,
        /// Its description.
        description: String,
    },
    /// An embedded migration is still recorded in `_sqlx_migrations`, from before dedup had a
    /// table of its own (verify).
    #[error(
        "dedup's migration {version} is still recorded in _sqlx_migrations: run the migrations \
         once in apply mode (`dedup migrate`) to move dedup's versions to dedup_migrations"
    )]
    NotMoved {
        /// Its version.
        version: i64,
    },
    /// The database was never migrated by dedup ([`MigrationMode::Off`], which changes
    /// nothing): the tables named are missing. Run `dedup migrate`, or start a binary in apply
    /// mode, first.
    #[error(
        "dedup's schema is not in this database ({missing} missing): run dedup's migrations \
         (`dedup migrate`) first; migration mode off changes nothing"
    )]
    NotMigrated {
        /// What is missing, comma-separated.
        missing: String,
    },
    /// `dedup_migrations` records versions this binary does not have (nor knows as
    /// withdrawn), while the schema's generation is not newer than this binary's (apply):
    /// applying its own migrations around them would run DDL out of order. A database migrated
    /// by a build of dedup that is not a release.
    #[error(
        "dedup_migrations records migration(s) {versions:?} that this binary does not have, on a \
         schema of generation {schema_generation} (this binary's is {binary_generation}): \
         nothing applied"
    )]
    Unknown {
        /// The versions recorded and not embedded.
        versions: Vec<i64>,
        /// The schema's generation.
        schema_generation: i32,
        /// This binary's generation ([`SCHEMA_GENERATION`]).
        binary_generation: i32,
    },
    /// An embedded migration that is not applied is older than one that is (apply): running it
    /// now would run DDL out of order. Nothing applied.
    #[error(
        "dedup's migration {version} is not applied but the newer {newest} is: it is not run \
         out of order; nothing applied"
    )]
    OutOfOrder {
        /// The embedded version not applied.
        version: i64,
        /// The newest version applied.
        newest: i64,
    },
    /// `dedup_schema` is absent or holds no row although the migrations are recorded (apply,
    /// verify): it was changed by hand.
    #[error("dedup_schema is absent or empty although dedup's migrations are recorded")]
    Unmarked,
    /// Running the migrations failed.
    #[error("running dedup's migrations: {0}")]
    Migrate(#[from] MigrateError),
    /// A statement failed.
    #[error("reading dedup's schema: {0}")]
    Database(#[from] sqlx::Error),
}

impl SchemaError {
    /// Whether trying again may help: only a connection or I/O failure (the server went away, or
    /// was not reachable). A refused or unapplied schema stays refused until someone acts.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Database(e)
            | Self::Migrate(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) => {
                connection_failure(e)
            }
            _ => false,
        }
    }
}

/// A lost or refused connection, or I/O.
fn connection_failure(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}

/// Which of the tables involved exist (as unqualified names resolve on the search path, as sqlx
/// resolves them).
const TABLES_SQL: &str = "SELECT to_regclass('_sqlx_migrations') IS NOT NULL, \
     to_regclass('dedup_migrations') IS NOT NULL, to_regclass('dedup_schema') IS NOT NULL";

const LEGACY_EXISTS_SQL: &str = "SELECT to_regclass('_sqlx_migrations') IS NOT NULL";

const CURRENT_DATABASE_SQL: &str = "SELECT current_database()";

/// sqlx's migration lock, for the transaction: waits while a migrator (dedup's or the
/// application's) runs, and holds them off while dedup's rows move.
const LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1)";

/// dedup's versions in `_sqlx_migrations`: version and checksum both one of the embedded ones.
const LEGACY_OURS_SQL: &str = "SELECT m.version FROM _sqlx_migrations m \
     JOIN unnest($1::bigint[], $2::bytea[]) AS o(version, checksum) \
     ON m.version = o.version AND m.checksum = o.checksum ORDER BY m.version";

/// The table as sqlx creates it (so that sqlx's own `CREATE TABLE IF NOT EXISTS` finds it).
const CREATE_MIGRATIONS_SQL: &str = "CREATE TABLE IF NOT EXISTS dedup_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
    success BOOLEAN NOT NULL,
    checksum BYTEA NOT NULL,
    execution_time BIGINT NOT NULL
)";

/// Moves dedup's rows from `_sqlx_migrations` to `dedup_migrations` (a version already there
/// stays as it is), answering the versions moved.
const MOVE_SQL: &str = "WITH ours AS (
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

const RECORDED_SQL: &str = "SELECT version, checksum FROM dedup_migrations WHERE success";

const LEGACY_HOLDS_SQL: &str =
    "SELECT EXISTS (SELECT 1 FROM _sqlx_migrations WHERE version = $1 AND checksum = $2)";

const SCHEMA_SQL: &str = "SELECT generation, compat_floor FROM dedup_schema WHERE id";

/// Prepares the database for this binary as `mode` says, and checks that the schema's
/// compatibility floor allows this binary ([`SCHEMA_GENERATION`]).
///
/// - [`MigrationMode::Apply`]: refuses a schema whose floor is above this binary before writing
///   anything; moves dedup's versions out of `_sqlx_migrations` (when that table exists); applies
///   the migrations not recorded in `dedup_migrations`; checks the floor.
/// - [`MigrationMode::Verify`]: no DDL and no writes: every embedded migration must be recorded in
///   `dedup_migrations` with its checksum (else [`SchemaError::Missing`], [`SchemaError::NotMoved`]
///   or [`SchemaError::Mismatch`], naming it), and the floor must allow this binary.
/// - [`MigrationMode::Off`]: no DDL and no writes: `dedup_schema` must be there
///   ([`SchemaError::NotMigrated`]), its floor allow this binary, and a schema older than this
///   binary is refused ([`SchemaError::SchemaTooOld`]).
///
/// In apply mode a schema newer than this binary gets none of this binary's migrations
/// ([`SchemaStatus::not_applied`]); versions recorded that this binary does not know, on a
/// schema not newer than it, are refused ([`SchemaError::Unknown`]), and so is an embedded
/// migration older than one applied ([`SchemaError::OutOfOrder`]): no migration runs out of
/// order, and the generation only rises.
///
/// A schema newer than this binary whose floor this binary meets (a rollback, or a deploy under
/// way) is accepted and logged at info.
pub async fn prepare(pool: &PgPool, mode: MigrationMode) -> Result<SchemaStatus, SchemaError> {
    let mut status = SchemaStatus {
        mode,
        moved: Vec::new(),
        applied: Vec::new(),
        verified: Vec::new(),
        not_applied: Vec::new(),
        schema: None,
    };
    match mode {
        MigrationMode::Apply => {
            // Refuse a schema this binary cannot use before changing anything.
            let found = schema(pool).await?;
            if let Some(v) = found {
                within_floor(v)?;
            }
            status.moved = move_legacy(pool).await?;
            let before = if tables(pool).await?.ours {
                recorded(pool).await?
            } else {
                HashMap::new()
            };
            // Read again after the versions: a newer binary that migrated in between (a rolling
            // deploy) shows as a newer schema, not as versions unknown on an older one.
            let found = match schema(pool).await? {
                Some(v) => Some(within_floor(v)?),
                None => None,
            };
            let pending: Vec<i64> = up_migrations()
                .map(|m| m.version)
                .filter(|v| !before.contains_key(v))
                .collect();
            // A schema newer than this binary: none of its own DDL runs on it (an older
            // migration, or a withdrawn one, would undo what a newer one made, and lower the
            // generation every newer binary checks).
            if let Some(v) = found.filter(|v| v.generation > SCHEMA_GENERATION) {
                if !pending.is_empty() {
                    info!(
                        versions = ?pending,
                        schema_generation = v.generation,
                        binary_generation = SCHEMA_GENERATION,
                        "the dedup schema is newer than this binary: its migrations not \
                         recorded are not applied"
                    );
                }
                status.not_applied = pending;
                status.schema = Some(accept(v)?);
                return Ok(status);
            }
            let known: std::collections::HashSet<i64> = up_migrations()
                .map(|m| m.version)
                .chain(WITHDRAWN.iter().copied())
                .collect();
            let mut unknown: Vec<i64> = before
                .keys()
                .copied()
                .filter(|v| !known.contains(v))
                .collect();
            unknown.sort_unstable();
            if !unknown.is_empty() {
                return Err(SchemaError::Unknown {
                    versions: unknown,
                    schema_generation: found.map_or(0, |v| v.generation),
                    binary_generation: SCHEMA_GENERATION,
                });
            }
            if let (Some(&version), Some(&newest)) = (pending.first(), before.keys().max())
                && version < newest
            {
                return Err(SchemaError::OutOfOrder { version, newest });
            }
            run_migrator(pool).await?;
            status.applied = up_migrations()
                .map(|m| m.version)
                .filter(|v| !before.contains_key(v))
                .collect();
            let v = schema(pool).await?.ok_or(SchemaError::Unmarked)?;
            status.schema = Some(accept(v)?);
        }
        MigrationMode::Verify => {
            let present = tables(pool).await?;
            let found = if present.schema {
                schema_row(pool).await?
            } else {
                None
            };
            if let Some(v) = found {
                within_floor(v)?;
            }
            status.verified = verify(pool, present).await?;
            let v = found.ok_or(SchemaError::Unmarked)?;
            status.schema = Some(accept(v)?);
        }
        MigrationMode::Off => {
            let present = tables(pool).await?;
            let found = if present.schema {
                schema_row(pool).await?
            } else {
                None
            };
            let Some(v) = found else {
                let mut missing = Vec::new();
                if !present.schema {
                    missing.push("dedup_schema");
                } else {
                    missing.push("dedup_schema's row");
                }
                let records: bool =
                    sqlx::query_scalar("SELECT to_regclass('dedup_records') IS NOT NULL")
                        .fetch_one(pool)
                        .await?;
                if !records {
                    missing.push("dedup_records");
                }
                return Err(SchemaError::NotMigrated {
                    missing: missing.join(", "),
                });
            };
            status.schema = Some(accept(v)?);
        }
    }
    Ok(status)
}

/// Applies dedup's migrations that have not run yet ([`prepare`] in [`MigrationMode::Apply`]):
/// moves dedup's versions out of `_sqlx_migrations`, runs [`MIGRATOR`], checks the floor.
pub async fn migrate(pool: &PgPool) -> Result<(), SchemaError> {
    prepare(pool, MigrationMode::Apply).await?;
    Ok(())
}

/// The embedded migrations that run forward (all of dedup's so far).
fn up_migrations() -> impl Iterator<Item = &'static Migration> {
    MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
}

/// The embedded versions and checksums, as the arrays the statements take.
fn ours() -> (Vec<i64>, Vec<&'static [u8]>) {
    up_migrations().map(|m| (m.version, &*m.checksum)).unzip()
}

#[derive(Clone, Copy, Debug)]
struct Tables {
    /// `_sqlx_migrations`.
    legacy: bool,
    /// `dedup_migrations`.
    ours: bool,
    /// `dedup_schema`.
    schema: bool,
}

async fn tables(pool: &PgPool) -> Result<Tables, sqlx::Error> {
    let (legacy, ours, schema): (bool, bool, bool) =
        sqlx::query_as(TABLES_SQL).fetch_one(pool).await?;
    Ok(Tables {
        legacy,
        ours,
        schema,
    })
}

/// The schema's row, if `dedup_schema` exists and holds one.
async fn schema(pool: &PgPool) -> Result<Option<SchemaVersion>, sqlx::Error> {
    if !tables(pool).await?.schema {
        return Ok(None);
    }
    schema_row(pool).await
}

async fn schema_row(pool: &PgPool) -> Result<Option<SchemaVersion>, sqlx::Error> {
    let row: Option<(i32, i32)> = sqlx::query_as(SCHEMA_SQL).fetch_optional(pool).await?;
    Ok(row.map(|(generation, compat_floor)| SchemaVersion {
        generation,
        compat_floor,
    }))
}

/// The versions recorded in `dedup_migrations` (which must exist), with their checksums.
async fn recorded(pool: &PgPool) -> Result<HashMap<i64, Vec<u8>>, sqlx::Error> {
    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(RECORDED_SQL).fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// Refuses a schema whose floor is above this binary.
fn within_floor(v: SchemaVersion) -> Result<SchemaVersion, SchemaError> {
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
fn accept(v: SchemaVersion) -> Result<SchemaVersion, SchemaError> {
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
async fn move_legacy(pool: &PgPool) -> Result<Vec<i64>, SchemaError> {
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
async fn run_migrator(pool: &PgPool) -> Result<(), SchemaError> {
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
async fn verify(pool: &PgPool, present: Tables) -> Result<Vec<i64>, SchemaError> {
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
fn sqlx_lock_id(database: &str) -> i64 {
    0x3d32_ad9e_i64 * i64::from(crc32(database.as_bytes()))
}

/// CRC-32/ISO-HDLC (the zlib and Ethernet CRC), bit by bit: a database name is short.
fn crc32(bytes: &[u8]) -> u32 {
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
