//! `Dedup::process_typed` on top of each store: a value in, the same value back on every replay,
//! and a stored result of another type refused with a typed error, never a second run.
//!
//! Replayed equal (bincode, JSON); another tag, codec or layout, or untyped bytes, refused without
//! a second run; an unencodable value fails its key; the types bincode cannot read back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use dedup_core::typed::{CodecError, TypedError};
use dedup_core::{Dedup, HandlerError, ProcessError, ResultCodec, State, Store, TypedProcessed};
use serde::{Deserialize, Serialize, Serializer};

use crate::support::{Boom, key};

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub(crate) struct Receipt {
    pub(crate) order: String,
    pub(crate) cents: i64,
    pub(crate) lines: Vec<(String, u32)>,
}

fn receipt() -> Receipt {
    Receipt {
        order: "o-1".into(),
        cents: 12_345,
        lines: vec![("sku-1".into(), 2), ("sku-ü".into(), 1)],
    }
}

/// Version 2 of the receipt: one more field.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
struct ReceiptV2 {
    order: String,
    cents: i64,
    lines: Vec<(String, u32)>,
    currency: String,
}

pub(crate) async fn typed_result_is_replayed_equal<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(s);
    let codec = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
    let json = ResultCodec::<Receipt, _>::json("receipt/v1").unwrap();
    for (name, k) in [("bincode", key("t-bin")), ("json", key("t-json"))] {
        let runs = AtomicU32::new(0);
        for i in 0..3 {
            let call = |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError<Boom>>(receipt())
            };
            let done = if name == "json" {
                dedup.process_typed(&json, &k, None, call).await.unwrap()
            } else {
                dedup.process_typed(&codec, &k, None, call).await.unwrap()
            };
            assert_eq!(done.executed(), i == 0, "{name}");
            assert!(matches!(
                (&done, i),
                (TypedProcessed::Executed { attempts: 1, .. }, 0)
                    | (TypedProcessed::Replayed { .. }, 1..)
            ));
            assert_eq!(done.into_value(), receipt(), "{name}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
    }
}

