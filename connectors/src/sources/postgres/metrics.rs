//! Every metric the PostgreSQL source emits, in one place: its name, its labels, what it
//! measures. The runtime's Prometheus recorder (`/metrics` of the status server) exports them.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`SLOT_RETAINED_WAL_BYTES`] | gauge | `slot` |
//! | [`SLOT_LAG_BYTES`] | gauge | `slot` |

/// Bytes of WAL the replication slot holds back on the server (`pg_current_wal_lsn()` minus the
/// slot's `restart_lsn`), measured each time the reader checks the slot.
pub const SLOT_RETAINED_WAL_BYTES: &str = "refract_slot_retained_wal_bytes";
/// Bytes of WAL the slot is behind the server's current position (`pg_current_wal_lsn()` minus
/// the slot's `confirmed_flush_lsn`): what the pipeline has yet to read and make durable,
/// measured with [`SLOT_RETAINED_WAL_BYTES`]. It counts all WAL, not only the published
/// tables': an idle pipeline on a busy server shows the server's traffic since its last
/// confirmation (the slot follows the server on each keepalive).
pub const SLOT_LAG_BYTES: &str = "refract_slot_lag_bytes";

/// Label: the replication slot's name.
const SLOT: &str = "slot";

/// The metric handles of one source's slot.
pub(crate) struct SlotMetrics {
    slot: String,
    /// [`SLOT_RETAINED_WAL_BYTES`], built at the first measurement: until the slot has been
    /// measured the gauge is absent rather than 0 (an initial snapshot read before the stream
    /// can take minutes).
    retained_wal: Option<::metrics::Gauge>,
    /// [`SLOT_LAG_BYTES`], built at the first measurement like `retained_wal`.
    lag: Option<::metrics::Gauge>,
}

impl SlotMetrics {
    /// The handles for slot `slot` (none registered yet).
    pub(crate) fn new(slot: &str) -> Self {
        Self {
            slot: slot.to_owned(),
            retained_wal: None,
            lag: None,
        }
    }

    /// Records the slot's retained WAL, in bytes.
    pub(crate) fn retained_wal(&mut self, bytes: u64) {
        let slot = &self.slot;
        self.retained_wal
            .get_or_insert_with(|| ::metrics::gauge!(SLOT_RETAINED_WAL_BYTES, SLOT => slot.clone()))
            .set(bytes as f64);
    }

    /// Records how far the slot is behind the server, in bytes.
    pub(crate) fn lag(&mut self, bytes: u64) {
        let slot = &self.slot;
        self.lag
            .get_or_insert_with(|| ::metrics::gauge!(SLOT_LAG_BYTES, SLOT => slot.clone()))
            .set(bytes as f64);
    }
}
