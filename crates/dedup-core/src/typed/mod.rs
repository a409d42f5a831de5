//! Typed results: a handler returns a value, and every duplicate gets the same value back.
//!
//! A [`ResultCodec`] writes each result as an envelope: a magic (`dT`) and a version, the codec's
//! name, the result type's tag (chosen by the caller: `"receipt/v2"`), then the codec's bytes. A
//! stored result is decoded only when the codec and the tag match and every byte is read. The tag
//! is the guard: a type that changed between deployments under a new tag is a [`CodecError`] that says
//! so, never a panic, never a silent second run. Reading every byte catches most changes made
//! without a new tag, but not all (JSON skips unknown fields; a same-width field change in
//! bincode reads as something else): change the tag with the type. See
//! [`Dedup::process_typed`](crate::Dedup::process_typed).

mod codec;
mod process;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

#[cfg(feature = "bincode")]
pub use codec::Bincode;
pub use codec::Codec;
#[cfg(feature = "json")]
pub use codec::Json;
pub use process::{TypedError, TypedProcessed};

use crate::error::{BoxError, InputError};

/// The first bytes of every typed result: "dT" and the envelope's version.
const MAGIC: [u8; 3] = *b"dT\x01";

/// The longest tag (and codec name) an envelope holds.
pub const MAX_TAG_LEN: usize = 255;

