-- no-transaction
-- Live leases by their end (issue 27; the migrations 20261130000001-4 together let a lease-mode
-- completion be a HOT update, docs/ARCHITECTURE.md invariant 35). Built without holding off
-- writes. A build that was interrupted leaves an invalid index under this name, which the next
-- migration refuses (REINDEX INDEX CONCURRENTLY dedup_records_lease_idx repairs it).
CREATE INDEX CONCURRENTLY IF NOT EXISTS dedup_records_lease_idx ON dedup_records (lease_until)
    WHERE lease_until IS NOT NULL
