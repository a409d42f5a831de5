-- Parked messages: per-key ordered retries kept in dedup's own store (docs/PARKING.md).
--
-- A message that keeps failing retryably is written here, in one statement, before its
-- partition's offset may move past it; later messages of its ordering key are written behind it
-- without running. The partition's owner re-runs each key's head (the lowest offset) through the
-- same claim, so a re-run never doubles an effect; a key is free when it has no row left. The
-- count of a key's pending messages is its row count: nothing to drift.

-- Who owns a partition's parked keys: the epoch, bumped by each new owner when the partition is
-- assigned to it. Every write to a partition's parked messages names the writer's epoch and locks
-- this row FOR SHARE, so a revoked owner (a stopped process, a late task) can neither park into a
-- partition it lost nor drive its keys, and a new owner's bump waits for a park in flight.
CREATE TABLE dedup_parked_owners (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    epoch          bigint      NOT NULL,
    owner          text        NOT NULL,
    acquired_at    timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition)
);

CREATE TABLE dedup_parked (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    "offset"       bigint      NOT NULL,
    -- The ordering key (by default the Kafka message key); the partition's messages without one
    -- share one queue (has_key false, ordering_key empty).
    has_key        boolean     NOT NULL,
    ordering_key   bytea       NOT NULL,
    message_key    bytea,
    payload        bytea,
    header_names   text[]      NOT NULL,
    header_values  bytea[]     NOT NULL,
    -- The message's timestamp (ms since the epoch), if it had one.
    timestamp_ms   bigint,
    -- Its dedup record's scope and key (when it had a usable one): the purge keeps that record
    -- while the message is parked, so a re-run after a long wait still finds a result stored
    -- before and never runs the effect twice.
    dedup_scope    text,
    dedup_key      bytea,
    -- The last failure, and the attempts made so far (in place and parked).
    error          text        NOT NULL,
    attempts       integer     NOT NULL,
    parked_at      timestamptz NOT NULL,
    -- When the head may run next (a later message's due_at is not read).
    due_at         timestamptz NOT NULL,
    -- A run of the head under way: by which epoch's owner, and until when another look may not
    -- pick it (a new owner picks it at once: the run's owner is gone).
    taken_epoch    bigint,
    taken_until    timestamptz,
    -- An operator must release the key (`dedup unpark`): set on a key's messages when its head was
    -- dead-lettered under the hold policy.
    held           boolean     NOT NULL DEFAULT false,
    -- An operator asked for the key's queue to be dead-lettered (`dedup drop`): the owner does it.
    dropped        boolean     NOT NULL DEFAULT false,
    -- The head was dead-lettered under the hold policy: the row stays (held) as the key's marker,
    -- so the key keeps its later messages back until an operator releases it; then the owner
    -- removes it without running it.
    gave_up        boolean     NOT NULL DEFAULT false,
    -- Parked at most once: a replay after a crash finds its row.
    PRIMARY KEY (consumer_group, topic, partition, "offset")
);

CREATE INDEX dedup_parked_dedup_key_idx
    ON dedup_parked (dedup_scope, dedup_key) WHERE dedup_key IS NOT NULL;

-- A key's queue in offset order, and its head.
CREATE INDEX dedup_parked_key_idx
    ON dedup_parked (consumer_group, topic, partition, has_key, ordering_key, "offset");
