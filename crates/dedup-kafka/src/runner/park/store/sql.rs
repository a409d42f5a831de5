//! The parked-message statements (`dedup_parked`, `dedup_parked_owners`). Every write an owner
//! makes is fenced: it locks the partition's owner row `FOR SHARE` where the epoch is the
//! writer's, so it changes nothing once another owner bumped the epoch, and a bump waits for it.

/// Takes a partition's parked keys over: bumps its epoch (1 for a partition never owned).
/// $1 group, $2 topic, $3 partition, $4 owner.
pub(super) const ACQUIRE_SQL: &str = concat!(
    "INSERT INTO dedup_parked_owners (consumer_group, topic, partition, epoch, owner, acquired_at)",
    " VALUES ($1, $2, $3, 1, $4, statement_timestamp())",
    " ON CONFLICT (consumer_group, topic, partition) DO UPDATE",
    " SET epoch = dedup_parked_owners.epoch + 1, owner = EXCLUDED.owner,",
    " acquired_at = EXCLUDED.acquired_at",
    " RETURNING epoch",
);

/// A partition's parked keys and how many messages each has (the sync barrier of an
/// assignment: run after [`ACQUIRE_SQL`] committed, in a snapshot of its own, so that it sees
/// every park the bump waited for). $1 group, $2 topic, $3 partition.
pub(super) const KEYS_SQL: &str = concat!(
    "SELECT has_key, ordering_key, count(*) AS n FROM dedup_parked",
    " WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
    " GROUP BY has_key, ordering_digest, ordering_key",
);

/// The fence of every owner's write: the owner row, locked FOR SHARE, where the epoch is ours.
/// $1 group, $2 topic, $3 partition, $4 epoch.
macro_rules! fenced {
    ($($rest:tt)*) => {
        concat!(
            "WITH o AS (SELECT 1 FROM dedup_parked_owners",
            " WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND epoch = $4",
            " FOR SHARE) ",
            $($rest)*
        )
    };
}

/// Pins the dedup record named by $16 and $17 (scope, key) while a parked message names it:
/// `expires_at = 'infinity'`, so no claim takes it over as expired and no purge deletes it, with
/// the span it had to live kept in `pinned_ttl`. A record already past its retention is absent
/// and stays so. Only where the owner row `o` was locked (the writer owns the partition).
macro_rules! pin {
    ($scope:literal, $key:literal) => {
        concat!(
            "pin AS (UPDATE dedup_records r SET pinned_ttl = CASE",
            " WHEN r.expires_at = 'infinity' THEN r.pinned_ttl",
            " ELSE r.expires_at - r.updated_at END, expires_at = 'infinity'",
            " WHERE EXISTS (SELECT 1 FROM o) AND r.scope = ",
            $scope,
            " AND r.key = ",
            $key,
            " AND r.kt = dedup_kt(",
            $key,
            ") AND r.expires_at > statement_timestamp() RETURNING 1)"
        )
    };
}

/// Parks one message (at most once: a row at its offset stays as it is) and pins its dedup
/// record. Answers a row if it was written now. $5 offset, $6 has_key, $7 ordering key, $8
/// message key, $9 payload, $10 header names, $11 header values, $12 timestamp, $13 error, $14
/// attempts, $15 seconds until it is due, $16 and $17 its dedup record's scope and key, $18 a
/// held marker of a message dead-lettered in place under the hold policy (held and gave up).
pub(super) const PARK_SQL: &str = fenced!(
    ", ",
    pin!("$16", "$17"),
    " INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key,",
    " ordering_key, message_key, payload, header_names, header_values, timestamp_ms, error,",
    " attempts, parked_at, due_at, dedup_scope, dedup_key, held, gave_up)",
    " SELECT $1, $2, $3, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, statement_timestamp(),",
    " statement_timestamp() + make_interval(secs => $15), $16, $17, $18, $18 FROM o",
    " ON CONFLICT DO NOTHING RETURNING 1",
);

/// Gives a record back its span once no parked message names it any more: from now, the span it
/// had when pinned (or that a completion while pinned gave it). `$gone` is a CTE of the rows just
/// removed (`dedup_scope`, `dedup_key`, and the row's coordinates), which the statement's own
/// snapshot still sees in `dedup_parked`.
macro_rules! unpin {
    ($gone:literal) => {
        concat!(
            "unpin AS (UPDATE dedup_records r",
            " SET expires_at = statement_timestamp() + coalesce(r.pinned_ttl, interval '0'),",
            " updated_at = statement_timestamp(), pinned_ttl = NULL FROM ",
            $gone,
            " g WHERE r.scope = g.dedup_scope AND r.key = g.dedup_key",
            " AND r.kt = dedup_kt(g.dedup_key) AND r.expires_at = 'infinity'",
            // The record as this statement's snapshot saw it: a park that pinned it again and
            // committed meanwhile (its row invisible to the check below) changed its version,
            // and the record stays pinned.
            " AND r.xmin = (SELECT s.xmin FROM dedup_records s",
            " WHERE s.scope = g.dedup_scope AND s.key = g.dedup_key",
            " AND s.kt = dedup_kt(g.dedup_key))",
            " AND NOT EXISTS (SELECT 1 FROM dedup_parked q",
            " WHERE q.dedup_scope = g.dedup_scope AND q.dedup_key = g.dedup_key",
            " AND NOT (q.consumer_group = g.consumer_group AND q.topic = g.topic",
            " AND q.partition = g.partition AND q.\"offset\" = g.\"offset\"))",
            " RETURNING 1)"
        )
    };
}

