//! The `dedup` binary end to end: the demo against the embedded Kafka with a real Postgres and
//! Redis (from `DATABASE_URL` / `REDIS_URL`, started by `scripts/test`), its spans decoded from
//! real OTLP requests, the admin commands, and errors for bad configuration.
//!
//! The demo runs in both modes, with an in-test OTLP receiver that decodes the real requests. The
//! admin commands include `dedup parked`, `unpark` and `drop`.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

fn dedup() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedup"));
    c.env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("KAFKA_BROKERS");
    c
}

/// `psql` on the test server (from `PG_BINDIR`, which `scripts/test` sets, or the PATH).
fn psql() -> Command {
    let bin = std::env::var("PG_BINDIR").map_or_else(|_| "psql".into(), |d| format!("{d}/psql"));
    let mut c = Command::new(bin);
    c.arg(env("DATABASE_URL"))
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"]);
    c
}

/// One value from the test server (`psql -t -A`), trimmed.
fn sql_value(query: &str) -> String {
    let out = psql().args(["-t", "-A", "-c", query]).output().unwrap();
    assert!(out.status.success(), "{query}: {:?}", text(&out));
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

/// One exported span: name, trace id, parent span id, string and int attributes.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    attrs: HashMap<String, String>,
}

/// `dedup bench` against the test servers; the caller adds its options.
fn bench() -> Command {
    let mut cmd = dedup();
    cmd.arg("bench")
        .env("DATABASE_URL", env("DATABASE_URL"))
        .env("REDIS_URL", env("REDIS_URL"));
    cmd
}

/// The `--json` report of a bench that succeeded.
fn report(out: &Output) -> serde_json::Value {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

/// An OTLP/HTTP receiver: decodes every `POST /v1/traces` body as an `ExportTraceServiceRequest`.
fn receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let spans = Arc::new(Mutex::new(Vec::new()));
    let sink = spans.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let sink = sink.clone();
            std::thread::spawn(move || serve(conn, &sink));
        }
    });
    (url, spans)
}

fn serve(conn: std::net::TcpStream, sink: &Mutex<Vec<Span>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        assert!(request_line.contains("/v1/traces"), "{request_line}");
        let req = ExportTraceServiceRequest::decode(&body[..]).expect("a real OTLP request");
        let mut got = Vec::new();
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let attrs = s
                        .attributes
                        .iter()
                        .filter_map(|kv| {
                            let v = match kv.value.as_ref()?.value.as_ref()? {
                                Value::StringValue(s) => s.clone(),
                                Value::IntValue(i) => i.to_string(),
                                Value::BoolValue(b) => b.to_string(),
                                other => format!("{other:?}"),
                            };
                            Some((kv.key.clone(), v))
                        })
                        .collect();
                    got.push(Span {
                        name: s.name,
                        trace_id: s.trace_id,
                        span_id: s.span_id,
                        parent: s.parent_span_id,
                        attrs,
                    });
                }
            }
        }
        sink.lock().unwrap().extend(got);
        let _ = writer.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        );
    }
}

#[test]
fn the_demo_books_every_key_once_and_its_spans_reach_an_otlp_receiver() {
    let (endpoint, spans) = receiver();
    // One message at a time, where every delivery has its own span tree.
    let out = dedup()
        .args([
            "demo",
            "--events",
            "400",
            "--partitions",
            "4",
            "--mode",
            "per-message",
            "--instance-id",
            "demo-node-1",
            "--quiet",
        ])
        .env("DATABASE_URL", env("DATABASE_URL"))
        .env("REDIS_URL", env("REDIS_URL"))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        // Room for every span of the run, however fast it makes them: the batch processor drops
        // spans past its queue (2,048 by default), and this run makes about 2,000.
        .env("OTEL_BSP_MAX_QUEUE_SIZE", "65536")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ledger check           OK"), "{stdout}");
    assert!(
        stdout.contains("instance               demo-node-1   (static group member; earlier runs' leases adopted at start)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("unique keys                   280"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ledger rows                   280"),
        "{stdout}"
    );

    // The provider was shut down at exit, so every batch has arrived.
    let spans = spans.lock().unwrap().clone();
    let named = |n: &str| spans.iter().filter(|s| s.name == n).collect::<Vec<_>>();
    let messages = named("dedup.kafka.message");
    let decisions = named("dedup.decision");
    let produced = named("dedup.demo.produce");
    assert_eq!(messages.len(), 400, "one span per delivery");
    assert_eq!(produced.len(), 400);
    assert!(!named("dedup.process").is_empty());
    for m in &messages {
        assert_eq!(m.attrs["messaging.system"], "kafka");
        assert!(m.attrs.contains_key("messaging.kafka.offset"));
        assert!(m.attrs.contains_key("outcome"), "{m:?}");
    }
    let tiers: std::collections::BTreeSet<&str> =
        decisions.iter().map(|d| d.attrs["tier"].as_str()).collect();
    // The demo batches its claims: a decision is answered from L1, or by a batch whose own
    // span says which tiers it asked.
    assert!(tiers.contains("batched"), "{tiers:?}");
    assert!(tiers.contains("l1"), "{tiers:?}");
    let batches = named("dedup.claim_batch");
    assert!(!batches.is_empty());
    assert!(
        batches
            .iter()
            .any(|b| b.attrs.get("authority_asked").is_some_and(|n| n != "0")),
        "{batches:?}"
    );
    assert!(decisions.iter().any(|d| d.attrs["outcome"] == "acquired"));
    assert!(decisions.iter().any(|d| d.attrs["outcome"] == "completed"));
    // The consumer's spans join the producer's traces through the traceparent header.
    let produce_ids: HashMap<&[u8], &[u8]> = produced
        .iter()
        .map(|p| (p.span_id.as_slice(), p.trace_id.as_slice()))
        .collect();
    for m in &messages {
        let trace = produce_ids
            .get(m.parent.as_slice())
            .expect("a message span's parent is a produce span");
        assert_eq!(*trace, m.trace_id.as_slice());
    }
    // Decisions are children of their message's dedup.process span: in the same traces.
    let traces: std::collections::HashSet<&[u8]> =
        messages.iter().map(|m| m.trace_id.as_slice()).collect();
    assert!(
        decisions
            .iter()
            .all(|d| traces.contains(d.trace_id.as_slice()))
    );
}

/// The default demo: transaction mode by the batch. Every key once, a few hundred events per
/// batch transaction, and one `dedup.kafka.batch` span per batch.
#[test]
fn the_demo_in_transaction_mode_books_every_key_once_in_batches() {
    let (endpoint, spans) = receiver();
    let out = dedup()
        .args(["demo", "--events", "3000", "--partitions", "4", "--quiet"])
        .env("DATABASE_URL", env("DATABASE_URL"))
        .env("REDIS_URL", env("REDIS_URL"))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("ledger check           OK"), "{stdout}");
    assert!(stdout.contains("transaction mode"), "{stdout}");
    let batches: u64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("batch transactions"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no batch count in {stdout}"));
    assert!(
        (1..=300).contains(&batches),
        "{batches} batch transactions for 3,000 events: {stdout}"
    );
    let spans = spans.lock().unwrap().clone();
    let batch_spans: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "dedup.kafka.batch")
        .collect();
    assert!(
        batch_spans.len() as u64 >= batches,
        "a span per batch: {} spans",
        batch_spans.len()
    );
    assert!(batch_spans.iter().all(|s| s.attrs.contains_key("size")));
}

