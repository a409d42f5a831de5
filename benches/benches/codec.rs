//! What a typed result costs: encoding and decoding one result (envelope, tag check and codec)
//! with bincode and with JSON, beside the bytes the store keeps. No server needed.

#![allow(clippy::unwrap_used, missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dedup_core::ResultCodec;
use dedup_core::typed::Codec;
use serde::{Deserialize, Serialize};

/// A typical result: an order's receipt with a few lines.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
struct Receipt {
    order: String,
    customer: u64,
    cents: i64,
    currency: String,
    lines: Vec<Line>,
    settled: bool,
}

#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
struct Line {
    sku: String,
    quantity: u32,
    cents: i64,
}

fn receipt() -> Receipt {
    Receipt {
        order: "ord-2026-11-23-000042".into(),
        customer: 88_120_334,
        cents: 129_900,
        currency: "EUR".into(),
        lines: (0..4)
            .map(|i| Line {
                sku: format!("sku-{i:05}"),
                quantity: i + 1,
                cents: 32_475,
            })
            .collect(),
        settled: true,
    }
}

fn one<C: Codec>(c: &mut Criterion, codec: ResultCodec<Receipt, C>) {
    let value = receipt();
    let bytes = codec.encode(&value).unwrap();
    assert_eq!(codec.decode(&bytes).unwrap(), value);
    let name = codec.codec().name();
    let mut g = c.benchmark_group(format!("typed_result/{name}"));
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("encode", |b| {
        b.iter(|| codec.encode(black_box(&value)).unwrap())
    });
    g.bench_function("decode", |b| {
        b.iter(|| codec.decode(black_box(&bytes)).unwrap())
    });
    g.finish();
    eprintln!("typed_result/{name}: {} stored bytes", bytes.len());
}

fn typed_results(c: &mut Criterion) {
    one(c, ResultCodec::bincode("receipt/v1").unwrap());
    one(c, ResultCodec::json("receipt/v1").unwrap());
}

criterion_group!(benches, typed_results);
criterion_main!(benches);
