-- Dead letters kept at reused coordinates: a topic deleted and made again (its offsets start at 0
-- again), or two clusters' topics of one name in one database, give a new dead letter the
-- (group, topic, partition, offset) of an old one. Each row now also holds the digest of its
-- letter (the message key, payload, headers and timestamp, length-prefixed, sha256), and the key
-- is the coordinates and the digest: a letter written again after a crash meets its own row and
-- writes nothing, a different letter at the same coordinates is kept beside the old one.
--
-- Only adds: a binary of generation 11 still inserts without the new columns (its rows get the
-- empty digest, and its `ON CONFLICT DO NOTHING` still meets its own rows), reads by group and
-- deletes by coordinates. The floor stays.
ALTER TABLE dedup_dead_letters
    -- sha256 of the letter's content; empty for rows kept by a binary of generation 11 or older.
    ADD COLUMN digest    bytea NOT NULL DEFAULT '\x',
    -- The idempotency key the message had, where it had a usable one (`dedup forget
    -- --kept-dead-letters`); NULL for a message without one and for older binaries' rows.
    ADD COLUMN scope     text,
    ADD COLUMN dedup_key bytea;

ALTER TABLE dedup_dead_letters
    DROP CONSTRAINT dedup_dead_letters_pkey,
    ADD PRIMARY KEY (consumer_group, topic, partition, "offset", digest);

UPDATE dedup_schema SET generation = greatest(generation, 12);