/// Why a typed result could not be written or read. Retrying cannot help: the same bytes and the
/// same type give the same answer.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The value cannot be written by the codec (a map with non-string keys in JSON, say).
    #[error("cannot encode a {tag} result with {codec}: {source}")]
    Encode {
        /// The codec.
        codec: &'static str,
        /// The result type's tag.
        tag: Arc<str>,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
    /// The stored bytes are not a typed result (stored through the bytes API, or damaged).
    #[error("the stored result is not a typed result ({0})")]
    NotTyped(&'static str),
    /// The stored result was written by another codec.
    #[error("the stored result was written with codec {stored:?}, not {expected:?}")]
    OtherCodec {
        /// The codec that wrote it.
        stored: String,
        /// The codec asked to read it.
        expected: &'static str,
    },
    /// The stored result is of another type, or another version of this one.
    #[error("the stored result is a {stored:?}, not a {expected:?} (the result type changed)")]
    OtherType {
        /// The stored tag.
        stored: String,
        /// The tag asked for.
        expected: Arc<str>,
    },
    /// The tags match but the bytes do not decode into the type (it changed without a new tag, or
    /// the codec cannot read this type back: see [`Bincode`]).
    #[error("the stored {tag} result does not decode with {codec}: {source}")]
    Decode {
        /// The codec.
        codec: &'static str,
        /// The tag.
        tag: Arc<str>,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
}

impl CodecError {
    /// Always false: the same bytes and type give the same answer.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Encodes and decodes results of type `T` with codec `C`, under a tag.
///
/// The tag names the type and its version (`"receipt/v1"`). Change it whenever the type changes
/// in a way the codec cannot read across: results stored under the old tag then fail with
/// [`CodecError::OtherType`] instead of decoding into something else. The tag is the caller's
/// (not `std::any::type_name`, which may change with a compiler or a module move).
pub struct ResultCodec<T, C> {
    codec: C,
    tag: Arc<str>,
    _type: PhantomData<fn(T) -> T>,
}

impl<T, C: Clone> Clone for ResultCodec<T, C> {
    fn clone(&self) -> Self {
        Self {
            codec: self.codec.clone(),
            tag: self.tag.clone(),
            _type: PhantomData,
        }
    }
}

impl<T, C: fmt::Debug> fmt::Debug for ResultCodec<T, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResultCodec")
            .field("codec", &self.codec)
            .field("tag", &self.tag)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

#[cfg(feature = "bincode")]
impl<T: Serialize + DeserializeOwned> ResultCodec<T, Bincode> {
    /// Results of `T` under `tag`, with the default codec ([`Bincode`]).
    ///
    /// # Errors
    /// An empty tag, or one longer than [`MAX_TAG_LEN`] bytes.
    pub fn bincode(tag: &str) -> Result<Self, InputError> {
        Self::new(Bincode, tag)
    }
}

#[cfg(feature = "json")]
impl<T: Serialize + DeserializeOwned> ResultCodec<T, Json> {
    /// Results of `T` under `tag`, as JSON.
    ///
    /// # Errors
    /// An empty tag, or one longer than [`MAX_TAG_LEN`] bytes.
    pub fn json(tag: &str) -> Result<Self, InputError> {
        Self::new(Json, tag)
    }
}

impl<T: Serialize + DeserializeOwned, C: Codec> ResultCodec<T, C> {
    /// Results of `T` under `tag`, with `codec`.
    ///
    /// # Errors
    /// An empty tag or codec name, or one longer than [`MAX_TAG_LEN`] bytes.
    pub fn new(codec: C, tag: &str) -> Result<Self, InputError> {
        if tag.is_empty() || tag.len() > MAX_TAG_LEN {
            return Err(InputError::Setting {
                setting: "tag",
                problem: "a result tag is 1 to 255 bytes",
            });
        }
        if codec.name().is_empty() || codec.name().len() > MAX_TAG_LEN {
            return Err(InputError::Setting {
                setting: "codec",
                problem: "a codec's name is 1 to 255 bytes",
            });
        }
        Ok(Self {
            codec,
            tag: tag.into(),
            _type: PhantomData,
        })
    }

    /// The tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The codec.
    pub fn codec(&self) -> &C {
        &self.codec
    }

    /// The stored form of `value`: the envelope and the codec's bytes.
    ///
    /// # Errors
    /// [`CodecError::Encode`] when the codec cannot write the value.
    pub fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        let name = self.codec.name().as_bytes();
        let tag = self.tag.as_bytes();
        let mut out = Vec::with_capacity(MAGIC.len() + 2 + name.len() + tag.len() + 64);
        out.extend_from_slice(&MAGIC);
        // Both lengths are checked at construction (at most 255).
        out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(name);
        out.push(u8::try_from(tag.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(tag);
        self.codec
            .encode(value, &mut out)
            .map_err(|source| CodecError::Encode {
                codec: self.codec.name(),
                tag: self.tag.clone(),
                source,
            })?;
        Ok(Bytes::from(out))
    }

    /// [`encode`](Self::encode), then a decode of what it wrote: a value that could be stored
    /// but never read back (a type bincode cannot read: see [`Bincode`]) is refused before it is
    /// stored, on its first run rather than on its first duplicate. Costs one decode.
    ///
    /// # Errors
    /// [`CodecError::Encode`], or [`CodecError::Decode`] when the bytes do not read back.
    pub fn encode_checked(&self, value: &T) -> Result<Bytes, CodecError> {
        let bytes = self.encode(value)?;
        self.decode(&bytes)?;
        Ok(bytes)
    }

    /// The value stored in `bytes`, if it was written by this codec under this tag and decodes
    /// whole.
    ///
    /// # Errors
    /// A [`CodecError`] saying which check failed.
    pub fn decode(&self, bytes: &[u8]) -> Result<T, CodecError> {
        let rest = bytes
            .strip_prefix(&MAGIC)
            .ok_or(CodecError::NotTyped("no typed-result header"))?;
        let (name, rest) = split_field(rest)?;
        if name != self.codec.name().as_bytes() {
            return Err(CodecError::OtherCodec {
                stored: String::from_utf8_lossy(name).into_owned(),
                expected: self.codec.name(),
            });
        }
        let (tag, payload) = split_field(rest)?;
        if tag != self.tag.as_bytes() {
            return Err(CodecError::OtherType {
                stored: String::from_utf8_lossy(tag).into_owned(),
                expected: self.tag.clone(),
            });
        }
        self.codec
            .decode(payload)
            .map_err(|source| CodecError::Decode {
                codec: self.codec.name(),
                tag: self.tag.clone(),
                source,
            })
    }
}

/// Splits a length-prefixed field off the front.
fn split_field(bytes: &[u8]) -> Result<(&[u8], &[u8]), CodecError> {
    let (&len, rest) = bytes
        .split_first()
        .ok_or(CodecError::NotTyped("the header is cut short"))?;
    if rest.len() < usize::from(len) {
        return Err(CodecError::NotTyped("the header is cut short"));
    }
    Ok(rest.split_at(usize::from(len)))
}

#[cfg(all(test, feature = "bincode"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Receipt {
        id: u64,
        amount: i64,
        note: String,
    }

    #[derive(Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Wider {
        id: u64,
        amount: i64,
        note: String,
        currency: String,
    }

    fn receipt() -> Receipt {
        Receipt {
            id: 7,
            amount: -1250,
            note: "refund".into(),
        }
    }

    #[test]
    fn a_value_comes_back_equal() {
        let c = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
        let bytes = c.encode(&receipt()).unwrap();
        assert_eq!(c.decode(&bytes).unwrap(), receipt());
    }

    #[test]
    fn another_tag_or_codec_is_refused_before_decoding() {
        let v1 = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
        let v2 = ResultCodec::<Receipt, _>::bincode("receipt/v2").unwrap();
        let bytes = v1.encode(&receipt()).unwrap();
        assert!(
            matches!(v2.decode(&bytes), Err(CodecError::OtherType { stored, .. }) if stored == "receipt/v1")
        );
        assert!(matches!(
            v1.decode(b"plain bytes"),
            Err(CodecError::NotTyped(_))
        ));
        assert!(matches!(
            v1.decode(b"dT\x01\x09bin"),
            Err(CodecError::NotTyped(_))
        ));
        assert!(matches!(v1.decode(b""), Err(CodecError::NotTyped(_))));
    }

    #[test]
    fn every_byte_must_be_read() {
        let narrow = ResultCodec::<Receipt, _>::bincode("receipt").unwrap();
        let wide = ResultCodec::<Wider, _>::bincode("receipt").unwrap();
        // A wider value under the same tag: the narrow type would read a prefix of it.
        let bytes = wide
            .encode(&Wider {
                id: 1,
                amount: 2,
                note: "n".into(),
                currency: "EUR".into(),
            })
            .unwrap();
        assert!(matches!(
            narrow.decode(&bytes),
            Err(CodecError::Decode { .. })
        ));
        // And a narrower one cannot fill the wider type.
        let bytes = narrow.encode(&receipt()).unwrap();
        assert!(matches!(
            wide.decode(&bytes),
            Err(CodecError::Decode { .. })
        ));
    }

    #[test]
    fn a_corrupt_length_cannot_allocate_past_the_input() {
        let c = ResultCodec::<Vec<u8>, _>::bincode("blob").unwrap();
        let mut bytes = c.encode(&vec![1, 2, 3]).unwrap().to_vec();
        // The varint length prefix claims 2^64 - 1 bytes.
        let at = bytes.len() - 4;
        bytes.truncate(at);
        bytes.extend_from_slice(&[0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(c.decode(&bytes), Err(CodecError::Decode { .. })));
    }

    #[test]
    fn tags_are_checked() {
        assert!(ResultCodec::<Receipt, _>::bincode("").is_err());
        assert!(ResultCodec::<Receipt, _>::bincode(&"t".repeat(256)).is_err());
        assert!(ResultCodec::<Receipt, _>::bincode(&"t".repeat(255)).is_ok());
    }
}
