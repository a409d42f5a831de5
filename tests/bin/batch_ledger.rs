//! The batch ledger handler that the transaction-mode tests and the kill-test consumer share: a
//! `TxHandler` writing every acquired message's effect row in one statement on the batch's
//! transaction.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dedup::HandlerError;
use dedup::kafka::{Acquired, Answer, TxHandler};
use dedup::outbox::OutboxMessage;
use sqlx::PgConnection;

/// Writes one `effects` row per acquired message (`key` from the `idempotency-key` header, the
/// fencing token, `worker`). A message whose JSON `amount` is negative is answered as a permanent
/// failure; a key in `failing` is answered as a retryable failure as many times as its count
/// says. With `delay`, the batch then sleeps inside its transaction (for kill tests).
#[derive(Debug, Default)]
pub(crate) struct BatchLedger {
    pub(crate) worker: String,
    pub(crate) delay: Duration,
    pub(crate) failing: Arc<Mutex<HashMap<String, u32>>>,
    /// Messages handed to the handler, counted on every call (parts after a failure too).
    pub(crate) calls: Arc<AtomicU64>,
    /// If set, each call waits inside its transaction until it reads true.
    pub(crate) gate: Option<tokio::sync::watch::Receiver<bool>>,
    /// If set, every message is answered as a permanent failure while it reads true (a dropped
    /// table, a revoked credential: a handler that fails everything).
    pub(crate) broken: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// If set, each booked message publishes `{"charged":"<key>","amount":1,"token":<token>}`
    /// to this topic on the outbox, keyed by its idempotency key (the token says which attempt
    /// queued it).
    pub(crate) publish_to: Option<String>,
}

impl TxHandler for BatchLedger {
    type Error = String;
    type Output = Bytes;

    /// One message: the batch path on a batch of one.
    async fn handle(
        &self,
        tx: &mut PgConnection,
        message: &Acquired,
    ) -> Result<Bytes, HandlerError<String>> {
        let mut answers = self.handle_batch(tx, std::slice::from_ref(message)).await?;
        answers
            .pop()
            .unwrap_or_else(|| Err(HandlerError::Retryable("no answer".to_owned())))
    }

    /// The whole batch's rows in one statement.
    fn handle_batch(
        &self,
        tx: &mut PgConnection,
        batch: &[Acquired],
    ) -> impl std::future::Future<Output = Result<Vec<Answer<Self>>, HandlerError<String>>> + Send
    {
        self.calls.fetch_add(batch.len() as u64, Ordering::Relaxed);
        async move {
            let mut keys = Vec::with_capacity(batch.len());
            let mut tokens = Vec::with_capacity(batch.len());
            let mut answers: Vec<Answer<Self>> = Vec::with_capacity(batch.len());
            for a in batch {
                if self
                    .broken
                    .as_ref()
                    .is_some_and(|b| b.load(Ordering::SeqCst))
                {
                    answers.push(Err(HandlerError::Permanent(
                        "relation \"effects\" does not exist".to_owned(),
                    )));
                    continue;
                }
                let d = a.delivery();
                let key = d
                    .header("idempotency-key")
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default();
                let json: serde_json::Value = match serde_json::from_slice(d.payload_bytes()) {
                    Ok(v) => v,
                    Err(e) => {
                        answers.push(Err(HandlerError::Permanent(format!("payload: {e}"))));
                        continue;
                    }
                };
                if json["amount"].as_i64().unwrap_or(0) < 0 {
                    answers.push(Err(HandlerError::Permanent("negative amount".to_owned())));
                    continue;
                }
                let fail = {
                    let mut failing = self
                        .failing
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    match failing.get_mut(&key) {
                        Some(n) if *n > 0 => {
                            *n -= 1;
                            true
                        }
                        _ => false,
                    }
                };
                if fail {
                    answers.push(Err(HandlerError::Retryable("not yet".to_owned())));
                    continue;
                }
                if let Some(topic) = &self.publish_to {
                    let m = OutboxMessage::new(
                        topic.clone(),
                        format!(r#"{{"charged":"{key}","amount":1,"token":{}}}"#, a.token()),
                    )
                    .with_key(key.clone());
                    if let Err(e) = a.publish(m) {
                        answers.push(Err(HandlerError::Permanent(e.to_string())));
                        continue;
                    }
                }
                answers.push(Ok(Bytes::from(format!("booked {key}"))));
                keys.push(key);
                tokens.push(a.token());
            }
            sqlx::query(
                "INSERT INTO effects (key, token, worker) SELECT k, t, $3 FROM unnest($1::text[], $2::int8[]) AS u(k, t)",
            )
            .bind(&keys)
            .bind(&tokens)
            .bind(&self.worker)
            .execute(&mut *tx)
            .await
            .map_err(|e| HandlerError::Retryable(e.to_string()))?;
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            if let Some(gate) = &self.gate {
                let mut gate = gate.clone();
                let _ = gate.wait_for(|open| *open).await;
            }
            Ok(answers)
        }
    }
}