#[test]
fn migrate_inspect_and_purge_work_on_a_demo_run() {
    let db = env("DATABASE_URL");
    let redis = env("REDIS_URL");
    let out = dedup()
        .args(["migrate", "--database-url", &db])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(text(&out).0.contains("migrations applied"));

    let out = dedup()
        .args(["demo", "--events", "50", "--quiet"])
        .env("DATABASE_URL", &db)
        .env("REDIS_URL", &redis)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let run = stdout
        .split_whitespace()
        .find(|w| w.starts_with("demo-"))
        .expect("the demo names its run")
        .to_owned();

    let out = dedup()
        .args(["inspect", &run, "order-1", "--redis-prefix", &run])
        .env("DATABASE_URL", &db)
        .env("REDIS_URL", &redis)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("L2 (Redis): Completed"), "{stdout}");
    assert!(stdout.contains("L3 (Postgres): Completed"), "{stdout}");
    assert!(!stdout.contains("past its retention"), "{stdout}");
    assert!(stdout.contains("key time: none (not a UUIDv7"), "{stdout}");

    // `dedup inspect` with Postgres only.
    let inspect = |args: &[&str]| {
        dedup()
            .args(args)
            .env("DATABASE_URL", &db)
            .env_remove("REDIS_URL")
            .output()
            .unwrap()
    };
    let out = inspect(&["inspect", &run, "no-such-key"]);
    let (stdout, _) = text(&out);
    assert!(stdout.contains("L3 (Postgres): no record"), "{stdout}");
    assert!(stdout.contains("not asked"), "{stdout}");

    // A UUIDv7 key is shown with the time it was made (its first 48 bits, in milliseconds).
    let out = inspect(&["inspect", &run, "01901234-5678-7abc-9def-0123456789ab"]);
    let (stdout, _) = text(&out);
    let made = format!(
        "key time: parses as a UUIDv7 made at {} ms after the Unix epoch",
        0x0190_1234_5678_i64
    );
    assert!(stdout.contains(&made), "{stdout}");

    // An event id and its time (`--event-time`, in milliseconds or RFC 3339 as the Kafka
    // runners read it; `--event-ms` is its alias): the key `IdempotencyKey::timed` makes of
    // them, shown with that time.
    for (flag, time) in [
        ("--event-ms", "1795000000123"),
        ("--event-time", "2026-11-18T11:06:40.123Z"),
        ("--event-time", "2026-11-18T12:06:40.1239+01:00"),
    ] {
        let out = inspect(&[
            "inspect",
            &run,
            "3f2b8c1e-9d4a-4e6f-b1c2-7a8d9e0f1a2b",
            flag,
            time,
        ]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("key: {run}/01a1ee56-5e7b-7a0a-91d3-e350d97d4ac8")),
            "{time}: {stdout}"
        );
        assert!(
            stdout.contains("key time: parses as a UUIDv7 made at 1795000000123 ms"),
            "{stdout}"
        );
    }
    let out = inspect(&["inspect", &run, "id", "--event-time", "18 Nov 2026"]);
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("nor an RFC 3339 timestamp"),
        "{:?}",
        text(&out)
    );
    let out = inspect(&["inspect", &run, "id", "--event-ms", "281474976710656"]);
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("past the year 10889"),
        "{:?}",
        text(&out)
    );

    let out = dedup()
        .args(["purge", "--batch", "100"])
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(text(&out).0.contains("purged "), "{:?}", text(&out));
}

#[test]
fn parked_keys_are_listed_released_and_dropped() {
    let db = env("DATABASE_URL");
    let out = dedup()
        .args(["migrate", "--database-url", &db])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let group = format!("cli-parked-{}", std::process::id());
    let insert = format!(
        "INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key, \
         ordering_key, header_names, header_values, error, attempts, parked_at, due_at) VALUES \
         ('{group}', 'orders', 0, 5, true, 'acct-1', '{{}}', '{{}}', 'payments down', 4, \
          now() - interval '5 minutes', now() + interval '1 hour'), \
         ('{group}', 'orders', 0, 9, true, 'acct-1', '{{}}', '{{}}', 'behind', 0, now(), now())"
    );
    let out = psql().args(["-c", &insert]).output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let run = |args: &[&str]| {
        let out = dedup()
            .args(args)
            .env("DATABASE_URL", &db)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        (out.status.code(), stdout, stderr)
    };

    let (code, stdout, stderr) = run(&["parked", "--group", &group]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("1 parked key(s), 2 message(s)"), "{stdout}");
    let row = stdout.lines().find(|l| l.contains("acct-1")).unwrap();
    for part in [
        "orders",
        " 2 ",
        "5m",
        " ago",
        " 4 ",
        "in 59m",
        "payments down",
    ] {
        assert!(row.contains(part), "{part:?} not in {row:?}");
    }

    let (code, stdout, _) = run(&["unpark", "--group", &group, "acct-1"]);
    assert_eq!(code, Some(0));
    assert!(
        stdout.contains("its head is due now (2 message(s)"),
        "{stdout}"
    );
    let (_, stdout, _) = run(&["parked", "--group", &group]);
    assert!(!stdout.contains("in 59m"), "{stdout}");

    let (code, stdout, _) = run(&["drop", "--group", &group, "acct-1"]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("2 message(s) marked"), "{stdout}");
    let (_, stdout, _) = run(&["parked", "--group", &group]);
    assert!(stdout.contains("dropping"), "{stdout}");

    let (code, _, stderr) = run(&["unpark", "--group", &group, "nobody"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("nothing is parked under nobody"),
        "{stderr}"
    );
    let (code, stdout, _) = run(&["parked", "--group", "no-such-group"]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("no parked keys"), "{stdout}");
}

/// Arguments, environment, and what stderr must say.
type Case<'a> = (&'a [&'a str], Vec<(&'a str, String)>, &'a [&'a str]);

