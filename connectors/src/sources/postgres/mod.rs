//! `kind = "postgres"`: PostgreSQL logical replication. [`pgoutput`] decodes the wire messages,
//! [`values`] maps text values to JSON, [`source`] runs the slot.

pub mod pgoutput;
pub mod source;
pub mod values;
