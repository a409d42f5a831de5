-- Generation 14, second step: the relay's round in progress. A round records each full page it
-- published (the snapshot it reads up to, and the `(xid8, pos)` of its last row), so a relay that
-- dies mid-round, or one that takes over, resumes after the last page recorded rather than
-- publishing the whole round again; the round's end clears them with the position's move.
--
-- Only adds (nullable columns, no default to write): the floor stays.

ALTER TABLE dedup_outbox_relay ADD COLUMN IF NOT EXISTS target text;
ALTER TABLE dedup_outbox_relay ADD COLUMN IF NOT EXISTS after_xid int8;
ALTER TABLE dedup_outbox_relay ADD COLUMN IF NOT EXISTS after_pos int8;

UPDATE dedup_schema SET generation = greatest(generation, 14);
