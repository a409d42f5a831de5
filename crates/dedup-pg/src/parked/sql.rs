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
    " GROUP BY has_key, ordering_key",
);

/// The fence of every owner's write: the owner row, locked FOR SHARE, where the epoch is ours.
/// $1 group, $2 topic, $3 partition, $4 epoch.
macro_rules! fenced {
    ($($rest:literal),* $(,)?) => {
        concat!(
            "WITH o AS (SELECT 1 FROM dedup_parked_owners",
            " WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND epoch = $4",
            " FOR SHARE) ",
            $($rest),*
        )
    };
}

/// Parks one message (at most once: a row at its offset stays as it is). Answers a row if it
/// was written now. $5 offset, $6 has_key, $7 ordering key, $8 message key, $9 payload, $10
/// header names, $11 header values, $12 timestamp, $13 error, $14 attempts, $15 seconds until
/// it is due, $16 and $17 its dedup record's scope and key.
pub(super) const PARK_SQL: &str = fenced!(
    "INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key,",
    " ordering_key, message_key, payload, header_names, header_values, timestamp_ms, error,",
    " attempts, parked_at, due_at, dedup_scope, dedup_key)",
    " SELECT $1, $2, $3, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, statement_timestamp(),",
    " statement_timestamp() + make_interval(secs => $15), $16, $17 FROM o",
    " ON CONFLICT DO NOTHING RETURNING 1",
);

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
    "SELECT * FROM (SELECT DISTINCT ON (p.topic, p.partition, p.has_key, p.ordering_key)",
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
    " ORDER BY p.topic, p.partition, p.has_key, p.ordering_key, p.\"offset\") h",
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
    " RETURNING 1),",
    " m AS (UPDATE dedup_parked p SET held = true, gave_up = true, taken_epoch = NULL,",
    " taken_until = NULL WHERE EXISTS (SELECT 1 FROM o) AND $6",
    " AND p.consumer_group = $1 AND p.topic = $2 AND p.partition = $3 AND p.\"offset\" = $5",
    " RETURNING p.has_key, p.ordering_key),",
    " h AS (UPDATE dedup_parked p SET held = true FROM m WHERE p.consumer_group = $1",
    " AND p.topic = $2 AND p.partition = $3 AND p.has_key = m.has_key",
    " AND p.ordering_key = m.ordering_key AND p.\"offset\" <> $5 RETURNING 1)",
    " SELECT EXISTS (SELECT 1 FROM o) AS owned,",
    " EXISTS (SELECT 1 FROM d) OR EXISTS (SELECT 1 FROM m) AS deleted,",
    " (SELECT count(*) FROM h) AS held",
);

/// A head that failed again: its error and attempts, and when it is due next. $5 offset,
/// $6 error, $7 attempts, $8 seconds.
pub(super) const DEFER_SQL: &str = fenced!(
    "UPDATE dedup_parked p SET error = $6, attempts = $7, taken_epoch = NULL, taken_until = NULL,",
    " due_at = statement_timestamp() + make_interval(secs => $8)",
    " WHERE EXISTS (SELECT 1 FROM o) AND p.consumer_group = $1 AND p.topic = $2",
    " AND p.partition = $3 AND p.\"offset\" = $5 RETURNING 1",
);

/// A group's parked keys, oldest first: messages, the oldest park, the head's attempts, error and
/// due time, and whether an operator holds or dropped it. $1 group.
pub(super) const SUMMARY_SQL: &str = concat!(
    "SELECT topic, partition, has_key, ordering_key, count(*) AS messages,",
    " (EXTRACT(EPOCH FROM min(parked_at)) * 1e6)::int8 AS oldest_us,",
    " (array_agg(attempts ORDER BY \"offset\"))[1] AS head_attempts,",
    " (array_agg(error ORDER BY \"offset\"))[1] AS head_error,",
    " (EXTRACT(EPOCH FROM (array_agg(due_at ORDER BY \"offset\"))[1]) * 1e6)::int8 AS due_us,",
    " bool_or(held) AS held, bool_or(dropped) AS dropped",
    " FROM dedup_parked WHERE consumer_group = $1",
    " GROUP BY topic, partition, has_key, ordering_key ORDER BY min(parked_at)",
);

/// An operator makes a key's head due now and lifts a hold. $1 group, $2 has_key, $3 ordering
/// key (empty for the keyless queue).
pub(super) const UNPARK_SQL: &str = concat!(
    "UPDATE dedup_parked SET due_at = statement_timestamp(), held = false",
    " WHERE consumer_group = $1 AND has_key = $2 AND ordering_key = $3",
);

/// An operator asks for a key's queue to be dead-lettered (the partition's owner does it).
/// $1 group, $2 has_key, $3 ordering key.
pub(super) const DROP_SQL: &str = concat!(
    "UPDATE dedup_parked SET dropped = true, held = false, due_at = statement_timestamp()",
    " WHERE consumer_group = $1 AND has_key = $2 AND ordering_key = $3",
);

/// Parked keys, messages and the oldest park over the partitions given (the metrics).
/// $1 group, $2 topics, $3 partitions.
pub(super) const GAUGES_SQL: &str = concat!(
    "SELECT count(DISTINCT (p.topic, p.partition, p.has_key, p.ordering_key)) AS keys,",
    " count(*) AS messages,",
    " COALESCE(EXTRACT(EPOCH FROM statement_timestamp() - min(p.parked_at)), 0)::float8 AS oldest",
    " FROM dedup_parked p JOIN unnest($2::text[], $3::int4[]) AS w(topic, partition)",
    " ON p.topic = w.topic AND p.partition = w.partition WHERE p.consumer_group = $1",
);
