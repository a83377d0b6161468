//! The reader's control connection, kept honest: every query on it is bounded, a failure is
//! logged at warn, recorded for `/health` and answered with a fresh connection; and the
//! replication connection's read deadline (see [`super::liveness`]), whose heartbeat goes out
//! on the control connection.

use super::liveness::{HEARTBEAT_PREFIX, Verdict};
use super::*;

impl Reader {
    /// A tick of the read deadline: writes a heartbeat on a quiet stream; returns why the
    /// stream ends once it has been silent past the deadline.
    pub(super) async fn deadline_tick(&mut self, liveness: &mut Liveness) -> Option<Ended> {
        match liveness.tick(self.heard, Instant::now()) {
            Verdict::Heard => {
                self.health.connected();
                None
            }
            Verdict::Alive => None,
            Verdict::Quiet => {
                self.heartbeat().await;
                None
            }
            Verdict::Dead(quiet) => {
                let reason = format!(
                    "nothing received for {} ms (`read_timeout_ms` = {}): the connection is considered dead",
                    quiet.as_millis(),
                    self.read_timeout.as_millis()
                );
                tracing::warn!(slot = %self.slot, quiet_ms = quiet.as_millis() as u64, "replication stream silent past its read deadline: reopening it");
                Some(Ended::Lost(reason))
            }
        }
    }

    /// Writes the heartbeat message that keeps an idle stream talking.
    async fn heartbeat(&mut self) {
        let sent = self.bounded(async {
            emit_message(&self.catalog, HEARTBEAT_PREFIX, "")
                .await
                .map_err(|e| e.to_string())
        });
        match sent.await {
            Ok(_) => self.health.check_passed(),
            Err(e) => {
                self.control_failed("cannot write the heartbeat message", &e)
                    .await;
            }
        }
    }

    /// Runs `check` on the control connection within its bound (see
    /// [`Liveness::control_timeout`]); its error as text.
    pub(super) async fn bounded<T>(
        &self,
        check: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        let bound = Liveness::control_timeout(self.read_timeout);
        tokio::time::timeout(bound, check)
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "no answer on the control connection within {} ms",
                    bound.as_millis()
                ))
            })
    }

    /// A check on the control connection failed: logs it, records it for `/health`, and
    /// replaces the connection when a new one opens within the bound (the old one may be dead,
    /// or left inside a transaction by a check cut short).
    pub(super) async fn control_failed(&mut self, what: &str, error: &str) {
        tracing::warn!(slot = %self.slot, error = %error, "{what}: the control connection (slot checks, heartbeats) fails");
        self.health.check_failed(&format!("{what}: {error}"));
        let bound = Liveness::control_timeout(self.read_timeout);
        if let Ok(Ok(client)) = tokio::time::timeout(bound, connect(self.url.expose())).await {
            self.catalog = client;
        }
    }

    /// Decodes a data message that needs a catalog look-up, within [`CATALOG_TIMEOUT`]; returns
    /// why the stream ends when the look-up fails (the control connection is likely gone, and
    /// the stream is reopened with a new one).
    pub(super) async fn data_looked_up(&mut self, data: Bytes) -> Option<Ended> {
        match tokio::time::timeout(CATALOG_TIMEOUT, self.data(data)).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(Ended::Lost(e.to_string())),
            Err(_) => Some(Ended::Lost(format!(
                "a catalog look-up got no answer within {} s",
                CATALOG_TIMEOUT.as_secs()
            ))),
        }
    }
}
