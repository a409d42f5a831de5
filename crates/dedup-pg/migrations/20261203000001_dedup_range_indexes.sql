-- Generation 9: each partition of the table partitioned by the key's time has its own index on
-- expires_at (a BRIN in each range of days), and the bounded DELETE never walks a range
-- (crates/dedup-pg/src/layout/expiry.rs). Nothing here changes the schema: the generation marks
-- the binaries that know it, and the switch (`dedup migrate --partition-by-key-time`) and the
-- retention's move of an older switch's indexes raise the floor to 9 where the table is
-- partitioned, since a generation-8 binary would make ranges without an index on expires_at and
-- delete in them in the order of expires_at. The single table is unchanged: the floor stays.
UPDATE dedup_schema SET generation = 9;
