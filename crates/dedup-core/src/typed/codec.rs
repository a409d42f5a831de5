//! How a typed result becomes bytes: the [`Codec`] trait and the codecs dedup ships.
//!
//! `Bincode` (bincode 1.3.3, pinned; feature `bincode`, on by default) and `Json` (feature
//! `json`). docs/TYPED.md says why bincode 1.3.3.

use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::BoxError;

/// Turns results into bytes and back. A codec must refuse bytes it did not write whole: a decode
/// that leaves bytes unread is an error, never a value.
///
/// The [`name`](Self::name) is stored beside every result, so a result is only ever decoded by
/// the codec that wrote it. Another serde format (postcard, say) is a few lines: see
/// docs/TYPED.md.
pub trait Codec: fmt::Debug + Send + Sync + 'static {
    /// A short, stable name (stored with every result; at most 255 bytes).
    fn name(&self) -> &'static str;

    /// Appends `value`'s encoding to `out`.
    ///
    /// # Errors
    /// The value cannot be written in this format.
    fn encode<T: Serialize + ?Sized>(&self, value: &T, out: &mut Vec<u8>) -> Result<(), BoxError>;

    /// Reads a value from all of `bytes`.
    ///
    /// # Errors
    /// The bytes are not a `T` in this format, or a `T` that leaves bytes unread.
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, BoxError>;
}

/// bincode 1.3.3 (varint integers, little-endian), the default codec: compact and fast, but not
/// self-describing. Types that need `deserialize_any` (untagged or internally tagged enums,
/// `#[serde(flatten)]`, `serde_json::Value`) encode but never decode; use [`Json`] for them.
#[cfg(feature = "bincode")]
#[derive(Clone, Copy, Default, Debug)]
#[non_exhaustive]
pub struct Bincode;

#[cfg(feature = "bincode")]
impl Bincode {
    /// The options used both ways: a decode can neither read past the stored bytes (the limit is
    /// their length, so a corrupt length prefix cannot allocate more) nor stop short of them.
    fn options(limit: usize) -> impl bincode::Options {
        use bincode::Options as _;
        bincode::DefaultOptions::new()
            .with_limit(u64::try_from(limit).unwrap_or(u64::MAX))
            .reject_trailing_bytes()
    }
}

#[cfg(feature = "bincode")]
impl Codec for Bincode {
    fn name(&self) -> &'static str {
        "bincode1"
    }

    fn encode<T: Serialize + ?Sized>(&self, value: &T, out: &mut Vec<u8>) -> Result<(), BoxError> {
        use bincode::Options as _;
        Self::options(usize::MAX)
            .serialize_into(out, value)
            .map_err(|e| BoxError::from(e as Box<dyn std::error::Error + Send + Sync>))
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, BoxError> {
        use bincode::Options as _;
        Self::options(bytes.len())
            .deserialize(bytes)
            .map_err(|e| BoxError::from(e as Box<dyn std::error::Error + Send + Sync>))
    }
}

/// JSON (serde_json): larger and slower than [`Bincode`], but readable in `dedup inspect` and
/// self-describing, so every serde type round-trips.
#[cfg(feature = "json")]
#[derive(Clone, Copy, Default, Debug)]
#[non_exhaustive]
pub struct Json;

#[cfg(feature = "json")]
impl Codec for Json {
    fn name(&self) -> &'static str {
        "json"
    }

    fn encode<T: Serialize + ?Sized>(&self, value: &T, out: &mut Vec<u8>) -> Result<(), BoxError> {
        serde_json::to_writer(out, value).map_err(|e| -> BoxError { std::sync::Arc::new(e) })
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, BoxError> {
        // `from_slice` refuses anything but whitespace after the value.
        serde_json::from_slice(bytes).map_err(|e| -> BoxError { std::sync::Arc::new(e) })
    }
}
