//! Verification of a migration (being written).
