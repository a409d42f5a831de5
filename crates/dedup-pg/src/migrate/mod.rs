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
//! dead-letter topic refused for good); the outbox (`dedup_outbox`, a ring of three tables
//! partitioned by `ring`, indexed on `(xid8, pos)`; `dedup_outbox_relay`, one row: the ring
//! written, the relay's position, its round in progress (migration 20261208000002) and its
//! lease; `dedup_outbox_dead`; `dedup_outbox_pos_seq`);
//! `dedup_schema` (one row: the generation and the floor);
//! and the PL/pgSQL functions that the pooled statements joining `dedup_records` to a batch's
//! arrays go through, each keeping one generic plan per connection that is safe by its shape
//! whatever the table's statistics said when it was made: `dedup_complete_batch` (batch
//! completions), `dedup_get_many`, `dedup_extend_batch` (batch heartbeats) and
//! `dedup_regrant_batch` (bitmap probes only), `dedup_claim_batch` and `dedup_fresh_batch` (a
//! `LATERAL` probe per key), and for a single request claimed in its own transaction
//! `dedup_probe_one` (a probe of the primary key) and `dedup_complete_one`. Beside them,
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

mod error;
mod steps;

pub use error::SchemaError;
use steps::{
    accept, move_legacy, recorded, run_migrator, schema, schema_row, tables, up_migrations, verify,
    within_floor,
};

use sqlx::migrate::Migrator;
use sqlx::postgres::PgPool;
use tracing::info;

/// This binary's schema generation: the generation its newest migration writes to
/// `dedup_schema`. A schema whose `compat_floor` is above it is refused.
pub const SCHEMA_GENERATION: i32 = 14;

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
