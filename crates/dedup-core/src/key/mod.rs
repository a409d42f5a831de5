//! Idempotency keys, scopes and payload fingerprints.
//!
//! `Scope` is a namespace. `IdempotencyKey` is 1 to 512 bytes: a longer key is rejected, or
//! digested explicitly with `IdempotencyKey::digest`; `IdempotencyKey::timed` makes a
//! time-ordered key of a random event id and the event's own time. `Fingerprint` is a payload's
//! SHA-256.
//! `Display` escapes binary keys, control characters and invisible format characters
//! (bidirectional overrides such as U+202E, zero-width characters), and elides long keys.

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::{Arc, LazyLock};

use sha2::{Digest, Sha256};

use crate::error::InputError;

/// The longest scope accepted, in bytes.
pub const MAX_SCOPE_LEN: usize = 128;

/// The longest key accepted, in bytes.
///
/// Longer keys are **rejected** ([`InputError::KeyTooLong`]), not hashed: a stored key stays
/// readable by an operator (`dedup inspect`), and a silent digest would hide a producer bug that
/// puts a whole payload in the key header. A caller whose natural key is longer can digest it
/// explicitly with [`IdempotencyKey::digest`].
pub const MAX_KEY_LEN: usize = 512;

/// How many bytes of a key [`fmt::Display`] shows before it elides the rest.
const DISPLAY_KEY_BYTES: usize = 48;

/// A namespace for keys: a service, a consumer group or a tenant.
///
/// Two scopes never share a record, even for equal key bytes. A scope is 1 to
/// [`MAX_SCOPE_LEN`] bytes of UTF-8 with no control characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Arc<str>);

impl Scope {
    /// Validates and wraps a scope name.
    pub fn new(name: impl AsRef<str>) -> Result<Self, InputError> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(InputError::EmptyScope);
        }
        if name.len() > MAX_SCOPE_LEN {
            return Err(InputError::ScopeTooLong {
                len: name.len(),
                max: MAX_SCOPE_LEN,
            });
        }
        if name.chars().any(|c| c.is_control() || is_invisible(c)) {
            return Err(InputError::ScopeNotPrintable);
        }
        Ok(Self(name.into()))
    }

    /// The scope's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scope({:?})", &*self.0)
    }
}

/// An idempotency key: a [`Scope`] plus the key's bytes.
///
/// Key bytes are arbitrary (Kafka headers are bytes): non-UTF-8 keys are valid and are stored and
/// compared as bytes, never through a lossy conversion. A key is 1 to [`MAX_KEY_LEN`] bytes.
/// Cloning is cheap.
///
/// A key hashes (for `HashMap`s, L1) as a 64-bit digest of its scope and bytes made once, when it
/// is built, with the standard library's keyed SipHash under a random key per process: a key meets
/// several hash tables per message, and hashing its bytes each time cost a sixth of the engine's
/// CPU in lease mode by the batch. The digest is keyed, so a producer cannot choose keys that
/// collide in L1.
#[derive(Clone)]
pub struct IdempotencyKey {
    scope: Scope,
    key: Arc<[u8]>,
    hash: u64,
}

/// The key of every `IdempotencyKey`'s digest, drawn once per process.
static KEY_HASHER: LazyLock<RandomState> = LazyLock::new(RandomState::new);

impl PartialEq for IdempotencyKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.scope == other.scope && self.key == other.key
    }
}

impl Eq for IdempotencyKey {}

impl Hash for IdempotencyKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialOrd for IdempotencyKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for IdempotencyKey {
    /// By scope, then by key bytes.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (&self.scope, &self.key).cmp(&(&other.scope, &other.key))
    }
}

impl IdempotencyKey {
    /// Validates and builds a key.
    pub fn new(scope: Scope, key: impl AsRef<[u8]>) -> Result<Self, InputError> {
        let key = key.as_ref();
        if key.is_empty() {
            return Err(InputError::EmptyKey);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(InputError::KeyTooLong {
                len: key.len(),
                max: MAX_KEY_LEN,
            });
        }
        let hash = KEY_HASHER.hash_one((scope.as_str(), key));
        Ok(Self {
            scope,
            key: key.into(),
            hash,
        })
    }

