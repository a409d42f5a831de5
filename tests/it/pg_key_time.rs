//! The time of a UUIDv7 key as Postgres reads it (`dedup_uuid7_ms_v1`, migration 20261130000001)
//! and as the engine does (`IdempotencyKey::uuid7_millis`): the same function of the bytes, for
//! every byte string, never an error, bound to its helper whatever the `search_path`, and inlined
//! by the planner. The window partitioned by the key's own time is to be built on it
//! (docs/design/window-partitions.md): two readers that disagreed on a key's time would put it in
//! two partitions, and run its effect twice.

use dedup_core::{IdempotencyKey, Scope};
use dedup_workload::{Lcg, event_id, time_ordered_event_id};
use sqlx::PgPool;

fn byte(rng: &mut Lcg) -> u8 {
    u8::try_from(rng.below(256)).unwrap()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn raw(text: &str) -> Vec<u8> {
    let digits = text.replace('-', "");
    (0..16)
        .map(|j| u8::from_str_radix(&digits[2 * j..2 * j + 2], 16).unwrap())
        .collect()
}

/// The engine's answer for `key`.
fn engine(key: &[u8]) -> Option<i64> {
    IdempotencyKey::new(Scope::new("t").unwrap(), key)
        .unwrap()
        .uuid7_millis()
        .map(|ms| i64::try_from(ms).unwrap())
}

/// Classes of keys, each to hold both answers: every single-byte change (each position, each of
/// the 256 values) of one text and one raw UUIDv7; then, at random, UUIDv7s as text (lower, upper
/// and mixed case) and raw, each with one byte changed, every version and variant digit, keys
/// of a random id and an event's time (`IdempotencyKey::timed`), and random bytes of the lengths
/// that matter and around them.
fn corpus() -> Vec<(&'static str, Vec<u8>)> {
    let mut keys = Vec::new();
    let text = time_ordered_event_id(0x0190_1234_5678, 1);
    for (class, base) in [
        ("every change, text", text.clone().into_bytes()),
        ("every change, raw", raw(&text)),
    ] {
        for at in 0..base.len() {
            for value in 0..=255 {
                let mut k = base.clone();
                k[at] = value;
                keys.push((class, k));
            }
        }
    }
    let mut rng = Lcg::new(0x2600_5eed);
    for i in 0..2_000 {
        let text = time_ordered_event_id(rng.below(1 << 48), i);
        let mixed: String = text
            .chars()
            .enumerate()
            .map(|(j, c)| {
                if j % 2 == 0 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        keys.push(("text", text.clone().into_bytes()));
        keys.push(("upper case", text.to_uppercase().into_bytes()));
        keys.push(("mixed case", mixed.into_bytes()));
        keys.push(("raw", raw(&text)));
        for (class, mut k) in [
            ("changed text", text.clone().into_bytes()),
            ("changed raw", raw(&text)),
        ] {
            let at = usize::try_from(rng.below(k.len() as u64)).unwrap();
            k[at] = byte(&mut rng);
            keys.push((class, k));
        }
        let mut version = text.clone().into_bytes();
        let digit = usize::try_from(i).unwrap();
        version[14] = b"0123456789abcdefABCDEF"[digit % 22];
        keys.push(("version digit", version));
        let mut variant = text.clone().into_bytes();
        variant[19] = b"0123456789abcdefABCDEF"[(digit / 22) % 22];
        keys.push(("variant digit", variant));
        // A random id and its event's time (`IdempotencyKey::timed`): Postgres reads the time.
        let ms = rng.below(1 << 48);
        let timed = IdempotencyKey::timed(Scope::new("t").unwrap(), ms, event_id(i)).unwrap();
        assert_eq!(timed.uuid7_millis(), Some(ms));
        keys.push(("timed", timed.key_bytes().to_vec()));
        for len in [1, 15, 16, 17, 35, 36, 37] {
            keys.push(("random bytes", (0..len).map(|_| byte(&mut rng)).collect()));
        }
    }
    keys
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn postgres_and_the_engine_read_the_same_time_from_every_key(pool: PgPool) {
    let keys = corpus();
    let bytes: Vec<Vec<u8>> = keys.iter().map(|(_, k)| k.clone()).collect();
    let sql: Vec<Option<i64>> = sqlx::query_scalar(
        "SELECT dedup_uuid7_ms_v1(k) FROM unnest($1::bytea[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
    )
    .bind(&bytes)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(sql.len(), keys.len());
    // Per class: (keys, UUIDv7s among them).
    let mut classes: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for ((class, k), got) in keys.iter().zip(sql) {
        let want = engine(k);
        assert_eq!(got, want, "{class}: key {}", hex(k));
        let c = classes.entry(class).or_default();
        c.0 += 1;
        c.1 += usize::from(want.is_some());
    }
    // Every class holds both answers, except the unchanged keys (all UUIDv7s) and random bytes
    // (almost never one): no class can pass by answering None, or Some, to everything.
    for (class, (n, timed)) in &classes {
        match *class {
            "text" | "upper case" | "mixed case" | "raw" | "timed" => {
                assert_eq!(timed, n, "{class}");
            }
            "random bytes" => assert!(*timed < n / 100, "{class}: {timed} of {n}"),
            _ => assert!(*timed > 0 && timed < n, "{class}: {timed} of {n}"),
        }
    }
    assert_eq!(classes.len(), 12, "{classes:?}");
}

/// A call on a literal is folded when the statement is planned: an arm whose guard is false is
/// never evaluated then (`get_byte` past the end would raise), in either arm.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_literal_key_is_read_when_planned_without_an_error(pool: PgPool) {
    let text = time_ordered_event_id(0x0190_1234_5678, 7);
    let mut v4 = raw(&text);
    v4[6] = 0x4b;
    let mut bad_digit = text.clone().into_bytes();
    bad_digit[35] = b'G';
    let mut cases = vec![
        (Vec::new(), None),
        (b"x".to_vec(), None),
        (vec![0xff; 36], None),
        (text.clone().into_bytes(), Some(0x0190_1234_5678_i64)),
        (raw(&text), Some(0x0190_1234_5678_i64)),
        (v4, None),
        (bad_digit, None),
    ];
    let long = text.repeat(2).into_bytes();
    for len in [15, 17, 35, 37] {
        cases.push((long[..len].to_vec(), None));
    }
    for (k, want) in cases {
        let literal = format!("SELECT dedup_uuid7_ms_v1('\\x{}'::bytea)", hex(&k));
        let got: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(literal))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(got, want, "key {}", hex(&k));
        if !k.is_empty() {
            assert_eq!(engine(&k), want, "key {}", hex(&k));
        }
    }
    let null: Option<i64> = sqlx::query_scalar("SELECT dedup_uuid7_ms_v1(NULL)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(null, None);
}

/// What a partition key needs of the function: labels that let the planner inline it and keep it
/// out of no query (IMMUTABLE, PARALLEL SAFE, no SET, not SECURITY DEFINER), a helper bound when
/// it was made (it answers under an empty `search_path`, as pg_dump and maintenance commands set
/// it, and the helper cannot be dropped from under it), and a plan that holds the expression, not
/// a call.
/// A function's name, volatility, parallel safety, `SECURITY DEFINER` and `SET` settings.
type Labels = (String, String, String, bool, Option<Vec<String>>);

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_key_time_function_is_inlined_immutable_and_bound_to_its_helper(pool: PgPool) {
    let labels: Vec<Labels> = sqlx::query_as(
        "SELECT proname::text, provolatile::text, proparallel::text, prosecdef, proconfig \
         FROM pg_proc WHERE proname IN ('dedup_uuid7_ms_v1', 'dedup_hex_digit_v1') ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(labels.len(), 2, "{labels:?}");
    for (name, volatility, parallel, definer, config) in &labels {
        assert_eq!(
            (volatility.as_str(), parallel.as_str()),
            ("i", "s"),
            "{name}"
        );
        assert!(!definer && config.is_none(), "{name}");
    }

    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET search_path = ''")
        .execute(&mut *conn)
        .await
        .unwrap();
    let schema: String = sqlx::query_scalar(
        "SELECT n.nspname::text FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n \
         ON n.oid = p.pronamespace WHERE p.proname = 'dedup_uuid7_ms_v1'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let key = time_ordered_event_id(0x0190_1234_5678, 3).into_bytes();
    let got: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT \"{schema}\".dedup_uuid7_ms_v1($1)"
    )))
    .bind(&key)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(got, Some(0x0190_1234_5678));
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (VERBOSE, COSTS OFF) SELECT \"{schema}\".dedup_uuid7_ms_v1(k) \
         FROM pg_catalog.unnest($1::pg_catalog.bytea[]) t(k)"
    )))
    .bind(vec![key])
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("get_byte")
            && !plan.contains("dedup_uuid7_ms")
            && !plan.contains("dedup_hex_digit"),
        "{plan}"
    );
    sqlx::query("RESET search_path")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);

    let dropped = sqlx::query("DROP FUNCTION dedup_hex_digit_v1(int4)")
        .execute(&pool)
        .await;
    assert!(
        dropped.is_err_and(|e| e.to_string().contains("depend")),
        "the helper can be dropped from under the function"
    );
}

