-- Live leases by owner, for adoption: a restarted instance ends the leases its earlier
-- incarnations hold (owner LIKE '<identity>/%') in one statement. Partial: only IN_PROGRESS rows
-- are in it, so it stays as small as the work in flight.
CREATE INDEX dedup_records_live_owner_idx ON dedup_records (owner text_pattern_ops)
    WHERE state = 'in_progress';
