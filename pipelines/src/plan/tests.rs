use refract_connectors::sources::postgres::{
    PublicationState, ReplicaIdentity, ServerInfo, SlotState, TableInfo,
};
use refract_projections::{Projection, ProjectionError, WriteOp};
use refract_schemas::config::{SourceConfig, load_str};
use refract_schemas::{ChangeEvent, TableId};

use super::*;

const PIPELINE: &str = r#"[pipeline]
name = "shop"

[source]
kind = "postgres"
url = "postgres://postgres@127.0.0.1:5432/refract"
tables = ["public.*"]

[projections.replica]
kind = "replica"
tables = ["public.products", "public.orders", "public.events"]
sinks = ["n"]

[sinks.n]
kind = "null"
"#;

/// A projection that renders keys from non-key columns (like cache invalidation would).
struct NeedsSku;

impl Projection for NeedsSku {
    fn reads(&self, table: &TableId) -> bool {
        table.matches("public.products")
    }
    fn before_image_columns(&self, _table: &TableId) -> Vec<String> {
        vec!["id".into(), "sku".into()]
    }
    fn project(
        &mut self,
        _event: &ChangeEvent,
        _now_ms: i64,
        _out: &mut Vec<WriteOp>,
    ) -> Result<(), ProjectionError> {
        Ok(())
    }
}

fn table(name: &str, identity: ReplicaIdentity, pk: &[&str], toastable: &[&str]) -> TableInfo {
    TableInfo {
        schema: "public".into(),
        name: name.into(),
        replica_identity: identity,
        primary_key: pk.iter().map(|s| s.to_string()).collect(),
        identity_index: None,
        columns: vec!["id".into(), "sku".into(), "note".into()],
        toastable: toastable.iter().map(|s| s.to_string()).collect(),
    }
}

fn inspection(slot: Option<SlotState>, tables: Vec<TableInfo>) -> Inspection {
    Inspection {
        server: ServerInfo {
            version: "15.4".into(),
            version_num: 150_004,
            wal_level: "logical".into(),
            max_slot_wal_keep_size: Some("-1".into()),
            user: "postgres".into(),
            can_replicate: true,
            database: "refract".into(),
        },
        slot_name: "refract_shop".into(),
        slot,
        publication_name: "refract_shop".into(),
        publication: Some(PublicationState {
            name: "refract_shop".into(),
            all_tables: false,
            publishes: vec!["insert".into(), "update".into(), "delete".into()],
        }),
        tables,
        unmatched: vec![],
        file_tables: None,
    }
}

fn run(inspection: &Inspection, extra: Option<Box<dyn Projection>>) -> (Vec<String>, Vec<String>) {
    let loaded = load_str("p.toml", PIPELINE, &|_| None, None).unwrap();
    let SourceConfig::Postgres(pg) = &loaded.config.source else {
        unreachable!()
    };
    let mut projections: Vec<(String, Box<dyn Projection>)> = loaded
        .config
        .projections
        .iter()
        .map(|(n, p)| (n.clone(), refract_projections::build(p)))
        .collect();
    if let Some(p) = extra {
        projections.push(("cache".into(), p));
    }
    let found = findings("p.toml", &loaded.config, pg, inspection, &projections);
    let (warnings, notes): (Vec<_>, Vec<_>) = found.into_iter().partition(|f| f.warning);
    (
        warnings.into_iter().map(|f| f.text).collect(),
        notes.into_iter().map(|f| f.text).collect(),
    )
}

#[test]
fn replica_warns_only_for_tables_without_identity_and_notes_toast() {
    let i = inspection(
        None,
        vec![
            table("products", ReplicaIdentity::Default, &["id"], &["note"]),
            table("orders", ReplicaIdentity::Full, &["id"], &["note"]),
            table("events", ReplicaIdentity::Default, &[], &[]),
        ],
    );
    let (warnings, notes) = run(&i, None);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("`public.events` has no primary key and REPLICA IDENTITY DEFAULT")
            && warnings[0].contains("rejects its UPDATE and DELETE")
            && warnings[0].contains("refract has no key"),
        "{warnings:?}"
    );
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(
        notes[0].contains("`public.products`") && notes[0].contains("TOASTed"),
        "{notes:?}"
    );
    assert!(
        notes[1].contains("`public.events` has no primary key: the initial snapshot"),
        "{notes:?}"
    );
}

#[test]
fn a_projection_needing_old_columns_is_warned_unless_the_identity_sends_them() {
    let default = inspection(
        None,
        vec![table("products", ReplicaIdentity::Default, &["id"], &[])],
    );
    let (warnings, _) = run(&default, Some(Box::new(NeedsSku)));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .contains("projection `cache` needs (sku) from the old row of `public.products`")
            && warnings[0].contains("REPLICA IDENTITY FULL"),
        "{warnings:?}"
    );
    let full = inspection(
        None,
        vec![table("products", ReplicaIdentity::Full, &["id"], &[])],
    );
    assert!(run(&full, Some(Box::new(NeedsSku))).0.is_empty());
    let mut by_index = table("products", ReplicaIdentity::Index, &["id"], &[]);
    by_index.identity_index = Some(("products_id_sku".into(), vec!["id".into(), "sku".into()]));
    assert!(
        run(&inspection(None, vec![by_index]), Some(Box::new(NeedsSku)))
            .0
            .is_empty()
    );
}

#[test]
fn a_lost_slot_says_how_to_recover_and_an_unread_table_is_named() {
    let slot = SlotState {
        name: "refract_shop".into(),
        slot_type: "logical".into(),
        plugin: Some("pgoutput".into()),
        database: Some("refract".into()),
        in_this_database: true,
        active: false,
        active_pid: None,
        wal_status: Some("lost".into()),
        restart_lsn: None,
        confirmed_flush_lsn: Some("0/16B3748".into()),
        retained_wal_bytes: None,
        safe_wal_size: None,
    };
    let i = inspection(
        Some(slot),
        vec![table("audit", ReplicaIdentity::Full, &["id"], &[])],
    );
    let (warnings, _) = run(&i, None);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("invalidated (wal_status = lost)")
                && w.contains("refract drop p.toml --yes")
                && w.contains("refract backfill")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("`public.audit` is published but no projection reads it")),
        "{warnings:?}"
    );
}

#[test]
fn a_slot_retaining_more_than_the_limit_is_warned() {
    let slot = SlotState {
        name: "refract_shop".into(),
        slot_type: "logical".into(),
        plugin: Some("pgoutput".into()),
        database: Some("refract".into()),
        in_this_database: true,
        active: false,
        active_pid: None,
        wal_status: Some("extended".into()),
        restart_lsn: Some("0/1000000".into()),
        confirmed_flush_lsn: Some("0/1000000".into()),
        retained_wal_bytes: Some(3 << 30),
        safe_wal_size: None,
    };
    let i = inspection(
        Some(slot),
        vec![table("orders", ReplicaIdentity::Full, &["id"], &[])],
    );
    let (warnings, _) = run(&i, None);
    assert!(
        warnings
            .iter()
            .any(|w| w
                .contains("retains 3.0 GiB of WAL, more than `max_retained_wal_mb` (1024 MiB)")),
        "{warnings:?}"
    );
}

#[test]
fn bytes_are_pretty() {
    assert_eq!(pretty_bytes(0), "0 B");
    assert_eq!(pretty_bytes(1023), "1023 B");
    assert_eq!(pretty_bytes(1536), "1.5 KiB");
    assert_eq!(pretty_bytes(16 * 1024 * 1024), "16.0 MiB");
    assert_eq!(pretty_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
}
