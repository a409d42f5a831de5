//! W3C trace context from message headers (`traceparent`, `tracestate`), with the `otel` feature.
//!
//! The runner asks OpenTelemetry's global propagator (the binary installs the W3C one) to read
//! the headers, and makes the message's span a child of the producer's span, so one trace shows
//! the producer and every consumer decision. Without the feature this is a no-op.

use tracing::Span;

use crate::delivery::Delivery;

#[cfg(feature = "otel")]
struct HeaderExtractor<'a>(&'a Delivery);

#[cfg(feature = "otel")]
impl opentelemetry::propagation::Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.headers.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// Makes `span` a child of the trace context carried in `delivery`'s headers, if any.
#[cfg(feature = "otel")]
pub(crate) fn set_parent(span: &Span, delivery: &Delivery) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if delivery.header("traceparent").is_none() {
        return;
    }
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(delivery)));
    let _ = span.set_parent(cx);
}

/// Without the `otel` feature, trace headers are left alone.
#[cfg(not(feature = "otel"))]
pub(crate) fn set_parent(_span: &Span, _delivery: &Delivery) {}

/// The trace context for a message the handler of `delivery` publishes on the outbox: with the
/// `otel` feature, the current span's (the message's span, a child of the producer's); without
/// it, the consumed message's own `traceparent` and `tracestate`, so the chain stays one trace.
pub(crate) fn context_headers(delivery: &Delivery) -> Vec<(String, Option<bytes::Bytes>)> {
    #[cfg(feature = "otel")]
    {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        struct Out(Vec<(String, Option<bytes::Bytes>)>);
        impl opentelemetry::propagation::Injector for Out {
            fn set(&mut self, key: &str, value: String) {
                self.0
                    .push((key.to_owned(), Some(bytes::Bytes::from(value))));
            }
        }
        let cx = Span::current().context();
        let mut out = Out(Vec::new());
        opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
        if !out.0.is_empty() {
            return out.0;
        }
    }
    ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|name| {
            delivery
                .header(name)
                .map(|v| (name.to_owned(), Some(bytes::Bytes::copy_from_slice(v))))
        })
        .collect()
}
