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
        let d = Sha256::digest(event_id);
        let a = (u16::from(d[0]) << 4) | u16::from(d[1] >> 4);
        let mut b = [0_u8; 8];
        b.copy_from_slice(&d[2..10]);
        let b = u64::from_be_bytes(b) >> 2;
        Self::new(
            scope,
            format!(
                "{:08x}-{:04x}-7{a:03x}-{:04x}-{:012x}",
                event_ms >> 16,
                event_ms & 0xffff,
                0x8000 | (b >> 48),
                b & 0xffff_ffff_ffff
            ),
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
mod tests {
    use super::*;

    /// A UUIDv7 is read as text (either case) or as its 16 bytes; anything else, including a
    /// UUID of another version or variant, a bad digit or a misplaced hyphen, is not one.
    #[test]
    fn a_uuid7_key_tells_its_time_and_nothing_else_does() {
        let ms = 0x0190_1234_5678_u64;
        let text = "01901234-5678-7abc-9def-0123456789ab";
        let key = |b: &[u8]| IdempotencyKey::new(scope(), b).expect("valid key");
        assert_eq!(key(text.as_bytes()).uuid7_millis(), Some(ms));
        assert_eq!(key(text.to_uppercase().as_bytes()).uuid7_millis(), Some(ms));
        let raw: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&text.replace('-', "")[2 * i..2 * i + 2], 16).expect("hex"))
            .collect();
        assert_eq!(key(&raw).uuid7_millis(), Some(ms));
        for other in [
            "01901234-5678-4abc-9def-0123456789ab", // version 4
            "01901234-5678-7abc-cdef-0123456789ab", // variant 110
            "01901234-5678-7abc-9def-0123456789ag", // not a hex digit
            "0190123-45678-7abc-9def-0123456789ab", // a hyphen out of place
            "01901234-5678-7abc-9def-0123456789a",  // 35 bytes
            "order-42",
        ] {
            assert_eq!(key(other.as_bytes()).uuid7_millis(), None, "{other}");
        }
        let mut v4 = raw.clone();
        v4[6] = 0x4b;
        assert_eq!(key(&v4).uuid7_millis(), None);
        let mut bad_variant = raw.clone();
        bad_variant[8] = 0xdf;
        assert_eq!(key(&bad_variant).uuid7_millis(), None);
        let mut not_utf8 = text.as_bytes().to_vec();
        not_utf8[0] = 0xff;
        assert_eq!(key(&not_utf8).uuid7_millis(), None);
    }

    fn scope() -> Scope {
        Scope::new("orders").expect("valid scope")
    }

    /// Keys built apart are equal, hash alike and order as (scope, bytes); the digest made at
    /// construction stands in for the bytes only in hashing.
    #[test]
    fn keys_compare_by_content_and_hash_by_their_digest() {
        use std::collections::{BTreeSet, HashMap};
        let s = |n: &str| Scope::new(n).expect("valid scope");
        let a1 = IdempotencyKey::new(s("a"), b"k1").expect("valid key");
        let a1_again = IdempotencyKey::new(s("a"), "k1").expect("valid key");
        let a2 = IdempotencyKey::new(s("a"), b"k2").expect("valid key");
        let b1 = IdempotencyKey::new(s("b"), b"k1").expect("valid key");
        // The scope and the bytes are hashed apart: ("ab", "c") is not ("a", "bc").
        let ab_c = IdempotencyKey::new(s("ab"), b"c").expect("valid key");
        let a_bc = IdempotencyKey::new(s("a"), b"bc").expect("valid key");
        assert_eq!(a1, a1_again);
        assert_ne!(a1, a2);
        assert_ne!(a1, b1);
        assert_ne!(ab_c, a_bc);
        let mut seen = HashMap::new();
        for k in [&a1, &a2, &b1, &ab_c, &a_bc] {
            seen.insert(k.clone(), k.to_string());
        }
        assert_eq!(seen.len(), 5);
        assert_eq!(seen.get(&a1_again), Some(&"a/k1".to_string()));
        let h = RandomState::new();
        assert_eq!(h.hash_one(&a1), h.hash_one(&a1_again));
        let order: Vec<String> = [&b1, &a2, &ab_c, &a1, &a_bc]
            .into_iter()
            .cloned()
            .collect::<BTreeSet<_>>()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(order, ["a/bc", "a/k1", "a/k2", "ab/c", "b/k1"]);
    }

    #[test]
    fn empty_and_oversized_keys_are_rejected() {
        assert_eq!(IdempotencyKey::new(scope(), b""), Err(InputError::EmptyKey));
        let long = vec![b'k'; MAX_KEY_LEN + 1];
        assert_eq!(
            IdempotencyKey::new(scope(), &long),
            Err(InputError::KeyTooLong {
                len: MAX_KEY_LEN + 1,
                max: MAX_KEY_LEN
            })
        );
        assert!(IdempotencyKey::new(scope(), &long[..MAX_KEY_LEN]).is_ok());
    }

    #[test]
    fn bad_scopes_are_rejected() {
        assert_eq!(Scope::new(""), Err(InputError::EmptyScope));
        assert_eq!(Scope::new("a\nb"), Err(InputError::ScopeNotPrintable));
        assert!(matches!(
            Scope::new("s".repeat(MAX_SCOPE_LEN + 1)),
            Err(InputError::ScopeTooLong { .. })
        ));
    }

    #[test]
    fn binary_keys_are_kept_as_bytes_and_displayed_escaped() {
        let raw = IdempotencyKey::new(scope(), b"\xffab\x00").expect("binary key");
        let lossy = IdempotencyKey::new(scope(), "\u{fffd}ab\u{0}").expect("text key");
        assert_ne!(raw, lossy, "a lossy UTF-8 conversion must not merge keys");
        assert_eq!(raw.to_string(), "orders/\\xffab\\u{0}");
    }

    #[test]
    fn bidirectional_and_invisible_characters_are_displayed_escaped() {
        // "invoice-\u{202E}fdp.exe" would print as "invoice-exe.pdf" raw.
        let key = IdempotencyKey::new(scope(), "invoice-\u{202E}fdp.exe").expect("key");
        assert_eq!(key.to_string(), "orders/invoice-\\u{202e}fdp.exe");
        for c in [
            '\u{200B}',
            '\u{200E}',
            '\u{200F}',
            '\u{202A}',
            '\u{2066}',
            '\u{2069}',
            '\u{061C}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{E0041}',
        ] {
            let key = IdempotencyKey::new(scope(), format!("a{c}b")).expect("key");
            let shown = key.to_string();
            assert!(!shown.contains(c), "{c:?} shown raw in {shown:?}");
            assert!(shown.contains(&c.escape_unicode().to_string()), "{shown}");
        }
        // Ordinary non-ASCII text is still shown as text.
        let key = IdempotencyKey::new(scope(), "zahlung-über-€5").expect("key");
        assert_eq!(key.to_string(), "orders/zahlung-über-€5");
        assert_eq!(
            Scope::new("orders\u{202E}"),
            Err(InputError::ScopeNotPrintable)
        );
    }

    #[test]
    fn display_never_dumps_a_long_key() {
        let key = IdempotencyKey::new(scope(), "x".repeat(MAX_KEY_LEN)).expect("valid");
        let shown = key.to_string();
        assert!(shown.len() < 100, "{shown}");
        assert!(shown.ends_with("…(512 bytes)"), "{shown}");
    }

    #[test]
    fn digest_keys_are_fixed_length_and_stable() {
        let a = IdempotencyKey::digest(scope(), vec![7u8; 10_000]).expect("digest");
        let b = IdempotencyKey::digest(scope(), vec![7u8; 10_000]).expect("digest");
        assert_eq!(a, b);
        assert_eq!(a.key_bytes().len(), "sha256:".len() + 64);
        assert_eq!(
            IdempotencyKey::digest(scope(), b""),
            Err(InputError::EmptyKey)
        );
    }

    #[test]
    fn timed_keys_are_uuidv7s_of_the_event_time_and_a_digest_of_the_id() {
        let id = "3f2b8c1e-9d4a-4e6f-b1c2-7a8d9e0f1a2b";
        let ms = 1_795_000_000_123;
        let k = IdempotencyKey::timed(scope(), ms, id).expect("timed");
        let text = std::str::from_utf8(k.key_bytes()).expect("text");
        // Pinned: a change of the format would give every event a new key, and a copy of one
        // processed before an upgrade would run again after it.
        assert_eq!(text, "01a1ee56-5e7b-7a0a-91d3-e350d97d4ac8");
        assert_eq!(k.uuid7_millis(), Some(ms));
        assert_eq!(&text[..13], format!("{:08x}-{:04x}", ms >> 16, ms & 0xffff));
        // The digest's bits, as the doc says: 12, then the variant, then 62.
        let d = Sha256::digest(id.as_bytes());
        let bits = hex(&d[..10]);
        assert_eq!(&text[14..15], "7");
        assert_eq!(&text[15..18], &bits[..3]);
        let b = u64::from_str_radix(&bits[4..20], 16).expect("hex") >> 2;
        assert_eq!(
            &text[19..],
            format!("{:04x}-{:012x}", 0x8000 | (b >> 48), b & 0xffff_ffff_ffff)
        );
        assert!(matches!(&text[19..20], "8" | "9" | "a" | "b"), "{text}");
        // The same event, the same key; another id or another millisecond, another key.
        assert_eq!(IdempotencyKey::timed(scope(), ms, id), Ok(k.clone()));
        assert_ne!(
            IdempotencyKey::timed(scope(), ms, "another").expect("timed"),
            k
        );
        assert_ne!(
            IdempotencyKey::timed(scope(), ms + 1, id).expect("timed"),
            k
        );
        // Keys of later events sort after earlier ones, whatever their ids.
        let later = IdempotencyKey::timed(scope(), ms + 1, "0").expect("timed");
        let earlier = IdempotencyKey::timed(scope(), ms, "zzz").expect("timed");
        assert!(earlier.key_bytes() < later.key_bytes());
        // Bounds.
        assert_eq!(
            IdempotencyKey::timed(scope(), ms, b""),
            Err(InputError::EmptyKey)
        );
        let max = (1 << 48) - 1;
        assert_eq!(
            IdempotencyKey::timed(scope(), max, id)
                .expect("timed")
                .uuid7_millis(),
            Some(max)
        );
        assert_eq!(
            IdempotencyKey::timed(scope(), max + 1, id),
            Err(InputError::EventTime { ms: max + 1 })
        );
        assert_eq!(
            IdempotencyKey::timed(scope(), 0, id)
                .expect("timed")
                .uuid7_millis(),
            Some(0)
        );
    }

    #[test]
    fn scopes_separate_equal_keys() {
        let a = IdempotencyKey::new(Scope::new("tenant-a").expect("scope"), b"k").expect("key");
        let b = IdempotencyKey::new(Scope::new("tenant-b").expect("scope"), b"k").expect("key");
        assert_ne!(a, b);
    }

    #[test]
    fn fingerprints_differ_by_payload() {
        assert_eq!(Fingerprint::of(b"a"), Fingerprint::of(b"a"));
        assert_ne!(Fingerprint::of(b"a"), Fingerprint::of(b"b"));
        let fp = Fingerprint::of(b"a");
        assert_eq!(Fingerprint::from_slice(fp.as_bytes()), Some(fp));
        assert_eq!(Fingerprint::from_slice(b"short"), None);
    }
}
