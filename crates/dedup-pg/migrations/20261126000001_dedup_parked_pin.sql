-- Parked messages and the dedup window; ordering keys of any length; dead letters that the
-- dead-letter topic refused. Every change here is additive: a binary of the previous migration
-- keeps working against it (it neither reads nor writes the new columns, and the generated
-- column fills itself).

-- A record named by a parked message is pinned (`expires_at = 'infinity'`) while it is named, so
-- a claim never takes it over as expired and the purge never deletes it; `pinned_ttl` keeps how
-- long the record had to live when it was pinned (and what a completion while pinned would have
-- given it), and the record gets that span again from the moment its last parked message settles.
ALTER TABLE dedup_records ADD COLUMN pinned_ttl interval;

-- Ordering keys are indexed by their digest: a btree entry is limited to about 2.7 KB, and an
-- ordering key is any Kafka key.
ALTER TABLE dedup_parked
    ADD COLUMN ordering_digest bytea GENERATED ALWAYS AS (sha256(ordering_key)) STORED;
DROP INDEX dedup_parked_key_idx;
CREATE INDEX dedup_parked_digest_idx
    ON dedup_parked (consumer_group, topic, partition, has_key, ordering_digest, "offset");

-- Dead letters the dead-letter topic refused for good (a message larger than the topic accepts,
-- an invalid record): kept here, without loss, instead of stalling their partition. Shown and
-- removed by `dedup dead-letters`. Not `dedup_parked`: these rows block nothing.
CREATE TABLE dedup_dead_letters (
    consumer_group    text        NOT NULL,
    topic             text        NOT NULL,
    partition         integer     NOT NULL,
    "offset"          bigint      NOT NULL,
    message_key       bytea,
    payload           bytea,
    -- Header names as bytes: a name Postgres text cannot hold (a NUL) is kept as it was.
    header_names      bytea[]     NOT NULL,
    header_values     bytea[]     NOT NULL,
    timestamp_ms      bigint,
    reason            text        NOT NULL,
    attempts          integer     NOT NULL,
    dead_letter_topic text        NOT NULL,
    -- Why the dead-letter topic refused it.
    refusal           text        NOT NULL,
    stored_at         timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition, "offset")
);
