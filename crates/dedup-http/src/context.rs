//! What a handler finds in its request's extensions ([`IdempotencyContext`]), and what it puts
//! in its response's ([`Committed`], [`DoNotStore`]).
//!
//! A handler whose effect is a transaction marks it on the context: opened
//! ([`IdempotencyContext::transaction_opened`]), then committed or failed. The layer reads the
//! marks once the handler answered: a committed transaction is what the key completes with; one
//! opened and not committed leaves nothing stored, whatever the handler answered.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use dedup_core::typed::CodecError;
use dedup_core::{IdempotencyKey, LeaseContext, StoreError};
use http::Response;

use crate::config::IdempotencyConfig;
use crate::stored;
use crate::tx::OpenTx;

/// What a handler finds in its request's extensions when the layer runs it: the client's key,
/// dedup's key, and the lease it runs under.
#[derive(Clone, Debug)]
pub struct IdempotencyContext {
    client_key: Arc<str>,
    dedup_key: IdempotencyKey,
    lease: LeaseContext,
    config: Arc<IdempotencyConfig>,
    tx: Arc<Mutex<TxMarks>>,
    /// The transaction a transactional layer opened around the key.
    open: Arc<Mutex<OpenSlot>>,
}

/// The transaction a transactional layer holds the key in, while no one else holds it.
#[derive(Debug, Default)]
struct OpenSlot {
    tx: Option<Box<dyn OpenTx>>,
    /// The layer is transactional: the handler's transaction is the layer's, taken once.
    transactional: bool,
    /// The handler took it and gave it back uncommitted: it is only the layer's to roll back.
    returned: bool,
}

/// The marks of the handler's transactions.
#[derive(Debug, Default)]
pub(crate) struct TxMarks {
    /// A transaction was opened.
    pub(crate) opened: bool,
    /// The stored form a transaction committed the key's completion with.
    pub(crate) committed: Option<Bytes>,
    /// A commit whose outcome is unknown.
    pub(crate) unknown: Option<StoreError>,
}

impl IdempotencyContext {
    pub(crate) fn new(
        client_key: Arc<str>,
        lease: LeaseContext,
        config: Arc<IdempotencyConfig>,
    ) -> Self {
        Self {
            client_key,
            dedup_key: lease.lease().key.clone(),
            lease,
            config,
            tx: Arc::default(),
            open: Arc::default(),
        }
    }

    /// The context of a request whose key `open` holds (a transactional layer).
    pub(crate) fn holding(mut self, open: Box<dyn OpenTx>) -> Self {
        self.open = Arc::new(Mutex::new(OpenSlot {
            tx: Some(open),
            transactional: true,
            returned: false,
        }));
        self
    }