    /// Builds a key from any number of bytes by digesting them: `sha256:` followed by the 64
    /// lowercase hex digits of their SHA-256. Use it where the natural key may exceed
    /// [`MAX_KEY_LEN`]; use it for every key of that kind, since the digest of a value and the value
    /// itself are different keys. An empty input is still an error.
    pub fn digest(scope: Scope, long_key: impl AsRef<[u8]>) -> Result<Self, InputError> {
        let long_key = long_key.as_ref();
        if long_key.is_empty() {
            return Err(InputError::EmptyKey);
        }
        let hex = hex(&Sha256::digest(long_key));
        Self::new(scope, format!("sha256:{hex}"))
    }

    /// Builds a time-ordered key for an event whose id is random (a UUIDv4, a hash, any bytes)
    /// from that id and the event's own time, in milliseconds since the Unix epoch: the text of a
    /// UUIDv7 (RFC 9562) whose 48-bit time is `event_ms` and whose 74 other bits are the first 74
    /// bits of the SHA-256 of `event_id` (`tttttttt-tttt-7aaa-Vbbb-bbbbbbbbbbbb`: `aaa` the
    /// digest's first 12 bits, `V` `8` to `b`, then its next 62). [`uuid7_millis`] reads
    /// `event_ms` back, so new keys land at the right edge of the primary key and in the day's
    /// range of the table partitioned by the key's time, as UUIDv7 ids do (docs/PERFORMANCE.md,
    /// "Time-ordered event ids").
    ///
    /// `event_ms` must be part of the event's identity: every delivery of the event must carry
    /// the same time, so take the time the producer gave the event (a field of its payload or
    /// a header it set once), never the broker's timestamp of a record, which a producer or an
    /// outbox relay that sends the event again stamps anew. A duplicate with another time is
    /// another key, and runs the effect again. Two events with different ids share a key only
    /// with the same millisecond and the same 74 bits of digest.
    ///
    /// [`uuid7_millis`]: Self::uuid7_millis
    ///
    /// # Example
    /// ```
    /// use dedup_core::{IdempotencyKey, Scope};
    ///
    /// # fn main() -> Result<(), dedup_core::InputError> {
    /// let scope = Scope::new("payments")?;
    /// // A UUIDv4 event id, and the time its producer gave the event (`created_ms`).
    /// let key = IdempotencyKey::timed(scope, 1_795_000_000_123, "3f2b8c1e-9d4a-4e6f-b1c2-7a8d9e0f1a2b")?;
    /// assert_eq!(key.key_bytes(), b"01a1ee56-5e7b-7a0a-91d3-e350d97d4ac8");
    /// assert_eq!(key.uuid7_millis(), Some(1_795_000_000_123));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`InputError::EmptyKey`] for an empty id; [`InputError::EventTime`] for a time past what
    /// 48 bits hold (the year 10889).
    pub fn timed(
        scope: Scope,
        event_ms: u64,
        event_id: impl AsRef<[u8]>,
    ) -> Result<Self, InputError> {
        const MAX_MS: u64 = (1 << 48) - 1;
        let event_id = event_id.as_ref();
        if event_id.is_empty() {
            return Err(InputError::EmptyKey);
        }
        if event_ms > MAX_MS {
            return Err(InputError::EventTime { ms: event_ms });
        }
        Self::new(
            scope,
            uuid7_text(event_ms, &Sha256::digest(event_id).into()),
        )
    }

    /// The key's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The key's bytes.
    pub fn key_bytes(&self) -> &[u8] {
        &self.key
    }

    /// When the key was made, in milliseconds since the Unix epoch, if it is a UUIDv7 (RFC 9562:
    /// version 7, variant `10`): 36 bytes of canonical text (`8-4-4-4-12` hex digits, either case),
    /// or its 16 raw bytes. `None` for every other key. Time-ordered keys keep a large window cheap
    /// (docs/PERFORMANCE.md, "Time-ordered event ids").
    ///
    /// Postgres's `dedup_uuid7_ms_v1(bytea)` (migration 20261130000001) answers the same for every
    /// byte string; a test holds the two together. A 16-byte key is read as raw bytes, so a
    /// 16-byte text key can parse as one too (with a time that is usually far off).
    pub fn uuid7_millis(&self) -> Option<u64> {
        uuid7_millis(&self.key)
    }
}

