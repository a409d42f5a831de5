-- dedup's records: one row per (scope, key). Postgres is the source of truth and the only tier
-- that grants leases. See docs/ARCHITECTURE.md for the state machine.

-- Fencing tokens come from one sequence, not a per-key counter: they grow on every claim and
-- takeover and never repeat, even after a record is purged and its key claimed afresh.
CREATE SEQUENCE dedup_token_seq AS bigint MINVALUE 1;

CREATE TABLE dedup_records (
    scope       text        NOT NULL,
    key         bytea       NOT NULL,
    state       text        NOT NULL
                CHECK (state IN ('in_progress', 'released', 'completed', 'failed')),
    owner       text,
    token       bigint      NOT NULL,
    -- Leases are measured on this server's clock (statement_timestamp()), never a client's.
    lease_until timestamptz,
    attempts    integer     NOT NULL CHECK (attempts >= 1),
    fingerprint bytea       CHECK (fingerprint IS NULL OR octet_length(fingerprint) = 32),
    result      bytea,
    failure     text,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    -- Past this the record is treated as absent, and purge deletes it.
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_progress' OR lease_until IS NOT NULL)
);

-- Retention purge walks this index in bounded batches.
CREATE INDEX dedup_records_expires_at_idx ON dedup_records (expires_at);