    fn slot<T>(&self, f: impl FnOnce(&mut OpenSlot) -> T) -> T {
        f(&mut self.open.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The transaction the layer holds the key in, if the handler did not take it or gave it
    /// back.
    pub(crate) fn take_open(&self) -> Option<Box<dyn OpenTx>> {
        self.slot(|s| s.tx.take())
    }

    /// Whether the layer claimed the key in a transaction of its own (a transactional layer):
    /// the handler's transaction is that one ([`take_transaction`](Self::take_transaction)),
    /// and a request has no other.
    pub fn is_transactional(&self) -> bool {
        self.slot(|s| s.transactional)
    }

    /// The transaction the key was claimed in, under a transactional layer
    /// (`IdempotencyLayer::transactional`; `dedup::Engine::http_tx_layer`): what the handler
    /// writes on it commits with the key's completion, in one commit
    /// ([`OpenTx::commit`]). Taken once: `None` under a lease-mode layer, once taken, and once
    /// given back. Taking it marks the transaction opened
    /// ([`transaction_opened`](Self::transaction_opened)): from then on only its commit stores a
    /// response. `dedup::Engine::begin` takes it.
    pub fn take_transaction(&self) -> Option<Box<dyn OpenTx>> {
        self.transaction_opened();
        self.slot(|s| if s.returned { None } else { s.tx.take() })
    }

    /// Gives back a transaction from [`take_transaction`](Self::take_transaction) that did not
    /// commit: the layer rolls it back as soon as the handler answered (the key is given back,
    /// no attempt spent), rather than when its connection is next used. It is not handed out
    /// again: what was written on it must not commit.
    pub fn return_transaction(&self, open: Box<dyn OpenTx>) {
        self.slot(|s| {
            s.tx = Some(open);
            s.returned = true;
        });
    }

    /// The key the client sent in the `Idempotency-Key` header (the configured header), as
    /// sent: a Structured Field string unquoted (`"p-1"` gives `p-1`), a bare token as is.
    pub fn idempotency_key(&self) -> &str {
        &self.client_key
    }

    /// dedup's key for the request: the layer's scope and `<len>:<tenant>|<len>:<METHOD>
    /// <route>|<client key>` (digested past 512 bytes), as `dedup inspect` and the store know it.
    pub fn dedup_key(&self) -> &IdempotencyKey {
        &self.dedup_key
    }

    /// The lease: a handler whose effect is in Postgres completes it inside its transaction
    /// (`PgStore::complete_in`) with [`stored_form`](Self::stored_form), and marks the
    /// transaction on this context ([`transaction_opened`](Self::transaction_opened), then
    /// [`transaction_committed`](Self::transaction_committed)). `dedup::Engine::begin` does all
    /// of it.
    pub fn lease(&self) -> &LeaseContext {
        &self.lease
    }

    /// What the layer stores for `response`: the bytes to complete the lease with inside the
    /// handler's own transaction.
    ///
    /// # Errors
    /// The response cannot be encoded.
    pub fn stored_form(&self, response: &Response<Bytes>) -> Result<Bytes, CodecError> {
        stored::encode(
            &self.config,
            response.status(),
            response.headers(),
            response.body(),
            self.config.policy.max_result_bytes,
        )
    }

    /// Marks that the handler opens a transaction to complete the key in. From then on the key
    /// completes only with what a transaction committed
    /// ([`transaction_committed`](Self::transaction_committed), or a response marked
    /// [`Committed`]): if none did, the layer stores nothing and gives the key back without
    /// spending an attempt, whatever the handler answers (a 503, a 422), so that a retry runs
    /// again. Call it before beginning the transaction: a begin that fails counts.
    pub fn transaction_opened(&self) {
        self.marks(|m| m.opened = true);
    }

    /// Marks that a transaction completed the key with `stored_form` and committed; returns the
    /// [`Committed`] to put in the response's extensions. The layer completes the key with these
    /// bytes whatever the handler answers afterwards.
    pub fn transaction_committed(&self, stored_form: Bytes) -> Committed {
        self.marks(|m| {
            m.opened = true;
            m.committed = Some(stored_form.clone());
        });
        Committed(stored_form)
    }

    /// Marks that a transaction's commit failed. A failure whose outcome is unknown (the
    /// connection dropped on COMMIT) is read back once the handler answered: the key's record
    /// completed under this lease means the transaction committed; otherwise the key is given
    /// back. Any other failure committed nothing.
    pub fn transaction_failed(&self, error: &StoreError) {
        self.marks(|m| {
            m.opened = true;
            if error.is_outcome_unknown() {
                m.unknown = Some(error.clone());
            }
        });
    }

    fn marks(&self, f: impl FnOnce(&mut TxMarks)) {
        f(&mut self.tx.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// The marks, taken once the handler answered.
    pub(crate) fn take_marks(&self) -> TxMarks {
        std::mem::take(&mut *self.tx.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A response extension: the handler completed the key inside its own transaction with these
/// bytes (from [`IdempotencyContext::stored_form`]) and committed. The layer stores nothing more;
/// the effect and its stored response commit or roll back together.
#[derive(Clone, Debug)]
pub struct Committed(pub(crate) Bytes);

impl Committed {
    /// The bytes the transaction completed the key with.
    pub fn new(stored_form: Bytes) -> Self {
        Self(stored_form)
    }
}

/// A response extension: do not store this response, and give the key back without spending an
/// attempt (the handler knows nothing ran: its transaction rolled back). A retry runs again.
#[derive(Clone, Copy, Debug, Default)]
pub struct DoNotStore;
