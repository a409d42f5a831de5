//! The benches live in `benches/`; this crate has no code of its own.
