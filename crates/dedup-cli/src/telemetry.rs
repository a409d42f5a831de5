//! Logs to stderr, and spans over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set. Only the binary
//! installs these; the libraries use `tracing` alone.
//!
//! Spans go over OTLP/HTTP (protobuf) with the W3C propagator, and the exporter is shut down at
//! exit so that the last batch is sent.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Keeps the exporter alive; [`Telemetry::shutdown`] flushes the last spans.
#[derive(Debug)]
pub(crate) struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the subscriber. `RUST_LOG` filters the log lines (default `error`: the report counts the rest); exported spans
    /// are dedup's own at `info`, never the HTTP client's.
    pub(crate) fn init() -> Result<Self, String> {
        // W3C trace context, read from and written to Kafka headers.
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(
                EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("error")),
            );
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty());
        let Some(endpoint) = endpoint else {
            tracing_subscriber::registry()
                .with(logs)
                .try_init()
                .map_err(|e| e.to_string())?;
            return Ok(Self { provider: None });
        };
        // The endpoint comes from the environment (with `/v1/traces` appended), as OTLP says.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| format!("OTEL_EXPORTER_OTLP_ENDPOINT={endpoint}: {e}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name("dedup")
                    .build(),
            )
            .build();
        let spans = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("dedup"))
            .with_filter(EnvFilter::new(
                "info,h2=off,hyper=off,hyper_util=off,tonic=off,reqwest=off,rdkafka=off,sqlx=off",
            ));
        tracing_subscriber::registry()
            .with(logs)
            .with(spans)
            .try_init()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            provider: Some(provider),
        })
    }

    /// Flushes and stops the exporter (without it the last spans are lost).
    pub(crate) fn shutdown(self) {
        if let Some(p) = self.provider
            && let Err(e) = p.shutdown()
        {
            eprintln!("dedup: exporting the last spans failed: {e}");
        }
    }
}
