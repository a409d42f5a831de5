-- Consumer positions written in the same transaction as a batch's effects (the Kafka TxRunner
-- with offsets in the transaction): the next offset to read per consumer group and partition.
-- Only ever moved forward (GREATEST), so an instance whose partition was revoked cannot rewind
-- it. A restarted consumer starts each partition here, so the database never sees a committed
-- batch twice.
CREATE TABLE dedup_offsets (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    next_offset    bigint      NOT NULL CHECK (next_offset >= 0),
    updated_at     timestamptz NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition)
);