/// The time the partitioned layout gives a key its day by (`dedup_key_ms_v1`, migration
/// 20261201000001): over the same corpus, never an error, the engine's time for every key that
/// is a UUIDv7, and for the rest either none or some time (a key shaped like one with a bad digit
/// gets one; which one does not matter, only that it is the same every time). Literals of every
/// length are folded at planning without an error, and the call is inlined.
#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn the_partition_time_is_the_engines_for_every_uuid7_and_never_fails(pool: PgPool) {
    let keys = corpus();
    let bytes: Vec<Vec<u8>> = keys.iter().map(|(_, k)| k.clone()).collect();
    let sql: Vec<(Option<i64>, Option<i64>)> = sqlx::query_as(
        "SELECT dedup_key_ms_v1(k), dedup_key_ms_v1(k) FROM unnest($1::bytea[]) \
         WITH ORDINALITY AS t(k, n) ORDER BY n",
    )
    .bind(&bytes)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(sql.len(), keys.len());
    let (mut timed, mut laxer) = (0, 0);
    for ((class, k), (got, again)) in keys.iter().zip(sql) {
        assert_eq!(got, again);
        match engine(k) {
            Some(want) => {
                assert_eq!(got, Some(want), "{class}: key {}", hex(k));
                timed += 1;
            }
            None => laxer += usize::from(got.is_some()),
        }
    }
    assert!(timed > 10_000 && laxer > 0, "{timed} {laxer}");
    for len in [0usize, 1, 15, 16, 17, 35, 36, 37] {
        let literal = format!("'\\x{}'::bytea", "37".repeat(len));
        let _: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT dedup_key_ms_v1({literal})"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
    }
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN (VERBOSE, COSTS OFF) SELECT dedup_key_ms_v1(k) FROM unnest($1::bytea[]) AS t(k)",
    )
    .bind(&bytes[..1])
    .fetch_all(&pool)
    .await
    .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("get_byte") && !plan.contains("dedup_key_ms_v1"),
        "{plan}"
    );
}
