//! dedup-redis: the Redis fast path (L2) of dedup's tiered store.
//!
//! Redis holds copies of what the authority (Postgres) decided: COMPLETED and FAILED records for
//! replay, and IN_PROGRESS markers that expire with their lease, so a concurrent duplicate is told
//! InFlight without a Postgres round trip. Redis never grants a lease and never learns an outcome
//! before the authority committed it. Losing Redis (flush, restart, failover) costs speed only.
//!
//! Each idempotency key is one Redis hash, `<prefix>:{<digest>}`, where the digest (128 bits of
//! SHA-256 over scope and key) is the hash tag: on Redis Cluster every script call touches one
//! key, so the scripts in this crate's `lua/` run unchanged there. The hash also holds the full
//! scope and key, and a copy whose identity does not match is a miss (with a warning), never an
//! answer.
//!
//! Connections: [`ConnectionManager`] (reconnects in the background) or a cluster connection,
//! behind the same [`RedisFastPath`] type. The URL carries ACL user and password
//! (`redis://user:password@host:port/db`); dedup never logs URLs or passwords. With the `tls`
//! feature, `rediss://` URLs connect over TLS (rustls), trusting the system's roots or a CA given
//! to `connect_tls`.
//!
//! A lookup is a pipeline (`HGETALL`, `PTTL`). Batch lookups and backfills are one pipeline for
//! all keys on one server; on a cluster (where a pipeline may not cross slots) they are
//! concurrent calls that the multiplexed connection writes together. Writes are the scripts in
//! `lua/`, one per verb, each opening with its KEYS, ARGV and return values, embedded with
//! `include_str!` and run through `redis::Script` (EVALSHA, reloaded on NOSCRIPT): `store.lua`
//! (IN_PROGRESS markers or terminal copies, one per key it is given: one key on a cluster, a
//! chunk of a backfill on one server; refused where a newer token is held, or where a marker
//! would replace the terminal copy of its own token), `release.lua` and `extend.lua` (both
//! only for the marker's own token). Tokens are compared as decimal strings, exact past 2^53.
//!
//! # Example
//! ```no_run
//! use dedup_core::{Dedup, TieredConfig, TieredStore};
//! use dedup_pg::PgStore;
//! use dedup_redis::RedisFastPath;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
//! let redis = RedisFastPath::connect(&std::env::var("REDIS_URL")?).await?;
//! let store = TieredStore::new(PgStore::new(pool), redis, TieredConfig::default());
//! let dedup = Dedup::new(store);
//! # let _ = dedup;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use dedup_core::{
    Cached, FastPath, FencingToken, Fingerprint, IdempotencyKey, Lease, OwnerId, State, StoreError,
    Timestamp,
};
use futures_util::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{RedisError, Script};
use sha2::{Digest, Sha256};
use tracing::warn;

pub use redis;

struct Scripts {
    store: Script,
    release: Script,
    extend: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    store: Script::new(include_str!("../lua/store.lua")),
    release: Script::new(include_str!("../lua/release.lua")),
    extend: Script::new(include_str!("../lua/extend.lua")),
});

/// The Redis fast path, over any async Redis connection (by default a [`ConnectionManager`]).
#[derive(Clone)]
pub struct RedisFastPath<C = ConnectionManager> {
    conn: C,
    prefix: String,
    /// Whether batch calls go as one pipeline (one node) or as concurrent calls (a cluster,
    /// where a pipeline may not cross hash slots; the multiplexed connection still writes them
    /// together).
    pipelined: bool,
    /// Whether a pipelined backfill carries many copies per script call (off: one per call).
    /// Shared by clones; turned off for good the first time the server answers CROSSSLOT (a
    /// single endpoint that still enforces hash slots, as a managed cluster's proxy does).
    batched_copies: Arc<AtomicBool>,
}

impl<C> fmt::Debug for RedisFastPath<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the connection: its URL may hold a password.
        f.debug_struct("RedisFastPath")
            .field("prefix", &self.prefix)
            .field("pipelined", &self.pipelined)
            .field(
                "batched_copies",
                &self.batched_copies.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl RedisFastPath<ConnectionManager> {
    /// Connects to one Redis server (`redis://[user:password@]host:port[/db]`). The connection
    /// reconnects by itself after a drop.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        install_crypto();
        let client = redis::Client::open(url).map_err(config_error)?;
        Ok(Self::new(manager(&client).await?))
    }
}

