//! The PostgreSQL source's building blocks (issue 3, in progress): the `pgoutput` message decoder
//! and the text-value mapping. The replication connection, slot management and snapshot are not
//! written yet, so no `kind = "postgres"` source is registered.

pub mod pgoutput;
pub mod values;
