//! Postgres-only scenarios (placeholder, filled below).
