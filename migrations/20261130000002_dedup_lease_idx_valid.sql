-- The index on lease ends must be whole before the index on live owners goes (next migration):
-- adoption's statement, in every generation, is served by one or the other.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_index
            WHERE indexrelid = to_regclass('dedup_records_lease_idx') AND indisvalid) THEN
        RAISE EXCEPTION 'dedup_records_lease_idx is missing or invalid (its build was interrupted)'
            USING HINT = 'Run REINDEX INDEX CONCURRENTLY dedup_records_lease_idx, then migrate again.';
    END IF;
END
$$;