#[test]
fn bad_configuration_is_named_and_passwords_are_not_printed() {
    let redis = env("REDIS_URL");
    let db = env("DATABASE_URL");
    let cases: [Case<'_>; 6] = [
        (
            &["migrate"],
            vec![(
                "DATABASE_URL",
                "postgres://app:s3cret@127.0.0.1:1/x".to_owned(),
            )],
            &["DATABASE_URL", "127.0.0.1:1", "Is it running?"],
        ),
        (
            &["migrate"],
            vec![("DATABASE_URL", "mysql://app:s3cret@host/x".to_owned())],
            &[
                "DATABASE_URL",
                "is not valid: it must start with postgres://",
            ],
        ),
        (
            &["demo", "--events", "10", "--quiet"],
            vec![
                ("DATABASE_URL", db.clone()),
                ("REDIS_URL", "http://app:s3cret@127.0.0.1:1".to_owned()),
            ],
            &["REDIS_URL", "redis://"],
        ),
        (
            &["demo", "--events", "10", "--quiet"],
            vec![
                ("DATABASE_URL", db.clone()),
                ("REDIS_URL", "redis://app:s3cret@127.0.0.1:1".to_owned()),
            ],
            &["cannot connect to Redis", "REDIS_URL", "127.0.0.1:1"],
        ),
        (
            &["demo", "--events", "10", "--quiet"],
            vec![
                ("DATABASE_URL", db.clone()),
                ("REDIS_URL", redis.clone()),
                ("KAFKA_BROKERS", "127.0.0.1:1".to_owned()),
            ],
            &["cannot reach Kafka", "KAFKA_BROKERS", "127.0.0.1:1"],
        ),
        (
            &[
                "demo",
                "--events",
                "10",
                "--quiet",
                "--instance-id",
                "node 1/x",
            ],
            vec![("DATABASE_URL", db.clone()), ("REDIS_URL", redis.clone())],
            &["--instance-id"],
        ),
    ];
    for (args, envs, expect) in cases {
        let mut c = dedup();
        c.args(args)
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL");
        for (k, v) in &envs {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}\n{stderr}");
        for e in expect {
            assert!(stderr.contains(e), "{args:?}: {e:?} not in {stderr}");
        }
        assert!(
            !stderr.contains("s3cret"),
            "a password was printed: {stderr}"
        );
    }
    // Missing configuration: clap names the flag and its variable.
    let out = dedup()
        .args(["migrate"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).1.contains("--database-url"), "{:?}", text(&out));
}

#[test]
fn sigterm_drains_commits_and_exits() {
    let mut child = dedup()
        .args(["demo", "--events", "100000", "--quiet"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.starts_with("dedup demo:"), "{first}");
    // The run must still be going when the signal comes, on a machine of any speed: a session of
    // ours locks the ledger (the demo created it before its first line), so handlers wait on it;
    // the signal is sent once one does, and the lock is let go after it.
    let mut locker = psql()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut hold = locker.stdin.take().unwrap();
    writeln!(hold, "BEGIN; LOCK TABLE dedup_demo_ledger IN SHARE MODE;").unwrap();
    hold.flush().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let waiting = psql()
            .args([
                "-tAc",
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                 WHERE c.relname = 'dedup_demo_ledger' AND NOT l.granted",
            ])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&waiting.stdout).trim() != "0" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no handler ever waited on the ledger lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    writeln!(hold, "ROLLBACK;").unwrap();
    drop(hold);
    assert!(locker.wait().unwrap().success());
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(rest.contains("interrupted: "), "{rest}");
    assert!(rest.contains("offsets committed"), "{rest}");
    // What was settled was committed: some commits went out, none failed.
    assert!(rest.contains("(failed 0)"), "{rest}");
}