/// A deployment that changed the type: under a new tag, or (wrongly) under the old one, the stored
/// result is refused with a typed error and the handler does not run again.
pub(crate) async fn typed_result_of_another_type_is_refused<S: Store>(s: Arc<S>) {
    let dedup = Dedup::new(Arc::clone(&s));
    let v1 = ResultCodec::<Receipt, _>::bincode("receipt/v1").unwrap();
    let k = key("t-1");
    dedup
        .process_typed(&v1, &k, None, |_| async {
            Ok::<_, HandlerError<Boom>>(receipt())
        })
        .await
        .unwrap();
    let runs = AtomicU32::new(0);
    let never = |_| async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, HandlerError<Boom>>(ReceiptV2 {
            order: "x".into(),
            cents: 0,
            lines: vec![],
            currency: "EUR".into(),
        })
    };

    let v2 = ResultCodec::<ReceiptV2, _>::bincode("receipt/v2").unwrap();
    let err = dedup.process_typed(&v2, &k, None, never).await.unwrap_err();
    assert!(
        matches!(&err, ProcessError::Undecodable { source: CodecError::OtherType { stored, .. }, .. } if stored == "receipt/v1"),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("receipt/v1"), "{err}");

    // The type changed but the tag did not: the bytes do not decode whole.
    let same_tag = ResultCodec::<ReceiptV2, _>::bincode("receipt/v1").unwrap();
    let err = dedup
        .process_typed(&same_tag, &k, None, never)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ProcessError::Undecodable {
                source: CodecError::Decode { .. },
                ..
            }
        ),
        "{err:?}"
    );

    // Another codec, and a result stored through the bytes API.
    let json = ResultCodec::<Receipt, _>::json("receipt/v1").unwrap();
    let err = dedup
        .process_typed(&json, &k, None, |_| async {
            Ok::<_, HandlerError<Boom>>(receipt())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ProcessError::Undecodable {
                source: CodecError::OtherCodec { .. },
                ..
            }
        ),
        "{err:?}"
    );
    let raw = key("t-raw");
    dedup
        .process(&raw, None, |_| async {
            Ok::<_, HandlerError<Boom>>(dedup_core::Completion::store("plain"))
        })
        .await
        .unwrap();
    let err = dedup
        .process_typed(&v1, &raw, None, |_| async {
            Ok::<_, HandlerError<Boom>>(receipt())
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ProcessError::Undecodable {
                source: CodecError::NotTyped(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Completed);
}

/// A value the codec cannot write: its effect ran, so the key is FAILED, not run again.
pub(crate) async fn typed_result_that_cannot_be_encoded_fails_the_key<S: Store>(s: Arc<S>) {
    #[derive(Debug)]
    struct Unwritable;
    impl Serialize for Unwritable {
        fn serialize<Z: Serializer>(&self, _: Z) -> Result<Z::Ok, Z::Error> {
            Err(serde::ser::Error::custom(
                "this value refuses to be written",
            ))
        }
    }
    impl<'de> Deserialize<'de> for Unwritable {
        fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
            Ok(Self)
        }
    }
    let dedup = Dedup::new(Arc::clone(&s));
    let codec = ResultCodec::<Unwritable, _>::bincode("unwritable").unwrap();
    let k = key("t-enc");
    let err = dedup
        .process_typed(&codec, &k, None, |_| async {
            Ok::<_, HandlerError<Boom>>(Unwritable)
        })
        .await
        .unwrap_err();
    match &err {
        ProcessError::Handler {
            source: TypedError::Encode(CodecError::Encode { .. }),
            ..
        } => {}
        other => panic!("expected an encode error, got {other:?}"),
    }
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("refuses to be written"), "{err}");
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Failed);

    // JSON cannot write a map whose keys are not strings.
    let json = ResultCodec::<BTreeMap<(u8, u8), u8>, _>::json("pairs").unwrap();
    let err = dedup
        .process_typed(&json, &key("t-enc-json"), None, |_| async {
            Ok::<_, HandlerError<Boom>>(BTreeMap::from([((1, 2), 3)]))
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            ProcessError::Handler {
                source: TypedError::Encode(_),
                ..
            }
        ),
        "{err:?}"
    );
}

/// bincode is not self-describing: an untagged enum and `serde_json::Value` are written but
/// cannot be read back. The first run finds it (its effect ran: the key is FAILED, never run
/// again, and never stored as a result no duplicate could read); JSON round-trips both.
pub(crate) async fn typed_results_that_need_a_self_describing_codec<S: Store>(s: Arc<S>) {
    #[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
    #[serde(untagged)]
    enum Answer {
        Number(i64),
        Text(String),
    }
    #[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
    struct Loose {
        answer: Answer,
        extra: serde_json::Value,
    }
    let value = Loose {
        answer: Answer::Text("forty-two".into()),
        extra: serde_json::json!({"a": [1, "two", null]}),
    };
    let dedup = Dedup::new(Arc::clone(&s));
    let runs = AtomicU32::new(0);
    let bin = ResultCodec::<Loose, _>::bincode("loose").unwrap();
    assert!(bin.encode(&value).is_ok(), "bincode writes it");
    assert!(matches!(
        bin.encode_checked(&value),
        Err(CodecError::Decode { .. })
    ));
    let k = key("t-loose-bin");
    for _ in 0..2 {
        let err = dedup
            .process_typed(&bin, &k, None, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError<Boom>>(value.clone())
            })
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                ProcessError::Handler {
                    source: TypedError::Encode(CodecError::Decode { .. }),
                    ..
                } | ProcessError::Failed { .. }
            ),
            "{err:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(s.get(&k).await.unwrap().unwrap().state, State::Failed);

    let json = ResultCodec::<Loose, _>::json("loose").unwrap();
    let k = key("t-loose-json");
    for i in 0..2 {
        let done = dedup
            .process_typed(&json, &k, None, |_| async {
                Ok::<_, HandlerError<Boom>>(value.clone())
            })
            .await
            .unwrap();
        assert_eq!(done.executed(), i == 0);
        assert_eq!(done.value(), &value);
    }
}
