//! `kind = "postgres"`: PostgreSQL logical replication. [`pgoutput`] decodes the wire messages,
//! [`values`] maps text values to JSON, [`source`] runs the slot, [`inspect`] reads (and drops)
//! the slot and publication for `refract plan` and `refract drop`; [`tables`] reads whole tables
//! for `refract verify`; [`metrics`] declares every metric the source emits.

pub mod inspect;
pub mod metrics;
pub mod pgoutput;
mod privileges;
pub mod share_lock;
pub mod snapshot;
pub mod source;
pub mod tables;
pub mod values;

pub use inspect::{
    InspectError, Inspection, PgAdmin, PublicationState, ReplicaIdentity, ServerInfo, SlotState,
    TableInfo, UnmatchedTable,
};
