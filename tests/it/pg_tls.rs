//! TLS to Postgres: a server of the test's own with `ssl = on` and a certificate made at test
//! time, a role that may only log in over TLS with a password, and every `sslmode` a managed
//! Postgres is used with.
//!
//! `verify-full`, `verify-ca` and `require` connect (`pg_stat_ssl` says TLS) and the store works
//! over it; an untrusted authority, a certificate for another name, a missing root file, a wrong
//! password, no TLS at all, and `require` against a server without TLS are each a `ConnectError`
//! that names `host:port` and the mode and never the password.

use std::time::Duration;

use bytes::Bytes;
use dedup_core::{Completion, Dedup, HandlerError};
use dedup_pg::{ConnectError, PgStore};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::support::tls::Certs;
use crate::support::{PgServer, key};

const PASSWORD: &str = "pw-Zq81-never-printed";

/// A server that speaks TLS with the certificate `certs` made for `localhost`, where the role
/// `app` must use TLS and its password.
fn tls_server(certs: &Certs) -> PgServer {
    PgServer::start_configured(|s| {
        certs.install_server(s.dir());
        s.give_to_owner(&["server.crt", "server.key"]);
        let hba = s.dir().join("pg_hba.conf");
        let rest = std::fs::read_to_string(&hba).unwrap();
        std::fs::write(
            &hba,
            format!(
                "hostssl all app 127.0.0.1/32 scram-sha-256\n\
                 hostssl all app ::1/128 scram-sha-256\n\
                 host all app all reject\n{rest}"
            ),
        )
        .unwrap();
        "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
         password_encryption = 'scram-sha-256'\n"
            .to_owned()
    })
}

async fn with_app_role(server: &PgServer) {
    let admin = PgPool::connect(&server.url()).await.unwrap();
    // A constant of this file: nothing to inject.
    let sql = format!("CREATE ROLE app LOGIN PASSWORD '{PASSWORD}'");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query("GRANT CREATE ON SCHEMA public TO app")
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}

fn url(host: &str, port: u16, password: &str, query: &str) -> String {
    format!("postgres://app:{password}@{host}:{port}/postgres?{query}")
}

async fn connect(url: &str) -> Result<PgPool, ConnectError> {
    dedup_pg::connect(
        url,
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10)),
    )
    .await
}

async fn uses_tls(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The error names the server and the mode, never the password, and says retrying cannot help.
fn refused_clearly(e: &ConnectError, place: &str, mode: &str) -> String {
    let text = e.to_string();
    assert!(text.contains(place), "{text}");
    assert!(text.contains(&format!("sslmode={mode}")), "{text}");
    assert!(!text.contains(PASSWORD), "{text}");
    assert!(!format!("{e:?}").contains(PASSWORD), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_verifies_the_server_as_the_url_says() {
    let certs = Certs::make();
    let server = tls_server(&certs);
    with_app_role(&server).await;
    let port = server.port();
    let ca = certs.ca().display().to_string();

    // verify-full: the certificate chains to the given authority and names the host.
    let full = connect(&url(
        "localhost",
        port,
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(uses_tls(&full).await);
    // The store works over it: a claim, the effect, the completion, a replay.
    dedup_pg::migrate(&full).await.unwrap();
    let dedup = Dedup::new(PgStore::new(full.clone()));
    let k = key("tls-order-1");
    for _ in 0..2 {
        let done = dedup
            .process(&k, None, |_| async {
                Ok::<_, HandlerError<String>>(Completion::store(Bytes::from_static(b"paid")))
            })
            .await
            .unwrap();
        assert_eq!(done.result(), &Bytes::from_static(b"paid"));
    }
    full.close().await;

    // verify-ca checks the chain, not the name: 127.0.0.1 is not on the certificate.
    let ca_only = connect(&url(
        "127.0.0.1",
        port,
        PASSWORD,
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(uses_tls(&ca_only).await);
    ca_only.close().await;

    // require encrypts without verifying.
    let require = connect(&url("127.0.0.1", port, PASSWORD, "sslmode=require"))
        .await
        .unwrap();
    assert!(uses_tls(&require).await);
    require.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_certificate_or_login_is_a_clear_error_without_the_password() {
    let certs = Certs::make();
    let server = tls_server(&certs);
    with_app_role(&server).await;
    let port = server.port();
    let ca = certs.ca().display().to_string();
    let other = certs.other_ca().display().to_string();

    // A certificate from an authority the client does not trust.
    let e = connect(&url(
        "localhost",
        port,
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={other}"),
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, ConnectError::Tls { .. }), "{e:?}");
    let text = refused_clearly(&e, &format!("localhost:{port}"), "verify-full");
    assert!(text.to_lowercase().contains("certificate"), "{text}");

    // A trusted certificate that does not name the host connected to.
    let e = connect(&url(
        "127.0.0.1",
        port,
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, ConnectError::Tls { .. }), "{e:?}");
    refused_clearly(&e, &format!("127.0.0.1:{port}"), "verify-full");

    // A root certificate file that is not there.
    let e = connect(&url(
        "localhost",
        port,
        PASSWORD,
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ))
    .await
    .unwrap_err();
    let text = refused_clearly(&e, &format!("localhost:{port}"), "verify-full");
    assert!(text.contains("/nonexistent/ca.pem"), "{text}");

    // The right certificate and a wrong password: the server refuses the login.
    let wrong = "wrong-pw-also-never-printed";
    let e = connect(&url(
        "localhost",
        port,
        wrong,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, ConnectError::Refused { .. }), "{e:?}");
    let text = refused_clearly(&e, &format!("localhost:{port}"), "verify-full");
    assert!(!text.contains(wrong), "{text}");

    // Without TLS the role may not log in at all.
    let e = connect(&url("127.0.0.1", port, PASSWORD, "sslmode=disable"))
        .await
        .unwrap_err();
    assert!(matches!(e, ConnectError::Refused { .. }), "{e:?}");
    refused_clearly(&e, &format!("127.0.0.1:{port}"), "disable");
}

/// A server without TLS under `sslmode=require` is refused, not silently used in the clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_refuses_a_server_without_tls() {
    let server = PgServer::start();
    let port = server.port();
    let e = connect(&format!(
        "postgres://postgres:{PASSWORD}@127.0.0.1:{port}/postgres?sslmode=require"
    ))
    .await
    .unwrap_err();
    assert!(matches!(e, ConnectError::Tls { .. }), "{e:?}");
    refused_clearly(&e, &format!("127.0.0.1:{port}"), "require");
}
