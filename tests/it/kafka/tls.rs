//! TLS and SASL to the broker, and zstd-compressed topics.
//!
//! nisshi 0.6.0 accepts `--cert` and `--key` but never wraps its listener in TLS (its broker
//! builds the acceptor and leaves it unused), so the test broker is a nisshi process behind a TLS
//! front of the test's own, with a certificate made at test time for `localhost`; nisshi
//! advertises the front, so every client connection, bootstrap and partition leader alike, is
//! TLS. Its `--authentication` requires SASL with SCRAM-SHA-256/512 or OAUTHBEARER (it is built
//! without PLAIN), and its SCRAM users can only be created by an authenticated client, which its
//! own CLI cannot be, on in-memory storage that goes with the process: so a SCRAM login is tested
//! as refused (a user it does not know), not as accepted.
//!
//! The front (`support::tls::TlsFront`) runs on a thread and runtime of its own. The tests: the
//! duplicates scenario end to end over TLS with zstd producers; a certificate from an untrusted
//! authority, or one that does not name the address, and a refused SCRAM login each stop the
//! runner with `RunnerError::Refused` naming the broker, never the password; librdkafka's
//! `builtin.features` include ssl, SASL PLAIN and SCRAM, and zstd.

use std::path::PathBuf;

use rdkafka::config::ClientConfig;

use super::settings::Settings;
use super::*;
use crate::support::NisshiServer;
use crate::support::tls::{Certs, TlsFront};

pub(super) struct SecureBroker {
    pub(super) nisshi: NisshiServer,
    front: TlsFront,
    certs: Certs,
    pub(super) props: Vec<(&'static str, String)>,
}

impl SecureBroker {
    pub(super) fn bootstrap(&self) -> String {
        self.front.address()
    }
}

const PASSWORD: &str = "kafka-pw-Hq2-never-printed";

/// A broker reached over TLS (verified: the CA made here, the name `localhost`), every client
/// producing zstd; with `sasl`, one that requires a SASL login too (the clients try SCRAM).
async fn secure(sasl: bool) -> Broker {
    let certs = Certs::make();
    let mut front = TlsFront::bind(&certs).await;
    let nisshi = NisshiServer::start_with(
        Some(front.address()),
        if sasl { &["--authentication"] } else { &[] },
    );
    front.serve(nisshi.listener());
    let mut props = vec![
        (
            "security.protocol",
            if sasl { "sasl_ssl" } else { "ssl" }.to_owned(),
        ),
        ("ssl.ca.location", certs.ca().display().to_string()),
        ("ssl.endpoint.identification.algorithm", "https".to_owned()),
        // A producer property (a consumer ignores it): the test stream and the dead letters.
        ("compression.type", "zstd".to_owned()),
    ];
    if sasl {
        props.extend([
            ("sasl.mechanism", "SCRAM-SHA-256".to_owned()),
            ("sasl.username", "app".to_owned()),
            ("sasl.password", PASSWORD.to_owned()),
        ]);
    }
    Broker::Secure(SecureBroker {
        nisshi,
        front,
        certs,
        props,
    })
}

fn secure_parts(broker: &Broker) -> &SecureBroker {
    match broker {
        Broker::Secure(s) => s,
        _ => unreachable!("a secure broker"),
    }
}

#[test]
fn librdkafka_is_built_with_tls_sasl_and_zstd() {
    let native = ClientConfig::new().create_native_config().unwrap();
    let features = native.get("builtin.features").unwrap();
    for f in ["ssl", "sasl_plain", "sasl_scram", "zstd"] {
        assert!(features.split(',').any(|x| x == f), "{f} in {features}");
    }
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn over_tls_with_zstd_a_stream_is_booked_once_and_committed(pool: PgPool) {
    let broker = secure(false).await;
    super::a_stream_with_duplicates_books_each_key_once_and_commits_to_the_end(&broker, pool).await;
    assert!(secure_parts(&broker).front.handshakes() > 0);
}

/// Runs a runner with `config` (over a store nobody uses) and answers how it ended.
async fn refused_reason(pool: &PgPool, config: Settings) -> String {
    let redis = RedisServer::start();
    let engine = setup(pool, &redis).build(&config).await;
    let consumer = consumer_for(&engine, &config)
        .build(|_: Arc<Delivery>, _: LeaseContext| async {
            Ok::<_, HandlerError<String>>(Bytes::new())
        })
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(60), consumer.run())
        .await
        .expect("a refused client stops the consumer within 60 s");
    let e = ended.expect_err("the runner cannot have run");
    assert!(matches!(e, RunnerError::Refused(_)), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    let text = e.to_string();
    assert!(!text.contains(PASSWORD), "{text}");
    text
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_certificate_the_client_cannot_verify_stops_the_runner_naming_the_broker(pool: PgPool) {
    let broker = secure(false).await;
    let s = secure_parts(&broker);
    let topic = unique("tls-refused");
    let other_ca: PathBuf = s.certs.other_ca();
    // An authority the client does not trust.
    let config = broker
        .config(&unique("g"), &topic)
        .with_client("ssl.ca.location", other_ca.display().to_string());
    let text = refused_reason(&pool, config).await;
    assert!(text.contains(&s.front.address()), "{text}");
    assert!(text.contains("certificate"), "{text}");

    // A trusted certificate that does not name the address connected to.
    let by_ip = format!("127.0.0.1:{}", s.front.port());
    let mut config = Settings::new(by_ip.as_str(), unique("g").as_str(), [topic.as_str()]);
    for (k, v) in broker.client() {
        config = config.with_client(k, v);
    }
    let text = refused_reason(&pool, config).await;
    assert!(text.contains(&by_ip), "{text}");
}

#[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
async fn a_refused_sasl_login_stops_the_runner_without_printing_the_password(pool: PgPool) {
    let broker = secure(true).await;
    let s = secure_parts(&broker);
    // SCRAM for a user the broker does not know.
    let config = broker.config(&unique("g"), &unique("sasl-refused"));
    let text = refused_reason(&pool, config).await;
    assert!(text.contains(&s.front.address()), "{text}");
}