#[cfg(feature = "tls")]
impl RedisFastPath<ConnectionManager> {
    /// Connects over TLS (`rediss://host:port`), trusting `root_ca_pem` (a PEM certificate)
    /// instead of the system's roots when it is given.
    pub async fn connect_tls(url: &str, root_ca_pem: Option<&[u8]>) -> Result<Self, StoreError> {
        install_crypto();
        let certs = redis::TlsCertificates {
            client_tls: None,
            root_cert: root_ca_pem.map(<[u8]>::to_vec),
        };
        let client = redis::Client::build_with_tls(url, certs).map_err(config_error)?;
        Ok(Self::new(manager(&client).await?))
    }
}

/// A connection manager that gives up on a connection attempt after 1 s and waits at most 1 s
/// between attempts: a cache should fail a bad configuration fast, and come back fast after a
/// restart (the default backoff grows to several seconds).
async fn manager(client: &redis::Client) -> Result<ConnectionManager, StoreError> {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_max_delay(Duration::from_secs(1))
        .set_connection_timeout(Some(Duration::from_secs(1)));
    client
        .get_connection_manager_with_config(config)
        .await
        .map_err(classify)
}

/// redis-rs leaves rustls's crypto provider to the application: use ring unless one is set.
fn install_crypto() {
    #[cfg(feature = "tls")]
    {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

impl RedisFastPath<redis::cluster_async::ClusterConnection> {
    /// Connects to a Redis Cluster through any of its nodes.
    pub async fn connect_cluster(urls: &[&str]) -> Result<Self, StoreError> {
        install_crypto();
        let client = redis::cluster::ClusterClient::new(urls.to_vec()).map_err(config_error)?;
        let conn = client.get_async_connection().await.map_err(classify)?;
        Ok(Self::new(conn).with_pipelining(false))
    }
}

impl<C> RedisFastPath<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Wraps a connection, with the key prefix `dedup`.
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            prefix: "dedup".to_owned(),
            pipelined: true,
            batched_copies: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Whether a backfill on one server sends many copies in one store script call (the
    /// default) or one copy per call. A script call touches every key it is given, so it must
    /// reach one server that holds them all: turn it off behind a proxy that routes a call by its
    /// first key (twemproxy). A server that enforces hash slots behind one address (a managed
    /// cluster's endpoint) answers CROSSSLOT, and it turns off by itself.
    pub fn with_batched_copies(self, on: bool) -> Self {
        self.batched_copies.store(on, Ordering::Relaxed);
        self
    }

    /// Whether batch calls go as one pipeline (the default; for one Redis server) or as
    /// concurrent single calls (what a cluster connection needs: a pipeline may not cross hash
    /// slots). [`connect_cluster`](RedisFastPath::connect_cluster) turns it off.
    pub fn with_pipelining(mut self, on: bool) -> Self {
        self.pipelined = on;
        self
    }

    /// Whether backfills send many copies per store script call now
    /// ([`with_batched_copies`](Self::with_batched_copies)).
    pub fn batched_copies(&self) -> bool {
        self.batched_copies.load(Ordering::Relaxed)
    }

    /// Sets the key prefix (to share a Redis between deployments).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The connection.
    pub fn connection(&self) -> &C {
        &self.conn
    }

    /// The Redis key holding `key`'s copy: `<prefix>:{<32 hex digits>}`.
    pub fn redis_key(&self, key: &IdempotencyKey) -> String {
        let mut h = Sha256::new();
        h.update(identity(key));
        let digest = h.finalize();
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut rkey = String::with_capacity(self.prefix.len() + 35);
        rkey.push_str(&self.prefix);
        rkey.push_str(":{");
        for b in &digest[..16] {
            rkey.push(char::from(HEX[usize::from(b >> 4)]));
            rkey.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        rkey.push('}');
        rkey
    }
}

/// scope, NUL, key: unambiguous, since a scope holds no control characters.
fn identity(key: &IdempotencyKey) -> Vec<u8> {
    let mut id = Vec::with_capacity(key.scope().as_str().len() + 1 + key.key_bytes().len());
    id.extend_from_slice(key.scope().as_str().as_bytes());
    id.push(0);
    id.extend_from_slice(key.key_bytes());
    id
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl<C> FastPath for RedisFastPath<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn lookup(&self, key: &IdempotencyKey) -> Result<Option<Cached>, StoreError> {
        let rkey = self.redis_key(key);
        let mut conn = self.conn.clone();
        let (fields, pttl): (HashMap<String, Vec<u8>>, i64) = redis::pipe()
            .cmd("HGETALL")
            .arg(&rkey)
            .cmd("PTTL")
            .arg(&rkey)
            .query_async(&mut conn)
            .await
            .map_err(classify)?;
        read_copy(key, &fields, pttl)
    }

    async fn store(
        &self,
        key: &IdempotencyKey,
        copy: &Cached,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let mut inv = SCRIPTS.store.prepare_invoke();
        add_copy(&mut inv, &self.redis_key(key), key, copy, ttl);
        let written: Vec<i64> = inv.invoke_async(&mut conn).await.map_err(classify)?;
        Ok(written.first() == Some(&1))
    }

    /// One pipeline of HGETALL and PTTL per key (or, on a cluster, concurrent lookups).
    async fn lookup_many(
        &self,
        keys: &[IdempotencyKey],
    ) -> Vec<Result<Option<Cached>, StoreError>> {
        if !self.pipelined || keys.len() < 2 {
            return join_all(keys.iter().map(|k| self.lookup(k))).await;
        }
        let mut pipe = redis::pipe();
        for key in keys {
            let rkey = self.redis_key(key);
            pipe.cmd("HGETALL").arg(&rkey).cmd("PTTL").arg(&rkey);
        }
        let mut conn = self.conn.clone();
        let values: Vec<redis::Value> = match pipe.query_async(&mut conn).await {
            Ok(values) => values,
            Err(e) => {
                let e = classify(e);
                return keys.iter().map(|_| Err(echo(&e))).collect();
            }
        };
        let mut values = values.into_iter();
        keys.iter()
            .map(|key| {
                let (Some(fields), Some(pttl)) = (values.next(), values.next()) else {
                    return Err(StoreError::backend(PipelineShort));
                };
                let fields: HashMap<String, Vec<u8>> =
                    redis::from_redis_value(fields).map_err(|e| classify(e.into()))?;
                let pttl: i64 = redis::from_redis_value(pttl).map_err(|e| classify(e.into()))?;
                read_copy(key, &fields, pttl)
            })
            .collect()
    }

    /// One store script call per 128 copies or about 1 MiB (or, on a
    /// cluster, concurrent calls of one copy each), all in one pipeline. A pipeline does not load
    /// a script Redis lacks (after a restart, or on a just-started server): on NOSCRIPT the script
    /// is loaded and the pipeline sent once more. The items of a call that failed (one that met
    /// foreign data stops there) are written on their own, concurrently.
    async fn store_many(
        &self,
        items: &[(IdempotencyKey, Cached, Duration)],
    ) -> Vec<Result<bool, StoreError>> {
        if !self.pipelined || items.len() < 2 {
            return join_all(items.iter().map(|(k, c, ttl)| self.store(k, c, *ttl))).await;
        }
        let calls = if self.batched_copies.load(Ordering::Relaxed) {
            copy_calls(items)
        } else {
            (0..items.len()).map(|i| i..i + 1).collect()
        };
        let mut pipe = redis::pipe();
        for call in &calls {
            let mut inv = SCRIPTS.store.prepare_invoke();
            for (key, copy, ttl) in &items[call.clone()] {
                add_copy(&mut inv, &self.redis_key(key), key, copy, *ttl);
            }
            pipe.invoke_script(&inv);
        }
        // Each call is answered on its own: one that met foreign data does not fail the others.
        pipe.ignore_errors();
        let mut conn = self.conn.clone();
        let mut answers: Vec<redis::RedisResult<Vec<i64>>> =
            pipe.query_async(&mut conn).await.unwrap_or_default();
        let server_said = |a: &redis::RedisResult<Vec<i64>>, kind| {
            a.as_ref()
                .is_err_and(|e| e.kind() == redis::ErrorKind::Server(kind))
        };
        if answers
            .iter()
            .any(|a| server_said(a, redis::ServerErrorKind::NoScript))
            && SCRIPTS.store.load_async(&mut conn).await.is_ok()
        {
            answers = pipe.query_async(&mut conn).await.unwrap_or_default();
        }
        if answers
            .iter()
            .any(|a| server_said(a, redis::ServerErrorKind::CrossSlot))
            && self.batched_copies.swap(false, Ordering::Relaxed)
        {
            warn!(
                "Redis refused a store script call of several keys (CROSSSLOT): backfills now send one copy per call"
            );
        }
        // One array of answers per call; a call that failed (or answered short) leaves its items
        // unanswered here.
        let mut written: Vec<Option<bool>> = Vec::with_capacity(items.len());
        let mut answers = answers.into_iter();
        for call in &calls {
            let mut got = answers
                .next()
                .and_then(Result::ok)
                .unwrap_or_default()
                .into_iter();
            written.extend(call.clone().map(|_| got.next().map(|w| w == 1)));
        }
        join_all(
            items
                .iter()
                .zip(written)
                .map(|((key, copy, ttl), w)| async move {
                    match w {
                        Some(w) => Ok(w),
                        None => self.store(key, copy, *ttl).await,
                    }
                }),
        )
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let dropped: i64 = SCRIPTS
            .release
            .key(self.redis_key(&lease.key))
            .arg(lease.token.get())
            .invoke_async(&mut conn)
            .await
            .map_err(classify)?;
        Ok(dropped == 1)
    }

    async fn extend(
        &self,
        lease: &Lease,
        lease_until: Timestamp,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn.clone();
        let moved: i64 = SCRIPTS
            .extend
            .key(self.redis_key(&lease.key))
            .arg(lease.token.get())
            .arg(lease_until.as_micros())
            .arg(ms(ttl))
            .invoke_async(&mut conn)
            .await
            .map_err(classify)?;
        Ok(moved == 1)
    }
}

/// The most copies one store script call carries in a pipelined backfill, and the most bytes of
/// results and reasons: a script runs alone on its server, and Redis reads a call whole before it
/// runs it, so a call is kept short (about a quarter of a millisecond for 128 small copies).
const STORE_CHUNK: usize = 128;
const STORE_CHUNK_BYTES: usize = 1 << 20;
/// What a copy adds to a call besides its key, result and reason: the record's hash name and the
/// other nine arguments, as text.
const COPY_OVERHEAD_BYTES: usize = 256;

/// Splits a backfill into store script calls of at most [`STORE_CHUNK`] copies and about
/// [`STORE_CHUNK_BYTES`] (a copy larger than that goes alone).
fn copy_calls(items: &[(IdempotencyKey, Cached, Duration)]) -> Vec<Range<usize>> {
    let mut calls = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (key, copy, _)) in items.iter().enumerate() {
        let size = key.key_bytes().len()
            + copy.result.as_ref().map_or(0, Bytes::len)
            + copy.failure.as_ref().map_or(0, String::len)
            + COPY_OVERHEAD_BYTES;
        if i > start && (i - start == STORE_CHUNK || bytes + size > STORE_CHUNK_BYTES) {
            calls.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < items.len() {
        calls.push(start..items.len());
    }
    calls
}

/// Adds `copy` of `key` to a store script call (`lua/store.lua`: one key and ten arguments).
fn add_copy(
    inv: &mut redis::ScriptInvocation<'_>,
    rkey: &str,
    key: &IdempotencyKey,
    copy: &Cached,
    ttl: Duration,
) {
    let empty: &[u8] = b"";
    inv.key(rkey);
    inv.arg(copy.state.as_str())
        .arg(copy.token.get())
        .arg(ms(ttl))
        .arg(identity(key))
        .arg(copy.attempts)
        .arg(
            copy.fingerprint
                .as_ref()
                .map_or(empty, |f| f.as_bytes().as_slice()),
        )
        .arg(copy.owner.as_ref().map_or("", OwnerId::as_str))
        .arg(
            copy.lease_until
                .map_or(String::new(), |t| t.as_micros().to_string()),
        )
        .arg(copy.result.as_deref().unwrap_or(empty))
        .arg(copy.failure.as_deref().unwrap_or(""));
}

/// A lookup's answer: the hash's fields and its PTTL.
fn read_copy(
    key: &IdempotencyKey,
    fields: &HashMap<String, Vec<u8>>,
    pttl: i64,
) -> Result<Option<Cached>, StoreError> {
    if fields.is_empty() {
        return Ok(None);
    }
    let mut copy = parse(key, fields).map_err(|detail| {
        warn!(key = %key, %detail, "foreign or corrupted data at a dedup key in Redis; treating it as a miss");
        StoreError::Corrupt {
            key: key.clone(),
            detail,
        }
    })?;
    copy.expires_in = u64::try_from(pttl).ok().map(Duration::from_millis);
    Ok(Some(copy))
}

/// Reads a hash as a copy of `key`'s record; anything else is an error naming what was wrong.
fn parse(key: &IdempotencyKey, f: &HashMap<String, Vec<u8>>) -> Result<Cached, String> {
    let text = |name: &str| -> Result<&str, String> {
        let v = f
            .get(name)
            .ok_or_else(|| format!("field {name} is missing"))?;
        std::str::from_utf8(v).map_err(|_| format!("field {name} is not text"))
    };
    if f.get("k").map(Vec::as_slice) != Some(identity(key).as_slice()) {
        return Err("the hash belongs to another key (or to nobody)".into());
    }
    let state = State::parse(text("s")?).ok_or("field s is not a state")?;
    let token: u64 = text("t")?.parse().map_err(|_| "field t is not a token")?;
    let mut copy = Cached::new(state, FencingToken::new(token));
    copy.attempts = text("a")?.parse().map_err(|_| "field a is not a count")?;
    copy.fingerprint = match f.get("fp").map(Vec::as_slice) {
        None | Some([]) => None,
        Some(b) => Some(Fingerprint::from_slice(b).ok_or("field fp is not 32 bytes")?),
    };
    match state {
        State::InProgress => {
            copy.owner = Some(OwnerId::new(text("o")?));
            let lu: i64 = text("lu")?.parse().map_err(|_| "field lu is not a time")?;
            copy.lease_until = Some(Timestamp::from_micros(lu));
        }
        State::Completed => {
            let r = f.get("r").ok_or("field r is missing")?;
            copy.result = Some(Bytes::copy_from_slice(r));
        }
        State::Failed => copy.failure = Some(text("f")?.to_owned()),
        other => return Err(format!("state {other} is never cached")),
    }
    Ok(copy)
}

/// A pipeline answered fewer values than it was sent commands.
#[derive(Debug)]
struct PipelineShort;

impl fmt::Display for PipelineShort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the Redis pipeline answered fewer values than it was sent")
    }
}

impl std::error::Error for PipelineShort {}

/// A copy of `e` of the same kind, for each key of a pipeline that `e` failed.
fn echo(e: &StoreError) -> StoreError {
    let msg = std::io::Error::other(format!("pipeline failed: {e}"));
    if e.is_retryable() {
        StoreError::unavailable(msg)
    } else {
        StoreError::backend(msg)
    }
}

/// Classifies a Redis error. Every fast-path call is advisory (the tiered store falls through to
/// the authority on any error), but the kinds still tell passing trouble from bugs.
pub fn classify(e: RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        StoreError::unavailable(e)
    } else {
        StoreError::backend(e)
    }
}

fn config_error(e: RedisError) -> StoreError {
    StoreError::Input(dedup_core::InputError::Policy(
        if e.to_string().contains("URL") {
            "the Redis URL is not valid (redis://[user:password@]host:port[/db])"
        } else {
            "the Redis configuration is not valid"
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedup_core::Scope;

    fn copy(n: usize, result_len: usize) -> (IdempotencyKey, Cached, Duration) {
        let key =
            IdempotencyKey::new(Scope::new("s").expect("scope"), format!("k{n}")).expect("key");
        let mut copy = Cached::new(State::Completed, FencingToken::new(1));
        copy.result = Some(Bytes::from(vec![b'r'; result_len]));
        (key, copy, Duration::from_secs(60))
    }

    /// Calls hold at most 128 copies and about 1 MiB; a copy larger than that goes alone.
    #[test]
    fn a_backfill_is_cut_into_calls_by_count_and_by_bytes() {
        let small: Vec<_> = (0..300).map(|n| copy(n, 16)).collect();
        assert_eq!(copy_calls(&small), vec![0..128, 128..256, 256..300]);
        let big: Vec<_> = (0..5).map(|n| copy(n, 400 << 10)).collect();
        assert_eq!(copy_calls(&big), vec![0..2, 2..4, 4..5]);
        let huge = vec![copy(0, 16), copy(1, 3 << 20), copy(2, 16)];
        assert_eq!(copy_calls(&huge), vec![0..1, 1..2, 2..3]);
        assert!(copy_calls(&[]).is_empty());
    }
}
