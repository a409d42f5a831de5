//! The keys' unit tests: scopes and keys checked, UUIDv7 times read, display and fingerprints.

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