/// After a park wrote nothing: whether the offset is parked already, and whether the epoch is
/// still ours. $1 group, $2 topic, $3 partition, $4 epoch, $5 offset.
pub(super) const PARK_CHECK_SQL: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM dedup_parked WHERE consumer_group = $1 AND topic = $2",
    " AND partition = $3 AND \"offset\" = $5) AS parked,",
    " EXISTS (SELECT 1 FROM dedup_parked_owners WHERE consumer_group = $1 AND topic = $2",
    " AND partition = $3 AND epoch = $4) AS owned",
);

/// The heads to drive now, over the partitions given (parallel arrays: topic, partition): each
/// key's lowest offset, where it is due, not held and not taken by a run of the current owner,
/// or the key was dropped by an operator. $1 group, $2 topics, $3 partitions, $4 limit.
pub(super) const DUE_HEADS_SQL: &str = concat!(
    "SELECT * FROM (SELECT DISTINCT ON (p.topic, p.partition, p.has_key, p.ordering_digest)",
    " p.topic, p.partition, p.\"offset\", p.has_key, p.ordering_key, p.message_key, p.payload,",
    " p.header_names, p.header_values, p.timestamp_ms, p.error, p.attempts, p.held, p.dropped,",
    " p.dedup_scope, p.dedup_key, p.gave_up,",
    " p.due_at <= statement_timestamp() AND (p.taken_until IS NULL",
    " OR p.taken_until <= statement_timestamp() OR p.taken_epoch IS DISTINCT FROM o.epoch) AS due",
    " FROM dedup_parked p JOIN unnest($2::text[], $3::int4[]) AS w(topic, partition)",
    " ON p.topic = w.topic AND p.partition = w.partition",
    " LEFT JOIN dedup_parked_owners o ON o.consumer_group = p.consumer_group",
    " AND o.topic = p.topic AND o.partition = p.partition",
    " WHERE p.consumer_group = $1",
    " ORDER BY p.topic, p.partition, p.has_key, p.ordering_digest, p.\"offset\") h",
    " WHERE (h.due AND NOT h.held) OR h.dropped",
    " ORDER BY h.topic, h.partition, h.\"offset\" LIMIT $4",
);

/// Takes a head to run: marks it taken by this epoch for the run's bound, so a second look of
/// this owner does not pick it again (a later owner does). Answers whether we own the partition
/// and whether the row was there. $5 offset, $6 seconds.
pub(super) const TAKE_SQL: &str = fenced!(
    ", t AS (UPDATE dedup_parked p SET taken_epoch = $4,",
    " taken_until = statement_timestamp() + make_interval(secs => $6)",
    " WHERE EXISTS (SELECT 1 FROM o) AND p.consumer_group = $1 AND p.topic = $2",
    " AND p.partition = $3 AND p.\"offset\" = $5",
    // Still due: a look that read it before a run deferred it must not run it early.
    " AND (p.dropped OR (NOT p.held AND p.due_at <= statement_timestamp()",
    " AND (p.taken_until IS NULL OR p.taken_until <= statement_timestamp()",
    " OR p.taken_epoch IS DISTINCT FROM $4)))",
    " RETURNING 1)",
    " SELECT EXISTS (SELECT 1 FROM o) AS owned, EXISTS (SELECT 1 FROM t) AS taken",
);

/// A head that settled (ran, replayed, or dead-lettered): its row goes. With $6 (the hold
/// policy, after a dead letter) it stays instead as the key's held marker, and the key's other
/// messages are held too, until an operator releases them. Answers whether we own the partition
/// and whether the row was there. $5 offset, $6 hold.
pub(super) const SETTLE_SQL: &str = fenced!(
    ", d AS (DELETE FROM dedup_parked p WHERE EXISTS (SELECT 1 FROM o) AND NOT $6",
    " AND p.consumer_group = $1 AND p.topic = $2 AND p.partition = $3 AND p.\"offset\" = $5",
    " RETURNING p.consumer_group, p.topic, p.partition, p.\"offset\", p.dedup_scope,",
    " p.dedup_key),",
    unpin!("d"),
    ",",
    " m AS (UPDATE dedup_parked p SET held = true, gave_up = true, taken_epoch = NULL,",
    " taken_until = NULL WHERE EXISTS (SELECT 1 FROM o) AND $6",
    " AND p.consumer_group = $1 AND p.topic = $2 AND p.partition = $3 AND p.\"offset\" = $5",
    " RETURNING p.has_key, p.ordering_digest, p.ordering_key),",
    " h AS (UPDATE dedup_parked p SET held = true FROM m WHERE p.consumer_group = $1",
    " AND p.topic = $2 AND p.partition = $3 AND p.has_key = m.has_key",
    " AND p.ordering_digest = m.ordering_digest AND p.ordering_key = m.ordering_key",
    " AND p.\"offset\" <> $5 RETURNING 1)",
    " SELECT EXISTS (SELECT 1 FROM o) AS owned,",
    " EXISTS (SELECT 1 FROM d) OR EXISTS (SELECT 1 FROM m) AS deleted,",
    " (SELECT count(*) FROM h) AS held",
);

