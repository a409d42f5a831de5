//! `dedup dead-letters` and `dedup forget --kept-dead-letters` against the test server
//! (`DATABASE_URL`, started by `scripts/test`): the dead letters a dead-letter topic refused for
//! good, kept in `dedup_dead_letters`, two of them at the same coordinates (a topic made again).

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn dedup() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedup"));
    c.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("KAFKA_BROKERS")
        .env_remove("REDIS_URL")
        .env("DATABASE_URL", env("DATABASE_URL"));
    c
}

/// `psql` on the test server (from `PG_BINDIR`, which `scripts/test` sets, or the PATH).
fn psql(sql: &str) -> String {
    let bin = std::env::var("PG_BINDIR").map_or_else(|_| "psql".into(), |d| format!("{d}/psql"));
    let out = Command::new(bin)
        .arg(env("DATABASE_URL"))
        .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output()
        .unwrap();
    assert!(out.status.success(), "{sql}: {:?}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by scripts/test"))
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `dedup` with `args`: its exit code, standard output and standard error.
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = dedup().args(args).output().unwrap();
    let (stdout, stderr) = text(&out);
    (out.status.code(), stdout, stderr)
}

/// Three kept letters of one group: at `t:0:0` an old topic's (kept by a binary of generation
/// 11: no digest, no key) and the new topic's (key `a`), and at `t:0:1` one kept two days ago
/// (key `b`). `dedup dead-letters` lists each with its id and key, asks which one where two
/// share coordinates, writes out and removes exactly the one named, and purges by age; `dedup
/// forget --kept-dead-letters` forgets the keys the rows name, skips the row without one, and
/// leaves the rows for the re-drive.
#[test]
fn kept_dead_letters_are_named_exactly_forgotten_by_key_and_purged_by_age() {
    let out = dedup().arg("migrate").output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let group = format!("cli-kept-{}", std::process::id());
    let row = |offset: i64, digest: &str, key: &str, payload: &str, age: &str| {
        format!(
            "('{group}', 't', 0, {offset}, '\\x{digest}', {key}, NULL, '{payload}', '{{}}', \
             '{{}}', NULL, 'poison', 1, 't.dlq', 'MessageSizeTooLarge', now() - interval '{age}')"
        )
    };
    let record = |key: &str| {
        format!(
            "('{group}', '{key}', 'failed', NULL, nextval('dedup_token_seq'), NULL, 1, 'bug', \
             now(), now(), now() + interval '30 days')"
        )
    };
    psql(&format!(
        "DELETE FROM dedup_dead_letters WHERE consumer_group = '{group}'; \
         DELETE FROM dedup_records WHERE scope = '{group}'; \
         INSERT INTO dedup_dead_letters (consumer_group, topic, partition, \"offset\", digest, \
         scope, dedup_key, message_key, payload, header_names, header_values, timestamp_ms, \
         reason, attempts, dead_letter_topic, refusal, stored_at) VALUES {}, {}, {}; \
         INSERT INTO dedup_records (scope, key, state, owner, token, lease_until, attempts, \
         failure, created_at, updated_at, expires_at) VALUES {}, {};",
        row(0, "", "NULL, NULL", "old topic", "1 hour"),
        row(
            0,
            &"ab".repeat(32),
            &format!("'{group}', 'a'"),
            "new topic",
            "1 minute"
        ),
        row(
            1,
            &"cd".repeat(32),
            &format!("'{group}', 'b'"),
            "older",
            "2 days"
        ),
        record("a"),
        record("b"),
    ));
    let kept = || {
        psql(&format!(
            "SELECT string_agg(\"offset\" || ':' || convert_from(payload, 'UTF8'), ',' \
             ORDER BY \"offset\", payload) FROM dedup_dead_letters WHERE consumer_group = '{group}'"
        ))
    };

    let (code, stdout, stderr) = run(&["dead-letters", "--group", &group]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("3 dead letter(s)"), "{stdout}");
    assert!(stdout.contains(&"ab".repeat(6)), "the id shown: {stdout}");
    assert!(
        stdout.contains(&format!("{group}/a")),
        "the key shown: {stdout}"
    );
    assert!(stdout.contains("(none)"), "{stdout}");

    // Two at t:0:0: which one must be said.
    let (code, stdout, stderr) = run(&["dead-letters", "--group", &group, "--remove", "t:0:0"]);
    assert_ne!(code, Some(0), "{stdout}");
    assert!(
        stderr.contains("2 kept dead letters at t:0:0")
            && stderr.contains("t:0:0@-")
            && stderr.contains(&format!("t:0:0@{}", "ab".repeat(6))),
        "{stderr}"
    );
    let (code, stdout, stderr) = run(&["dead-letters", "--group", &group, "--payload", "t:0:0@-"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout, "old topic");

    // The keys the rows name are forgotten; the row without one is skipped; the rows stay.
    let (code, stdout, stderr) = run(&["forget", "--kept-dead-letters", &group]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    for line in [
        "read 3 dead letter(s) of group".to_owned(),
        format!("forgotten     {group}/a"),
        format!("forgotten     {group}/b"),
        "skipped       t:0:0: no idempotency key".to_owned(),
        "2 key(s) forgotten".to_owned(),
    ] {
        assert!(stdout.contains(&line), "{line:?} not in {stdout}");
    }
    assert_eq!(
        psql(&format!(
            "SELECT count(*) FROM dedup_records WHERE scope = '{group}'"
        )),
        "0"
    );
    assert_eq!(kept(), "0:new topic,0:old topic,1:older");

    let (code, stdout, stderr) =
        run(&["dead-letters", "--group", &group, "--remove", "t:0:0@ABAB"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(kept(), "0:old topic,1:older");
    // One left there: its coordinates name it.
    let (code, stdout, stderr) = run(&["dead-letters", "--group", &group, "--remove", "t:0:0"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("removed the kept dead letter at t:0:0@-"),
        "{stdout}"
    );
    assert_eq!(kept(), "1:older");

    let (code, stdout, stderr) = run(&[
        "dead-letters",
        "--group",
        &group,
        "--purge-older-than",
        "1d",
    ]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("purged 1 kept dead letter(s)"), "{stdout}");
    assert_eq!(kept(), "");
    let (code, _, stderr) = run(&[
        "dead-letters",
        "--group",
        &group,
        "--purge-older-than",
        "1w",
    ]);
    assert_eq!(code, Some(2), "a unit it does not know: {stderr}");
}
