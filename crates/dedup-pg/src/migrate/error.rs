//! [`SchemaError`]: why [`prepare`](super::prepare) refused the database, and whether trying
//! again can help.

use sqlx::migrate::MigrateError;

/// Why [`prepare`](super::prepare) refused the database.
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
        /// This binary's generation ([`SCHEMA_GENERATION`](super::SCHEMA_GENERATION)).
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
        /// This binary's generation ([`SCHEMA_GENERATION`](super::SCHEMA_GENERATION)).
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
    /// The database was never migrated by dedup ([`MigrationMode::Off`](super::MigrationMode::Off), which changes
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
        /// This binary's generation ([`SCHEMA_GENERATION`](super::SCHEMA_GENERATION)).
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
pub(super) fn connection_failure(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03" | "53300")
        }),
        _ => false,
    }
}
