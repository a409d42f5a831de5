-- no-transaction
-- The partial index on live owners named `state` in its predicate, which made every completion a
-- non-HOT update. No binary needs it: every generation's adoption statement asks
-- `lease_until > now`, which dedup_records_lease_idx serves.
DROP INDEX CONCURRENTLY IF EXISTS dedup_records_live_owner_idx
