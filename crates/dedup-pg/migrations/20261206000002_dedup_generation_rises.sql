-- Generation 12: the schema's generation only rises. Each migration before this one sets
-- `generation = N` as it stands, so a binary that carried an older (or a withdrawn) migration and
-- ran it against a newer schema lowered the generation, and every newer binary then refused the
-- schema as too old. Binaries of generation 12 apply none of their migrations to a newer schema
-- and run none out of order (`migrate.rs`); this trigger holds for the binaries already out there
-- too: an update of `dedup_schema` never takes the generation down. (Landed migrations are never
-- edited: every new one raises it with `greatest`.) The floor is not touched; older binaries
-- read the table as they did.
CREATE OR REPLACE FUNCTION dedup_schema_generation_rises() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.generation := greatest(NEW.generation, OLD.generation);
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS dedup_schema_generation_rises ON dedup_schema;
CREATE TRIGGER dedup_schema_generation_rises BEFORE UPDATE ON dedup_schema
    FOR EACH ROW EXECUTE FUNCTION dedup_schema_generation_rises();

UPDATE dedup_schema SET generation = greatest(generation, 12);
