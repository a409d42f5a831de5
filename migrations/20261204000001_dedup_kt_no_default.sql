-- Generation 10: on the table partitioned by the key's time, kt has no default and the parent
-- no check `kt = dedup_kt(key)` (docs/ARCHITECTURE.md, invariant 36; docs/PERFORMANCE.md, "The
-- parent's check, replaced by a column without a default").
--
-- The check was compiled again by every statement that wrote a record (the inlined mapping is
-- some 200 expression nodes, parsed and planned per statement): 0.2-0.3 ms of a 128-row insert,
-- 15-20% of Postgres's CPU under transaction mode by the batch. What it refused is a writer that
-- leaves kt out (a binary older than generation 7, or SQL written by hand), which took the
-- default, '-infinity', and put a key with a day where no lookup finds it. With no default such a
-- writer's kt is NULL, which no partition takes: refused the same way (23514), at no cost per
-- statement. Every statement dedup runs writes kt = dedup_kt(key) of the key it was given
-- (invariant 36), and the tests hold every record to the partition dedup_kt names.
--
-- The single table keeps its default: binaries of generation 6 and older, which neither write
-- nor ask for kt, still work against it (its floor stays). The DROP DEFAULT reaches every
-- partition. A binary of generation 9 writes kt in every statement: the floor stays 9.
--
-- The table's lock is asked for 100 ms at a time, giving way in between (up to 200 tries, then
-- the migration fails and can be run again), so claims are not held behind someone else's long
-- transaction while this waits.
DO $kt$
DECLARE
    tries int := 0;
    waited text := current_setting('lock_timeout');
BEGIN
    IF EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'dedup_records'::regclass) THEN
        PERFORM set_config('lock_timeout', '100ms', true);
        LOOP
            BEGIN
                LOCK TABLE dedup_records IN ACCESS EXCLUSIVE MODE;
                EXIT;
            EXCEPTION WHEN lock_not_available THEN
                tries := tries + 1;
                IF tries >= 200 THEN
                    RAISE;
                END IF;
                PERFORM pg_sleep(0.1);
            END;
        END LOOP;
        PERFORM set_config('lock_timeout', waited, true);
        ALTER TABLE dedup_records ALTER COLUMN kt DROP DEFAULT;
        ALTER TABLE dedup_records DROP CONSTRAINT IF EXISTS dedup_records_kt;
    END IF;
END
$kt$;

UPDATE dedup_schema SET generation = 10;
