//! Offsets in the transaction, the runner's half: reading the stored positions when partitions
//! are assigned. The rebalance callback runs inside `recv()` and cannot await, so the query runs
//! on a thread of its own (its own small runtime and connection, whatever runtime the runner is
//! on) and the callback waits for it up to a bound; past it, or on an error, the partitions
//! start from Kafka's committed offsets, which is safe: claims deduplicate what is read again.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use tracing::warn;

use crate::consumer::StartOffsets;

type Positions = HashMap<(String, i32), i64>;
type Reply = mpsc::Sender<Option<Positions>>;
type Request = (Vec<(String, i32)>, Reply);

/// Asks the reader thread for stored positions and waits up to a bound.
pub(crate) struct OffsetReader {
    requests: Mutex<mpsc::Sender<Request>>,
    wait: Duration,
}

impl OffsetReader {
    /// Starts the reader thread for `group` on a database of `options`. It ends when the reader
    /// is dropped.
    pub(crate) fn start(
        options: Arc<PgConnectOptions>,
        group: String,
        wait: Duration,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("dedup-offsets".to_owned())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                let mut conn: Option<PgConnection> = None;
                while let Ok((partitions, reply)) = rx.recv() {
                    let got = rt.block_on(async {
                        if conn.is_none() {
                            conn = options
                                .connect()
                                .await
                                .map_err(|e| warn!(error = %e, "offsets: connecting"))
                                .ok();
                        }
                        let c = conn.as_mut()?;
                        match dedup_pg::stored_offsets_on(c, &group, &partitions).await {
                            Ok(found) => Some(found),
                            Err(e) => {
                                warn!(error = %e, "offsets: reading the stored positions");
                                conn = None;
                                None
                            }
                        }
                    });
                    let _ = reply.send(got);
                }
            })?;
        Ok(Self {
            requests: Mutex::new(tx),
            wait,
        })
    }
}

impl StartOffsets for OffsetReader {
    fn stored(&self, partitions: &[(String, i32)]) -> Option<Positions> {
        let (reply, answer) = mpsc::channel();
        self.requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send((partitions.to_vec(), reply))
            .ok()?;
        match answer.recv_timeout(self.wait) {
            Ok(found) => found,
            Err(_) => {
                warn!(wait = ?self.wait, "offsets: no stored positions in time; starting from Kafka's committed offsets");
                None
            }
        }
    }
}