/// A running `dedup purge --every`: its stdout lines, as they come.
struct Purger {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Purger {
    fn start(url: &str) -> Self {
        let mut child = dedup()
            .args(["purge", "--every", "0.1", "--batch", "500"])
            .env("DATABASE_URL", url)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (up to 60 s) for a line that starts with `prefix`.
    fn wait_for(&mut self, prefix: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.starts_with(prefix);
                    self.seen.push(line);
                    if hit {
                        return;
                    }
                }
                Err(_) => panic!("no line {prefix:?} within 60 s; saw {:?}", self.seen),
            }
        }
    }

    /// Every line printed so far.
    fn printed(&mut self) -> &[String] {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A database of its own on the test server, dropped when this drops: `dedup purge` deletes
/// every expired record of its database, so a test of it must not share one with the others.
struct OwnDb {
    name: String,
    url: String,
}

impl OwnDb {
    fn new(name: &str) -> Self {
        let base = env("DATABASE_URL");
        let (server, rest) = base
            .rsplit_once('/')
            .expect("DATABASE_URL names a database");
        let query = rest
            .split_once('?')
            .map_or(String::new(), |(_, q)| format!("?{q}"));
        sql_value(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
        sql_value(&format!("CREATE DATABASE {name}"));
        Self {
            name: name.to_owned(),
            url: format!("{server}/{name}{query}"),
        }
    }

    /// One value from this database (`psql -t -A`), trimmed.
    fn value(&self, query: &str) -> String {
        let bin =
            std::env::var("PG_BINDIR").map_or_else(|_| "psql".into(), |d| format!("{d}/psql"));
        let out = Command::new(bin)
            .arg(&self.url)
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-t", "-A", "-c", query])
            .output()
            .unwrap();
        assert!(out.status.success(), "{query}: {:?}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `n` completed records of `scope`, past their retention since a second ago.
    fn insert_expired(&self, scope: &str, n: u32) {
        self.value(&format!(
            "INSERT INTO dedup_records (scope, key, state, token, attempts, result, created_at, \
             updated_at, expires_at) SELECT '{scope}', int8send(g), 'completed', \
             nextval('dedup_token_seq'), 1, '\\x00', now(), now(), now() - interval '1 second' \
             FROM generate_series(1, {n}) g"
        ));
    }

    /// Waits (up to 60 s) until the database holds no record.
    fn until_purged(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while self.value("SELECT count(*) FROM dedup_records") != "0" {
            assert!(
                std::time::Instant::now() < deadline,
                "the expired records were not purged within 60 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

impl Drop for OwnDb {
    fn drop(&mut self) {
        let _ = psql()
            .args([
                "-c",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
            ])
            .output();
    }
}

/// `dedup purge --every`, run twice beside each other: one purges and the other stands by; the
/// one that purges is killed (SIGKILL: its session, and with it the retention lock, ends without
/// a word), and the other takes over and purges what expires next. SIGTERM stops it cleanly.
#[test]
fn purge_every_runs_in_one_instance_at_a_time_and_another_takes_over_after_sigkill() {
    let db = OwnDb::new(&format!("dedup_purge_every_{}", std::process::id()));
    let out = dedup()
        .args(["migrate"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    // `dedup inspect` says what an expired record is before the purge takes it.
    db.value(
        "INSERT INTO dedup_records (scope, key, state, token, attempts, result, created_at, \
         updated_at, expires_at) VALUES ('a', convert_to('gone', 'UTF8'), 'completed', \
         nextval('dedup_token_seq'), 1, '\\x00', now(), now(), now() - interval '1 second')",
    );
    let out = dedup()
        .args(["inspect", "a", "gone"])
        .env("DATABASE_URL", &db.url)
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("L3 (Postgres): Completed"), "{stdout}");
    assert!(
        stdout.contains("past its retention: it counts as absent"),
        "{stdout}"
    );
    let mut first = Purger::start(&db.url);
    first.wait_for("leading");
    let mut second = Purger::start(&db.url);
    second.wait_for("standing by");

    db.insert_expired("a", 1200);
    db.until_purged();
    first.wait_for("purged ");
    assert!(
        !second.printed().iter().any(|l| l.starts_with("purged")),
        "the instance standing by purged too: {:?}",
        second.printed()
    );

    first.child.kill().unwrap(); // SIGKILL
    first.child.wait().unwrap();
    second.wait_for("leading");
    db.insert_expired("b", 700);
    db.until_purged();
    second.wait_for("purged ");

    let pid = second.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = second.child.wait().unwrap();
    assert!(status.success(), "{status:?}: {:?}", second.printed());
    second.wait_for("stopped: ");
    let last = second.printed().last().unwrap().clone();
    let purged: u64 = last
        .split(", ")
        .nth(1)
        .and_then(|p| p.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{last}"));
    assert_eq!(purged, 700, "{last}");
}

/// The runners' contenders produce their stream into librdkafka's mock cluster, which keeps only
/// 5 MiB of batches per partition and silently drops the oldest beyond it: a stream it cut is
/// refused at once, naming the way out, instead of waiting for events that are gone (it stalled
/// at half the events, 120 s, before).
#[test]
fn the_bench_refuses_a_stream_the_mock_cluster_cut() {
    let out = bench()
        .args([
            "--only",
            "ek",
            "--events",
            "400000",
            "--tx-workers",
            "1",
            "--keys",
            "uuid",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("keeps 5 MiB per partition and dropped the first")
            && stderr.contains("run fewer --events, more --tx-workers"),
        "{stderr}"
    );
    assert!(!stderr.contains("no progress"), "{stderr}");
}

/// `dedup bench` in a quick mode (so that it cannot rot): every contender of both workloads runs
/// the same stream, and the ceiling is measured;
/// each runs every unique key's effect exactly once, and the JSON carries what the table shows.
#[test]
fn the_bench_runs_every_contender_on_the_same_stream() {
    // Spawned, not `output()`: its process id names its run's scopes (`bench-<tag>-<pid>-<secs>`).
    let child = bench()
        .args([
            "--events",
            "600",
            "--concurrency",
            "8",
            "--paced-share",
            "0.5",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let report = report(&out);
    let stderr = text(&out).1;
    assert_eq!(report["events"], 600);
    assert_eq!(report["unique_keys"], 420);
    assert_eq!(report["keys"], "uuid", "random event ids by default");
    assert_eq!(report["concurrency"], 8);
    assert_eq!(report["synchronous_commit"], "on");
    let contenders = report["contenders"].as_array().unwrap();
    let names: Vec<&str> = contenders
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(a')", "(b')", "(e')", "(ek)", "(fk)",
            "(g)", "(hn)", "(h0)", "(h0x)", "(h1)", "(h2)", "(h2l)", "(h3)", "(h3r)"
        ]
    );
    // (g): every unique key's message published through the outbox, the relay alone and the
    // paced lag measured beside it.
    let g = &contenders[11]["outbox"];
    assert_eq!(g["prefilled"], 420, "{report}");
    assert!(g["relay_alone_per_s"].as_f64().unwrap() > 0.0, "{report}");
    assert!(g["lag_p99_ms"].as_i64().unwrap() >= g["lag_p50_ms"].as_i64().unwrap());
    for c in contenders {
        assert_eq!(c["effects"], c["expected_effects"], "{c}");
        assert_eq!(c["errors"], 0, "{c}");
        assert!(c["events_per_s"].as_f64().unwrap() > 0.0, "{c}");
        if c["name"] == "(ek)" || c["name"] == "(fk)" {
            // The runners through Kafka are timed whole, not per event.
            assert!(c["p50_ms"].is_null(), "{c}");
            continue;
        }
        assert!(c["p99_ms"].as_f64().unwrap() >= c["p50_ms"].as_f64().unwrap());
    }
    assert_eq!(contenders[1]["durable"], false);
    assert_eq!(contenders[7]["durable"], false);
    // dedup's duplicates never reach Postgres when L1 holds them: fewer trips than (a).
    let trips = |i: usize| {
        contenders[i]["pg_round_trips_per_unique_key"]
            .as_f64()
            .unwrap()
    };
    assert!(trips(3) < trips(2) && trips(2) < trips(0), "{report}");
    assert!(contenders[3]["batches"]["claims"].as_u64().unwrap() > 0);
    assert!(report["ratios"]["d_over_a"].as_f64().unwrap() > 0.0);
    for ratio in [
        "d/a",
        "d/b",
        "f/a",
        "f/b",
        "e'/a'",
        "e'/b'",
        "ek/e",
        "fk/f",
        "g/e",
        "ceiling_share",
    ] {
        assert!(
            report["ratios"][ratio].as_f64().unwrap() > 0.0,
            "{ratio}: {report}"
        );
    }
    assert!(report["ceiling_rows_per_s"].as_f64().unwrap() > 0.0);
    assert!(report["claim_rows_per_s"].as_f64().unwrap() > 0.0);
    assert!(report["claim_cost_over_insert"].as_f64().unwrap() > 0.0);
    // Transaction mode by the batch: a handful of statements per batch, not per message.
    assert!(trips(4) < trips(0) && trips(8) < trips(6), "{report}");
    // Lease mode by the batch: a claim, a completion and the odd heartbeat per batch.
    assert!(trips(5) < trips(0), "{report}");
    // The runners batch as their contenders do: fewer trips than (a) too.
    assert!(trips(9) < trips(0) && trips(10) < trips(0), "{report}");
    // The server's own count (pg_stat_statements, which scripts/services.sh preloads) agrees:
    // at least what each contender counted (other tests may share the database meanwhile), and the
    // ledger contenders' handlers wrote one statement per key, or a few per batch for (e').
    let server = |i: usize| &contenders[i]["server_statements_per_unique_key"];
    for i in [0, 2, 3, 4, 5, 6, 8] {
        let engine = server(i)["engine"].as_f64().unwrap_or_else(|| {
            panic!("no server counts: restart Postgres so that it preloads pg_stat_statements (stop_postgres; ensure_postgres): {report}")
        });
        let handler = server(i)["handler"].as_f64().unwrap();
        // (a')'s own count takes in its ledger row; the server's puts it apart. A count across
        // an eviction (a reused server whose pg_stat_statements is full) is short: it says so.
        if server(i)["complete"].as_bool().unwrap() {
            assert!(engine + handler >= trips(i) - 0.01, "{i}: {report}");
        }
    }
    assert!(server(6)["handler"].as_f64().unwrap() >= 1.0, "{report}");
    assert!(server(7)["handler"].as_f64().unwrap() >= 1.0, "{report}");
    assert!(server(8)["handler"].as_f64().unwrap() < 0.5, "{report}");

    // The HTTP contenders: every request answered, each effect once where the route is
    // idempotent, none for retries; the server counted what each request cost.
    let http = |name: &str| {
        contenders
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("{name}: {report}"))
    };
    for (name, effects) in [
        ("(hn)", 600),
        ("(h0)", 600),
        ("(h0x)", 420),
        ("(h1)", 420),
        ("(h2)", 420),
        ("(h2l)", 420),
        ("(h3)", 0),
        ("(h3r)", 0),
    ] {
        let c = http(name);
        assert_eq!(c["expected_effects"], effects, "{c}");
        let h = &c["http"];
        let answered = ["fresh", "replayed", "conflicts"]
            .iter()
            .map(|k| h[k].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(answered, 600, "every request answered once: {c}");
        assert!(c["p99_ms"].as_f64().unwrap() >= c["p50_ms"].as_f64().unwrap());
        let cpu = &h["cpu_ms_per_1k_requests"];
        assert!(cpu["server"].as_f64().unwrap() > 0.0, "{c}");
        // The paced pass: at half the rate it reached, every request answered ((h3)'s retries
        // have none).
        let paced = &h["paced"];
        if name.starts_with("(h3") {
            assert!(paced.is_null(), "{c}");
            continue;
        }
        let asked = paced["asked_per_s"].as_f64().unwrap();
        let rate = c["events_per_s"].as_f64().unwrap();
        assert!((asked - rate / 2.0).abs() < 1.0, "{c}");
        assert_eq!(paced["errors"], 0, "{c}");
        assert!(paced["p99_ms"].as_f64().unwrap() >= paced["p50_ms"].as_f64().unwrap());
    }
    assert_eq!(http("(h0x)")["http"]["conflicts"], 180, "{report}");
    assert_eq!(http("(h0x)")["http"]["fresh"], 420, "{report}");
    for name in ["(h1)", "(h2)", "(h2l)"] {
        assert_eq!(http(name)["http"]["fresh"], 420, "{name}: {report}");
    }
    for name in ["(h3)", "(h3r)"] {
        assert_eq!(http(name)["http"]["replayed"], 600, "{name}: {report}");
    }
    // The routes that write: at least one statement and one writing transaction per effect (the
    // server's counts take in other tests' work meanwhile: lower bounds only).
    let per = |name: &str, what: &str| http(name)["http"][what].as_f64().unwrap();
    assert!(per("(h0)", "statements_per_request") >= 1.0, "{report}");
    assert!(per("(h0)", "commits_per_request") >= 1.0, "{report}");
    assert!(per("(h2)", "commits_per_request") >= 0.7, "{report}");
    for ratio in ["h2/h0", "h2/h0x", "h2/h2l", "h1/h0", "h3/h0", "h3r/h0"] {
        assert!(
            report["ratios"][ratio].as_f64().unwrap() > 0.0,
            "{ratio}: {report}"
        );
    }

    // The run deleted its records, (f)'s `bench-f-` scope included, and said so.
    assert!(stderr.contains("[bench] cleaned up: deleted"), "{stderr}");
    assert!(!stderr.contains("cleanup incomplete"), "{stderr}");
    for pattern in [format!("bench-f-{pid}-%"), format!("bench-%-{pid}-%")] {
        let left = sql_value(&format!(
            "SELECT count(*) FROM dedup_records WHERE scope LIKE '{pattern}'"
        ));
        assert_eq!(left, "0", "{pattern}: rows left behind");
    }

    // A bad argument is a configuration error (exit 2), named.
    let bad = dedup()
        .args(["bench", "--duplicates", "1.5"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad).1.contains("--duplicates"), "{}", text(&bad).1);
}

/// `dedup bench --repeat N` runs every contender N times, each run in a key space of its own:
/// every run books each unique key once; the report holds each contender's median run with the
/// min-max of its runs, the ratios are ratios of medians, the JSON carries every run, and every
/// run's rows are deleted after.
#[test]
fn the_bench_repeats_its_contenders_and_reports_medians() {
    let child = bench()
        .args([
            "--events",
            "300",
            "--concurrency",
            "8",
            "--only",
            "a,d,ceiling",
            "--repeat",
            "3",
            "--keys",
            "sequential",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let report = report(&out);
    let stderr = text(&out).1;
    let unique = report["unique_keys"].as_u64().unwrap();
    assert_eq!(report["repeat"], 3);
    assert_eq!(report["keys"], "sequential");
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    let mut ids = Vec::new();
    for run in runs {
        ids.push(run["run_id"].as_str().unwrap().to_owned());
        let names: Vec<&str> = run["contenders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["(a)", "(d)"], "{run}");
        for c in run["contenders"].as_array().unwrap() {
            // A key space of its own: no run finds an earlier run's keys done.
            assert_eq!(c["effects"].as_u64(), Some(unique), "{c}");
            // What the processors did meanwhile, from /proc.
            let busy = c["cpu"]["machine_busy"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&busy), "{c}");
            assert!(c["cpu"]["bench_process_ms_per_1k_events"].as_f64().unwrap() >= 0.0);
        }
        assert!(run["ceiling_rows_per_s"].as_f64().unwrap() > 0.0);
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{ids:?}");
    let median_of = |name: &str| {
        let c = report["contenders"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let mut rates: Vec<f64> = c["runs_events_per_s"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_f64().unwrap())
            .collect();
        assert_eq!(rates.len(), 3);
        let median = c["events_per_s"].as_f64().unwrap();
        let (min, max) = (
            c["min_events_per_s"].as_f64().unwrap(),
            c["max_events_per_s"].as_f64().unwrap(),
        );
        rates.sort_by(f64::total_cmp);
        assert_eq!((min, median, max), (rates[0], rates[1], rates[2]), "{c}");
        median
    };
    let ratio = report["ratios"]["d/a"].as_f64().unwrap();
    assert!((ratio - median_of("(d)") / median_of("(a)")).abs() < 1e-9);
    for pattern in [format!("bench-%-{pid}-%"), format!("%-{pid}-%-r_")] {
        let left = sql_value(&format!(
            "SELECT count(*) FROM dedup_records WHERE scope LIKE '{pattern}'"
        ));
        assert_eq!(left, "0", "{pattern}: rows left behind");
    }
    assert_eq!(
        stderr.matches("[bench] cleaned up: deleted").count(),
        3,
        "{stderr}"
    );

    // The table says how many runs, with the spread beside each median.
    let table = bench()
        .args([
            "--events",
            "200",
            "--concurrency",
            "4",
            "--only",
            "a,d",
            "--repeat",
            "2",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&table);
    assert!(table.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("2 runs of every contender"), "{stdout}");
    assert!(stdout.contains("min-max events/s"), "{stdout}");
    assert!(stdout.contains("run by run"), "{stdout}");
}

/// `dedup bench --prefill N --expired M --purge-during`: the window's scopes are topped up to N
/// records (kept from one bench to the next) with M more past their retention; each contender
/// that keeps records runs on an empty window, over the window, and over it with the retention
/// running, each run booking every unique key once; the report says what the window takes on
/// disk per record, the WAL per key, and what the retention removed.
#[test]
fn the_bench_fills_a_window_and_runs_beside_the_retention() {
    // Records that expired before the bench began: its fill's expired ones, and any another
    // bench left. Its retention (or another test's `dedup purge`) must leave none of them.
    let began = sql_value("SELECT statement_timestamp()::text");
    let out = bench()
        .args([
            "--events",
            "300",
            "--concurrency",
            "8",
            "--only",
            "a,e,f",
            "--prefill",
            "3000",
            "--expired",
            "400",
            "--purge-during",
            "--purge-batch",
            "100",
            "--json",
        ])
        .output()
        .unwrap();
    let report = report(&out);
    let unique = report["unique_keys"].as_u64().unwrap();
    let w = &report["window"];
    // Topped up: whatever an earlier bench left in the window's scopes counts.
    let (found, live) = (
        w["found"].as_u64().unwrap(),
        w["inserted_live"].as_u64().unwrap(),
    );
    assert!(found + live >= 3000, "{w}");
    let per = w["size"]["bytes_per_record"].as_f64().unwrap();
    assert!(per > 100.0, "{w}");
    assert!(w["size"]["records"].as_u64().unwrap() >= 3000, "{w}");
    let indexes: Vec<&str> = w["size"]["indexes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert!(indexes.contains(&"dedup_records_pkey"), "{w}");
    // (a) keeps no records: it runs on the empty window alone.
    for pass in ["over_window", "over_window_purging"] {
        let names: Vec<&str> = w[pass]["contenders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["(e)", "(f)"], "{pass}: {w}");
        for c in w[pass]["contenders"].as_array().unwrap() {
            assert_eq!(c["effects"].as_u64(), Some(unique), "{pass}: {c}");
            assert!(c["wal_bytes_per_unique_key"].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    let empty: Vec<&serde_json::Value> = report["contenders"].as_array().unwrap().iter().collect();
    assert_eq!(empty.len(), 3);
    for c in empty.iter().filter(|c| c["name"] != "(a)") {
        // A record of its own, as the heap holds it.
        assert!(c["row_bytes"].as_f64().unwrap() > 50.0, "{c}");
    }
    // Topped up to 400 past their retention (found or inserted), all in the window's scopes.
    let expired = w["found_expired"].as_u64().unwrap() + w["inserted_expired"].as_u64().unwrap();
    assert!(expired >= 400, "{w}");
    let retention = &w["retention_runs"][0];
    assert!(retention["error"].is_null(), "{retention}");
    assert!(
        retention["vacuum_after_s"].as_f64().is_some(),
        "{retention}"
    );
    // The retention ran until a statement found less than a full batch: every record that had
    // expired when the bench began is gone (another test's `dedup purge` may have taken some).
    let left = sql_value(&format!(
        "SELECT count(*) FROM dedup_records WHERE scope IN ('bench-e-window', 'bench-f-window') \
         AND expires_at <= '{began}'::timestamptz"
    ));
    assert_eq!(left, "0");

    // A window needs random or time-ordered keys and a contender that keeps records.
    let refused = dedup()
        .args(["bench", "--only", "a,b", "--prefill", "10"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        text(&refused).1.contains("--prefill"),
        "{:?}",
        text(&refused)
    );
}

/// `--keys uuidv7`: a window of its own (`bench-<tag>-window-v7`) of time-ordered keys, each
/// key's first 48 bits its record's creation in milliseconds (the fill's order is `slice`'s unit
/// test's); the runs over it make time-ordered keys too, later than every key of the window.
#[test]
fn the_bench_fills_a_time_ordered_window_with_time_ordered_keys() {
    let began = sql_value("SELECT statement_timestamp()::text");
    let out = bench()
        .args([
            "--events",
            "300",
            "--concurrency",
            "8",
            "--only",
            "e,f",
            "--keys",
            "uuidv7",
            "--prefill",
            "2000",
            "--json",
        ])
        .output()
        .unwrap();
    let report = report(&out);
    assert_eq!(report["keys"], "uuidv7", "{report}");
    let unique = report["unique_keys"].as_u64().unwrap();
    let w = &report["window"];
    for c in w["over_window"]["contenders"].as_array().unwrap() {
        assert_eq!(c["effects"].as_u64(), Some(unique), "{c}");
    }
    // Topped up: whatever an earlier bench left in the window's scopes counts.
    let (found, live) = (
        w["found"].as_u64().unwrap(),
        w["inserted_live"].as_u64().unwrap(),
    );
    assert!(found + live >= 2000, "{w}");
    let scopes = "('bench-e-window-v7', 'bench-f-window-v7')";
    // The fill's records: their result is the first 16 bytes of the digest of their key and a
    // zero byte (a completed record keeps no owner to tell them by).
    let fill = "substring(sha256(key || '\\x00'::bytea) FROM 1 FOR 16)";
    // Every key is version 7, and its time is its record's creation (the fill's) or later (a
    // run's: made when the run began, a millisecond more every 32 events).
    let off = sql_value(&format!(
        "SELECT count(*) FROM dedup_records WHERE scope IN {scopes} AND \
         (substr(convert_from(key, 'UTF8'), 15, 1) <> '7' OR \
          ('x' || lpad(replace(substr(convert_from(key, 'UTF8'), 1, 13), '-', ''), 16, '0'))::bit(64)::int8 \
            <> floor(extract(epoch FROM created_at) * 1000)::int8 AND result = {fill})"
    ));
    assert_eq!(off, "0");
    // This bench's runs' keys sort after every key a fill made.
    let (ran, before) = (
        sql_value(&format!(
            "SELECT count(*) FROM dedup_records WHERE scope IN {scopes} \
             AND result <> {fill} AND created_at >= '{began}'::timestamptz"
        )),
        sql_value(&format!(
            "SELECT count(*) FROM dedup_records r WHERE r.scope IN {scopes} \
             AND r.result <> {fill_r} AND r.created_at >= '{began}'::timestamptz \
             AND r.key <= (SELECT k.key FROM dedup_records k WHERE k.scope = r.scope \
                           AND k.result = {fill_k} ORDER BY k.key DESC LIMIT 1)",
            fill_r = fill.replace("key", "r.key"),
            fill_k = fill.replace("key", "k.key"),
        )),
    );
    assert_eq!(
        ran.parse::<u64>().unwrap(),
        2 * unique,
        "(e) and (f), each key once"
    );
    assert_eq!(before, "0");
}

/// `dedup forget` by key: a FAILED record and one whose lease ran out go; a key under a live
/// lease (busy) and one a parked message carries (parked) stay; an unknown key is absent. A dry
/// run changes nothing; a key may be given in hex.
#[test]
fn forget_deletes_failed_keys_and_keeps_busy_and_parked_ones() {
    let db = env("DATABASE_URL");
    let out = dedup()
        .args(["migrate", "--database-url", &db])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let scope = format!("cli-forget-{}", std::process::id());
    let setup = format!(
        "DELETE FROM dedup_parked WHERE consumer_group = '{scope}'; \
         DELETE FROM dedup_records WHERE scope = '{scope}'; \
         INSERT INTO dedup_records (scope, key, state, owner, token, lease_until, attempts, \
         failure, created_at, updated_at, expires_at) VALUES \
         ('{scope}', 'poison', 'failed', NULL, nextval('dedup_token_seq'), NULL, 1, 'bug', \
          now(), now(), now() + interval '30 days'), \
         ('{scope}', 'running', 'in_progress', 'elsewhere#1', nextval('dedup_token_seq'), \
          now() + interval '10 minutes', 1, NULL, now(), now(), now() + interval '1 day'), \
         ('{scope}', 'stale', 'in_progress', 'dead#1', nextval('dedup_token_seq'), \
          now() - interval '1 minute', 1, NULL, now(), now(), now() + interval '1 day'), \
         ('{scope}', 'held', 'failed', NULL, nextval('dedup_token_seq'), NULL, 2, 'down', \
          now(), now(), now() + interval '30 days'); \
         INSERT INTO dedup_parked (consumer_group, topic, partition, \"offset\", has_key, \
         ordering_key, header_names, header_values, dedup_scope, dedup_key, error, attempts, \
         parked_at, due_at) VALUES ('{scope}', 'orders', 0, 3, true, 'acct-1', '{{}}', '{{}}', \
         '{scope}', 'held', 'down', 2, now(), now() + interval '1 hour');"
    );
    let out = psql().args(["-c", &setup]).output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let keys_left = || {
        sql_value(&format!(
            "SELECT coalesce(string_agg(convert_from(key, 'UTF8'), ',' ORDER BY key), '') \
             FROM dedup_records WHERE scope = '{scope}'"
        ))
    };
    let forget = |extra: &[&str]| {
        let mut args = vec!["forget", "--scope", scope.as_str()];
        args.extend_from_slice(extra);
        let out = dedup()
            .args(&args)
            .env("DATABASE_URL", &db)
            .env("REDIS_URL", env("REDIS_URL"))
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        (out.status.code(), stdout, stderr)
    };
    let all = [
        "--key", "poison", "--key", "running", "--key", "stale", "--key", "held", "--key", "nobody",
    ];

    let dry: Vec<&str> = all.iter().copied().chain(["--dry-run"]).collect();
    let (code, stdout, stderr) = forget(&dry);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    for line in [
        format!("would forget  {scope}/poison"),
        format!("would forget  {scope}/stale"),
        format!("busy          {scope}/running"),
        format!("parked        {scope}/held"),
        format!("absent        {scope}/nobody"),
        "dry run: 2 key(s) to forget, 1 busy".to_owned(),
        "dry run: nothing was changed".to_owned(),
    ] {
        assert!(stdout.contains(&line), "{line:?} not in {stdout}");
    }
    assert_eq!(keys_left(), "held,poison,running,stale");

    let (code, stdout, stderr) = forget(&all);
    // Kept keys make it a failed run: a re-drive script must not go on.
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("2 key(s) forgotten, 1 busy"), "{stdout}");
    assert!(stdout.contains("1 parked"), "{stdout}");
    assert!(stdout.contains("1 absent"), "{stdout}");
    assert!(stdout.contains("dropped from Redis"), "{stdout}");
    assert!(stderr.contains("2 key(s) were kept"), "{stderr}");
    assert_eq!(keys_left(), "held,running");

    // "poison" in hex: gone already.
    let (code, stdout, stderr) = forget(&["--hex-key", "706f69736f6e"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains(&format!("absent        {scope}/poison")),
        "{stdout}"
    );

    // Keys must be named; a bad hex key and a half-given range are configuration errors.
    let (code, _, stderr) = forget(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    let (code, _, stderr) = forget(&["--hex-key", "abc"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--hex-key"), "{stderr}");
    let out = dedup()
        .args(["forget", "--dead-letters", "orders.dlq", "--partition", "0"])
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));

    let cleanup = format!(
        "DELETE FROM dedup_parked WHERE consumer_group = '{scope}'; \
         DELETE FROM dedup_records WHERE scope = '{scope}';"
    );
    let out = psql().args(["-c", &cleanup]).output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
}

/// A password in the URL's query string (`password=`, `sslpassword=`), or in a libpq keyword
/// string, is never printed, in whatever error names the URL.
#[test]
fn passwords_in_the_query_string_are_not_printed() {
    for url in [
        "postgres://app@127.0.0.1:notaport/x?password=hunter2&sslpassword=k3y",
        "postgres://127.0.0.1:1/x?sslmode=disable&password=hunter2",
        "postgres://app:hunter2@127.0.0.1:1/x?application_name=a@b",
        "host=127.0.0.1 port=1 password=hunter2",
    ] {
        let out = dedup()
            .args(["migrate"])
            .env("DATABASE_URL", url)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{url}: {stdout}\n{stderr}");
        assert!(stderr.contains("DATABASE_URL"), "{url}: {stderr}");
        for secret in ["hunter2", "k3y"] {
            assert!(
                !stderr.contains(secret) && !stdout.contains(secret),
                "{url}: a password was printed: {stderr}"
            );
        }
    }
}

/// `dedup forget --dead-letters`: the keys named by a range of a dead-letter topic (on
/// librdkafka's mock cluster, served from this process) are forgotten; a dead letter without
/// `dedup-scope`/`dedup-key` is listed as skipped; a COMPLETED key is kept (its effect ran); a
/// key outside the range is not touched.
#[test]
fn forget_reads_the_keys_of_a_dead_letter_range() {
    use rdkafka::config::ClientConfig;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    let db = env("DATABASE_URL");
    let out = dedup()
        .args(["migrate", "--database-url", &db])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let scope = format!("cli-forget-dl-{}", std::process::id());
    let row = |key: &str, state: &str| {
        format!(
            "('{scope}', '{key}', '{state}', NULL, nextval('dedup_token_seq'), NULL, 1, \
             CASE WHEN '{state}' = 'completed' THEN ''::bytea END, now(), now(), \
             now() + interval '30 days')"
        )
    };
    let setup = format!(
        "DELETE FROM dedup_records WHERE scope = '{scope}'; \
         INSERT INTO dedup_records (scope, key, state, owner, token, lease_until, attempts, \
         result, created_at, updated_at, expires_at) VALUES {}, {}, {}, {};",
        row("a", "failed"),
        row("b", "failed"),
        row("c", "completed"),
        row("z", "failed")
    );
    let out = psql().args(["-c", &setup]).output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));

    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    let topic = "orders.dlq";
    mock.create_topic(topic, 1, 1).unwrap();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .create()
        .unwrap();
    // Offsets 0 to 4: a, a keyless dead letter, b, c, and z (past the range read).
    for key in [Some("a"), None, Some("b"), Some("c"), Some("z")] {
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "dedup-reason",
            value: Some("the handler failed permanently: bug"),
        });
        if let Some(k) = key {
            headers = headers
                .insert(Header {
                    key: "dedup-scope",
                    value: Some(scope.as_str()),
                })
                .insert(Header {
                    key: "dedup-key",
                    value: Some(k),
                });
        }
        producer
            .send(
                BaseRecord::<str, str>::to(topic)
                    .partition(0)
                    .payload("{}")
                    .headers(headers),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(std::time::Duration::from_secs(10)).unwrap();

    let out = dedup()
        .args([
            "forget",
            "--dead-letters",
            topic,
            "--partition",
            "0",
            "--from",
            "0",
            "--to",
            "3",
            "--brokers",
            &mock.bootstrap_servers(),
        ])
        .env("DATABASE_URL", &db)
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for line in [
        "read 4 dead letter(s)".to_owned(),
        format!("forgotten     {scope}/a"),
        format!("forgotten     {scope}/b"),
        format!("completed     {scope}/c"),
        "skipped       offset 1".to_owned(),
        "2 key(s) forgotten".to_owned(),
    ] {
        assert!(stdout.contains(&line), "{line:?} not in {stdout}");
    }
    let left = sql_value(&format!(
        "SELECT string_agg(convert_from(key, 'UTF8'), ',' ORDER BY key) FROM dedup_records \
         WHERE scope = '{scope}'"
    ));
    assert_eq!(left, "c,z");
    let out = psql()
        .args([
            "-c",
            &format!("DELETE FROM dedup_records WHERE scope = '{scope}'"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
}

/// `dedup migrate --partition-by-key-time`: the records partitioned by their key's time after
/// the migrations, a stored record of a key from a clock running ahead moved to its day's
/// partition and still found, and a second run that changes nothing.
#[test]
fn migrate_partitions_the_records_by_their_keys_time_once() {
    let db = OwnDb::new(&format!("dedup_partition_{}", std::process::id()));
    let out = dedup()
        .args(["migrate"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    // A UUIDv7 key made a day ahead of now (the server's clock), and a key without a time.
    let ahead: String = db.value(
        "SELECT lpad(to_hex(m >> 16), 8, '0') || '-' || lpad(to_hex(m & 65535), 4, '0') \
         || '-7abc-8def-0123456789ab' FROM (SELECT (extract(epoch FROM now()) * 1000)::int8 \
         + 86400000 AS m) t",
    );
    for key in [ahead.as_str(), "order-1"] {
        db.value(&format!(
            "INSERT INTO dedup_records (scope, key, state, token, attempts, result, created_at, \
             updated_at, expires_at) VALUES ('a', convert_to('{key}', 'UTF8'), 'completed', \
             nextval('dedup_token_seq'), 1, '\\x00', now(), now(), now() + interval '1 day')"
        ));
    }
    let run = || {
        let out = dedup()
            .args(["migrate", "--partition-by-key-time"])
            .env("DATABASE_URL", &db.url)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        stdout
    };
    let first = run();
    assert!(
        first.contains("partitioned by the key's time")
            && first.contains("1 stored record(s) moved"),
        "{first}"
    );
    // The floor it names is the one the switch wrote (an operator stops every binary older).
    let floor = db.value("SELECT compat_floor::text FROM dedup_schema");
    assert!(
        first.contains(&format!("compatibility floor {floor}:")),
        "the floor printed is not the schema's ({floor}): {first}"
    );
    // Moved to its day's partition: the range of days the switch made right after it.
    let range = db.value(&format!(
        "SELECT tableoid::regclass::text FROM dedup_records WHERE key = convert_to('{ahead}', 'UTF8')"
    ));
    assert!(range.starts_with("dedup_records_20"), "{range}");
    for key in [ahead.as_str(), "order-1"] {
        let out = dedup()
            .args(["inspect", "a", key])
            .env("DATABASE_URL", &db.url)
            .env_remove("REDIS_URL")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(
            stdout.contains("L3 (Postgres): Completed"),
            "{key}: {stdout}"
        );
        let ranged = stdout.contains(&format!("partition: {range} (a range of days"));
        let untimed = stdout.contains("partition: dedup_records_untimed");
        assert_eq!((ranged, untimed), (key == ahead, key != ahead), "{stdout}");
    }
    assert!(run().contains("partitioned by the key's time already"));
    // The purge keeps the ranges: made ahead already, nothing to drop, nothing expired.
    let out = dedup()
        .args(["purge"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("day(s) ahead") && stdout.contains("purged 0 record(s)"),
        "{stdout}"
    );
}

/// `dedup outbox status` says what waits and who leads; `dedup outbox relay` leads (its broker
/// away, the message waits), and SIGTERM stops it with its lease let go.
#[test]
fn outbox_status_and_relay_report_what_waits_and_who_leads() {
    let db = OwnDb::new(&format!("dedup_outbox_cli_{}", std::process::id()));
    let out = dedup()
        .args(["migrate"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let status = || {
        let out = dedup()
            .args(["outbox", "status", "--json"])
            .env("DATABASE_URL", &db.url)
            .output()
            .unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let s = status();
    assert_eq!(
        (s["leader"].clone(), s["unpublished"].clone()),
        (serde_json::Value::Null, 0.into())
    );
    // A message written by a transaction of its own, as OutboxWriter writes it.
    db.value(
        "INSERT INTO dedup_outbox (ring, topic, payload, headers, idem_key, cause_scope, \
         cause_key, event_ms) SELECT ring, 't', '\\x01', '\\x', '\\x02', 's', '\\x03', 0 \
         FROM dedup_outbox_relay",
    );
    assert_eq!(status()["unpublished"], 1);
    // The relay, its broker away: it leads, and the message waits.
    let relay = dedup()
        .args([
            "outbox",
            "relay",
            "--brokers",
            "127.0.0.1:1",
            "--name",
            "cli-relay",
        ])
        .env("DATABASE_URL", &db.url)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while status()["leader"] != "cli-relay" {
        assert!(std::time::Instant::now() < deadline, "the relay never led");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(status()["unpublished"], 1);
    let pid = relay.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = relay.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out).0.contains("relay stopped: published 0"),
        "{:?}",
        text(&out)
    );
    let s = status();
    assert_eq!(
        (s["leader"].clone(), s["unpublished"].clone()),
        (serde_json::Value::Null, 1.into())
    );
    let out = dedup()
        .args(["outbox", "status"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(text(&out).0.contains("unpublished: 1"), "{:?}", text(&out));
}
