-- Generation 14: the outbox (docs/OUTBOX.md). What a handler publishes is written in the
-- transaction of its effect and published to Kafka by one relay once that transaction commits.
--
--   * dedup_outbox holds the messages, partitioned by `ring` into three tables that take the
--     writes in turn (PgQ's ring): published rows go by a TRUNCATE of a whole table once every
--     row in it is published, never by a DELETE per row. A writer names the ring from
--     dedup_outbox_relay in the same statement as its insert.
--   * `xid8` is the writing transaction's top-level id (under a savepoint too). The relay reads
--     by snapshot differences: the rows of transactions visible in its new snapshot and not in
--     the one it stored (`[prev.xmax, cur.xmax)` visible in cur, or in prev's in-progress list
--     and visible in cur), on the index of (xid8, pos), so a transaction that commits late with a
--     lower id is read once it commits, and a long transaction elsewhere holds nothing back.
--   * `pos` orders a transaction's rows as they were queued (one sequence, taken in insertion
--     order by the writing session); (xid8, pos) is the publication order.
--   * dedup_outbox_relay is one row: the ring being written, the position (the snapshot in which
--     every visible row is published), and the relay's lease (leader, epoch, until): a relay
--     moves the position only under the epoch it took the lease with.
--   * dedup_outbox_dead holds messages the broker refused for good, with the reason.
--
-- Only adds: the floor stays.

CREATE SEQUENCE IF NOT EXISTS dedup_outbox_pos_seq;

CREATE TABLE IF NOT EXISTS dedup_outbox (
    xid8        xid8        NOT NULL DEFAULT pg_current_xact_id(),
    pos         int8        NOT NULL DEFAULT nextval('dedup_outbox_pos_seq'),
    ring        int2        NOT NULL,
    topic       text        NOT NULL,
    msg_key     bytea,
    payload     bytea,
    headers     bytea       NOT NULL,
    idem_key    bytea       NOT NULL,
    cause_scope text        NOT NULL,
    cause_key   bytea       NOT NULL,
    event_ms    int8        NOT NULL,
    written_at  timestamptz NOT NULL DEFAULT statement_timestamp()
) PARTITION BY LIST (ring);

CREATE TABLE IF NOT EXISTS dedup_outbox_0 PARTITION OF dedup_outbox FOR VALUES IN (0);
CREATE TABLE IF NOT EXISTS dedup_outbox_1 PARTITION OF dedup_outbox FOR VALUES IN (1);
CREATE TABLE IF NOT EXISTS dedup_outbox_2 PARTITION OF dedup_outbox FOR VALUES IN (2);

CREATE INDEX IF NOT EXISTS dedup_outbox_order_idx ON dedup_outbox (xid8, pos);

CREATE TABLE IF NOT EXISTS dedup_outbox_relay (
    id          int2        PRIMARY KEY CHECK (id = 1),
    ring        int2        NOT NULL DEFAULT 0 CHECK (ring BETWEEN 0 AND 2),
    rotated_at  timestamptz NOT NULL DEFAULT statement_timestamp(),
    position    text        NOT NULL,
    moved_at    timestamptz NOT NULL DEFAULT statement_timestamp(),
    published   int8        NOT NULL DEFAULT 0,
    leader      text,
    epoch       int8        NOT NULL DEFAULT 0,
    lease_until timestamptz NOT NULL DEFAULT '-infinity'
);

-- No row of dedup_outbox exists before this transaction commits, so its snapshot is a position
-- with nothing published behind it.
INSERT INTO dedup_outbox_relay (id, position) VALUES (1, pg_current_snapshot()::text)
ON CONFLICT (id) DO NOTHING;

CREATE TABLE IF NOT EXISTS dedup_outbox_dead (
    id          int8        GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    xid8        xid8        NOT NULL,
    pos         int8        NOT NULL,
    topic       text        NOT NULL,
    msg_key     bytea,
    payload     bytea,
    headers     bytea       NOT NULL,
    idem_key    bytea       NOT NULL,
    cause_scope text        NOT NULL,
    cause_key   bytea       NOT NULL,
    event_ms    int8        NOT NULL,
    written_at  timestamptz NOT NULL,
    reason      text        NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT statement_timestamp()
);

UPDATE dedup_schema SET generation = greatest(generation, 14);