/// A head that failed again: its error and attempts, and when it is due next. $5 offset,
/// $6 error, $7 attempts, $8 seconds.
/// The head's record is pinned again: its run's claim may have made it (a message parked behind
/// its key has no record until it runs).
pub(super) const DEFER_SQL: &str = fenced!(
    ", u AS (UPDATE dedup_parked p SET error = $6, attempts = $7, taken_epoch = NULL,",
    " taken_until = NULL, due_at = statement_timestamp() + make_interval(secs => $8)",
    " WHERE EXISTS (SELECT 1 FROM o) AND p.consumer_group = $1 AND p.topic = $2",
    " AND p.partition = $3 AND p.\"offset\" = $5 RETURNING p.dedup_scope, p.dedup_key),",
    " pin AS (UPDATE dedup_records r SET pinned_ttl = CASE",
    " WHEN r.expires_at = 'infinity' THEN r.pinned_ttl",
    " ELSE r.expires_at - r.updated_at END, expires_at = 'infinity' FROM u",
    " WHERE r.scope = u.dedup_scope AND r.key = u.dedup_key",
    " AND r.kt = dedup_kt(u.dedup_key) AND r.expires_at > statement_timestamp() RETURNING 1)",
    " SELECT 1 FROM u",
);

/// A group's parked keys, oldest first: messages, the oldest park, the head's attempts, error and
/// due time, and whether an operator holds or dropped it. $1 group, $2 topic or NULL, $3
/// partition or NULL.
pub(super) const SUMMARY_SQL: &str = concat!(
    "SELECT topic, partition, has_key, ordering_key, count(*) AS messages,",
    " (EXTRACT(EPOCH FROM min(parked_at)) * 1e6)::int8 AS oldest_us,",
    " (array_agg(attempts ORDER BY \"offset\"))[1] AS head_attempts,",
    " (array_agg(error ORDER BY \"offset\"))[1] AS head_error,",
    " (EXTRACT(EPOCH FROM (array_agg(due_at ORDER BY \"offset\"))[1]) * 1e6)::int8 AS due_us,",
    " bool_or(held) AS held, bool_or(dropped) AS dropped",
    " FROM dedup_parked WHERE consumer_group = $1",
    " AND ($2::text IS NULL OR topic = $2) AND ($3::int4 IS NULL OR partition = $3)",
    " GROUP BY topic, partition, has_key, ordering_digest, ordering_key ORDER BY min(parked_at)",
);

/// The rows of one parked key of an operator's statement: $1 group, $2 has_key, $3 ordering key
/// (empty for the keyless queue), $4 topic or NULL (every topic), $5 partition or NULL.
macro_rules! on_key {
    ($($head:literal),* $(,)?) => {
        concat!(
            $($head,)*
            " WHERE consumer_group = $1 AND has_key = $2 AND ordering_digest = sha256($3::bytea)",
            " AND ordering_key = $3 AND ($4::text IS NULL OR topic = $4)",
            " AND ($5::int4 IS NULL OR partition = $5)",
        )
    };
}

/// An operator makes a key's head due now and lifts a hold.
pub(super) const UNPARK_SQL: &str =
    on_key!("UPDATE dedup_parked SET due_at = statement_timestamp(), held = false");

/// An operator asks for a key's queue to be dead-lettered (the partition's owner does it).
pub(super) const DROP_SQL: &str =
    on_key!("UPDATE dedup_parked SET dropped = true, held = false, due_at = statement_timestamp()");

/// Parked keys, messages and the oldest park over the partitions given (the metrics).
/// $1 group, $2 topics, $3 partitions.
pub(super) const GAUGES_SQL: &str = concat!(
    "SELECT count(DISTINCT (p.topic, p.partition, p.has_key, p.ordering_key)) AS keys,",
    " count(*) AS messages,",
    " COALESCE(EXTRACT(EPOCH FROM statement_timestamp() - min(p.parked_at)), 0)::float8 AS oldest",
    " FROM dedup_parked p JOIN unnest($2::text[], $3::int4[]) AS w(topic, partition)",
    " ON p.topic = w.topic AND p.partition = w.partition WHERE p.consumer_group = $1",
);