/// The text of a UUIDv7 whose time is `event_ms` (at most 48 bits) and whose 74 other bits are
/// the first 74 of `digest`: [`IdempotencyKey::timed`]'s shape.
pub(crate) fn uuid7_text(event_ms: u64, d: &[u8; 32]) -> String {
    let a = (u16::from(d[0]) << 4) | u16::from(d[1] >> 4);
    let mut b = [0_u8; 8];
    b.copy_from_slice(&d[2..10]);
    let b = u64::from_be_bytes(b) >> 2;
    format!(
        "{:08x}-{:04x}-7{a:03x}-{:04x}-{:012x}",
        event_ms >> 16,
        event_ms & 0xffff,
        0x8000 | (b >> 48),
        b & 0xffff_ffff_ffff
    )
}

/// [`IdempotencyKey::uuid7_millis`] of `key`'s bytes.
fn uuid7_millis(key: &[u8]) -> Option<u64> {
    match key.len() {
        16 if key[6] >> 4 == 7 && key[8] >> 6 == 0b10 => {
            Some(key[..6].iter().fold(0, |t, &b| (t << 8) | u64::from(b)))
        }
        36 => {
            const HYPHENS: [usize; 4] = [8, 13, 18, 23];
            if HYPHENS.iter().any(|&i| key[i] != b'-')
                || key[14] != b'7'
                || !matches!(key[19], b'8' | b'9' | b'a' | b'b' | b'A' | b'B')
            {
                return None;
            }
            let mut time = 0;
            for (i, &c) in key.iter().enumerate() {
                if HYPHENS.contains(&i) {
                    continue;
                }
                let digit = u64::from(char::from(c).to_digit(16)?);
                // The first 12 digits (8 before the first hyphen, 4 after) are the 48-bit time.
                if i < 13 {
                    time = (time << 4) | digit;
                }
            }
            Some(time)
        }
        _ => None,
    }
}

impl fmt::Display for IdempotencyKey {
    /// `scope/key`, with the key shown as text where it is printable UTF-8 and as escaped bytes
    /// otherwise, cut after a few dozen bytes with the full length noted: a log line never holds a
    /// huge or binary value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/", self.scope)?;
        let shown = &self.key[..self.key.len().min(DISPLAY_KEY_BYTES)];
        for chunk in shown.utf8_chunks() {
            for c in chunk.valid().chars() {
                if c.is_control() {
                    write!(f, "{}", c.escape_default())?;
                } else if is_invisible(c) {
                    write!(f, "{}", c.escape_unicode())?;
                } else {
                    write!(f, "{c}")?;
                }
            }
            for b in chunk.invalid() {
                write!(f, "\\x{b:02x}")?;
            }
        }
        if self.key.len() > shown.len() {
            write!(f, "…({} bytes)", self.key.len())?;
        }
        Ok(())
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({self})")
    }
}

/// A digest of a message's payload (or of the part the caller chooses), stored with the key.
///
/// A later claim of the same key with a different fingerprint answers
/// [`ClaimOutcome::PayloadMismatch`](crate::ClaimOutcome::PayloadMismatch): the key was reused
/// for a different operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The SHA-256 of `payload`.
    pub fn of(payload: impl AsRef<[u8]>) -> Self {
        Self(Sha256::digest(payload.as_ref()).into())
    }

    /// A fingerprint the caller computed itself (for example over chosen fields).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest's bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Reads a stored fingerprint; `None` if it is not 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({}…)", hex(&self.0[..6]))
    }
}

/// Format characters (Unicode category Cf) and other invisible code points that change how text
/// around them reads without showing themselves: bidirectional overrides, embeddings and isolates
/// (U+202A-U+202E, U+2066-U+2069: "Trojan Source", CVE-2021-42574), marks, zero-width characters,
/// the byte-order mark, tag characters. `Display` escapes them, so a log line shows what a key
/// holds.
fn is_invisible(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}' | '\u{1160}' | '\u{17B4}' | '\u{17B5}'
        | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{206F}' | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}'
        | '\u{FFA0}' | '\u{FFF0}'..='\u{FFFB}' | '\u{1BCA0}'..='\u{1BCA3}'
        | '\u{1D173}'..='\u{1D17A}' | '\u{E0000}'..='\u{E0FFF}')
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests;
