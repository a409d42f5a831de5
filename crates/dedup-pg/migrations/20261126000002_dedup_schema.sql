-- The schema's generation and compatibility floor (docs/MIGRATIONS.md). One row:
-- `generation` is the generation of the dedup binary whose migrations last wrote the schema
-- (`dedup_pg::SCHEMA_GENERATION`), `compat_floor` the oldest binary generation that can still
-- use it. A binary refuses to start on a schema whose floor is above its own generation, and
-- accepts a newer schema whose floor it meets (a rollback, or a deploy under way).
--
-- Generation 2 is the first binary to record its migrations in `dedup_migrations` and to read
-- this table. Every migration so far only adds (tables, columns with defaults or NULL, indexes),
-- so binaries of generation 1 still work against it: the floor is 1. A later migration that
-- contracts (drops, renames, NOT NULL on a new column) raises the floor with an UPDATE of this
-- row; no migration ever deletes it.
CREATE TABLE dedup_schema (
    id           boolean PRIMARY KEY DEFAULT true CHECK (id),
    generation   integer NOT NULL,
    compat_floor integer NOT NULL,
    CHECK (compat_floor <= generation)
);

INSERT INTO dedup_schema (generation, compat_floor) VALUES (2, 1);
