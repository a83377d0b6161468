//! Unit tests against the real Redis of the environment contract (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`); every test uses its own key prefix.

use std::sync::Arc;

use redis::AsyncCommands;
use refract_schemas::write::WriteOp;
use refract_schemas::{Offset, Position, Row};
use serde_json::json;

use super::*;

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn prefix(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("refract-unit:{test}:{}:{nanos}", std::process::id())
}

fn config() -> RedisSinkConfig {
    RedisSinkConfig {
        url: url().into(),
        username: None,
        password: None,
        tls_ca_file: None,
        command: RedisDeleteCommand::Unlink,
        cluster: false,
        keys_per_command: 2,
        pipeline_depth: 3,
        second_delete_ms: 0,
        tombstone_ttl_ms: 60_000,
        unhealthy_after_ms: 30_000,
        fallback_file: None,
    }
}

fn pos() -> Position {
    Position {
        partition: "p".into(),
        offset: Offset(1, 0),
    }
}

fn invalidate(key: &str, version: Option<i64>) -> WriteOp {
    WriteOp::Invalidate(Invalidation {
        key: key.into(),
        version,
        position: pos(),
    })
}

async fn client() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test]
async fn applies_the_last_operation_per_key_in_pipelines() {
    if !crate::test_support::redis() {
        return;
    }
    let p = prefix("ops");
    let mut c = client().await;
    for i in 0..8 {
        let _: () = c.set(format!("{p}:k{i}"), "cached").await.unwrap();
    }
    let _: () = c.set(format!("{p}:docs:old"), "x").await.unwrap();
    let doc: Row = json!({"id": 1}).as_object().unwrap().clone().into();
    let mut ops: Vec<WriteOp> = (0..6)
        .map(|i| invalidate(&format!("{p}:k{i}"), None))
        .collect();
    ops.push(invalidate(&format!("{p}:k0"), None));
    ops.push(WriteOp::Document(DocumentOp::Truncate {
        collection: format!("{p}:docs").into(),
        position: pos(),
    }));
    ops.push(WriteOp::Document(DocumentOp::Upsert {
        collection: format!("{p}:docs").into(),
        key: "1".into(),
        doc: Arc::new(doc),
        position: pos(),
    }));
    // Set then invalidated in the same batch: the invalidation (last) wins.
    ops.push(WriteOp::Document(DocumentOp::Upsert {
        collection: p.clone().into(),
        key: "k7".into(),
        doc: Arc::new(Row::new()),
        position: pos(),
    }));
    ops.push(invalidate(&format!("{p}:k7"), None));

    let mut sink = RedisSink::new("cache", config());
    sink.open(&Checkpoint::new()).await.unwrap();
    let report = sink.write(&SinkBatch { seq: 1, ops }).await.unwrap();
    sink.close().await.unwrap();
    assert_eq!(report.coalesced, 2, "k0 twice, k7 set then invalidated");
    for i in [0, 1, 2, 3, 4, 5, 7] {
        let v: Option<String> = c.get(format!("{p}:k{i}")).await.unwrap();
        assert_eq!(v, None, "k{i} deleted");
    }
    let v: Option<String> = c.get(format!("{p}:k6")).await.unwrap();
    assert_eq!(v.as_deref(), Some("cached"), "untouched key stays");
    let v: Option<String> = c.get(format!("{p}:docs:old")).await.unwrap();
    assert_eq!(v, None, "truncated");
    let v: Option<String> = c.get(format!("{p}:docs:1")).await.unwrap();
    assert_eq!(
        v.as_deref(),
        Some(r#"{"id":1}"#),
        "upserted after the truncate"
    );
    let _: () = c.del(format!("{p}:docs:1")).await.unwrap();
    let _: () = c.del(format!("{p}:k6")).await.unwrap();
}

#[tokio::test]
async fn tombstones_keep_the_newest_version() {
    if !crate::test_support::redis() {
        return;
    }
    let p = prefix("tomb");
    let mut c = client().await;
    let mut sink = RedisSink::new(
        "cache",
        RedisSinkConfig {
            command: RedisDeleteCommand::Tombstone,
            tombstone_ttl_ms: 5_000,
            ..config()
        },
    );
    sink.open(&Checkpoint::new()).await.unwrap();
    let _: () = c.set(format!("{p}:a"), "stale value").await.unwrap();
    let batch = |ops| SinkBatch { seq: 1, ops };
    sink.write(&batch(vec![invalidate(&format!("{p}:a"), Some(20))]))
        .await
        .unwrap();
    // An older invalidation replayed after a newer one leaves the newer tombstone.
    sink.write(&batch(vec![invalidate(&format!("{p}:a"), Some(10))]))
        .await
        .unwrap();
    let v: Option<String> = c.get(format!("{p}:a")).await.unwrap();
    assert_eq!(v.as_deref(), Some("refract-tombstone:20"));
    let ttl: i64 = c.pttl(format!("{p}:a")).await.unwrap();
    assert!(ttl > 0 && ttl <= 5_000, "tombstones expire: {ttl}");
    sink.write(&batch(vec![invalidate(&format!("{p}:a"), Some(30))]))
        .await
        .unwrap();
    let v: Option<String> = c.get(format!("{p}:a")).await.unwrap();
    assert_eq!(v.as_deref(), Some("refract-tombstone:30"));
    sink.close().await.unwrap();
    let _: () = c.del(format!("{p}:a")).await.unwrap();
}

#[tokio::test]
async fn the_second_delete_removes_a_value_set_after_the_first() {
    if !crate::test_support::redis() {
        return;
    }
    let p = prefix("second");
    let mut c = client().await;
    let mut sink = RedisSink::new(
        "cache",
        RedisSinkConfig {
            second_delete_ms: 300,
            ..config()
        },
    );
    sink.open(&Checkpoint::new()).await.unwrap();
    let key = format!("{p}:a");
    let _: () = c.set(&key, "v1").await.unwrap();
    sink.write(&SinkBatch {
        seq: 1,
        ops: vec![invalidate(&key, None)],
    })
    .await
    .unwrap();
    let v: Option<String> = c.get(&key).await.unwrap();
    assert_eq!(v, None, "first delete done when write returns");
    // A reader that read the old row before the change writes it back now.
    let _: () = c.set(&key, "stale").await.unwrap();
    // close() waits for the pending second deletes.
    sink.close().await.unwrap();
    let v: Option<String> = c.get(&key).await.unwrap();
    assert_eq!(v, None, "the second delete removed the stale value");
}

#[tokio::test]
async fn an_unreachable_redis_is_a_transient_error_or_the_fallback_file() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let down = RedisSinkConfig {
        url: format!("redis://127.0.0.1:{port}").into(),
        ..config()
    };
    let mut sink = RedisSink::new("cache", down.clone());
    let err = sink.open(&Checkpoint::new()).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-commands.txt");
    let mut sink = RedisSink::new(
        "cache",
        RedisSinkConfig {
            fallback_file: Some(file.display().to_string()),
            ..down
        },
    );
    sink.open(&Checkpoint::new()).await.unwrap();
    sink.write(&SinkBatch {
        seq: 1,
        ops: vec![
            invalidate("product:1:v3", None),
            invalidate("a \"b\"", None),
        ],
    })
    .await
    .unwrap();
    let notice = sink.close().await.unwrap().expect("a notice");
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "\"UNLINK\" \"product:1:v3\"\n\"UNLINK\" \"a \\\"b\\\"\"\n"
    );
    assert!(
        notice.contains("2 commands") && notice.contains("no key was deleted"),
        "{notice}"
    );
}

#[tokio::test]
async fn a_wrong_password_is_permanent() {
    if !crate::test_support::redis() {
        return;
    }
    let mut sink = RedisSink::new(
        "cache",
        RedisSinkConfig {
            username: Some("nobody-refract".into()),
            password: Some("wrong".into()),
            ..config()
        },
    );
    let err = sink.open(&Checkpoint::new()).await.unwrap_err();
    assert!(!err.is_retryable(), "{err}");
}

#[test]
fn escapes_globs_and_quotes() {
    assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    assert_eq!(quote("x\ny\u{1}"), "\"x\\ny\\x01\"");
}

#[test]
fn keys_group_by_hash_slot_and_hash_tags_share_one() {
    let keys = vec!["{user1}:a", "b", "{user1}:c", "b2", "foo{user1}"];
    let groups = connection::by_slot(keys, |k| k);
    assert!(groups.contains(&vec!["{user1}:a", "{user1}:c", "foo{user1}"]));
    assert_eq!(groups.iter().map(Vec::len).sum::<usize>(), 5);
    // `foo` and `{foo}bar`, as in the Redis Cluster specification.
    let groups = connection::by_slot(vec!["foo", "{foo}bar", "{}foo"], |k| k);
    assert_eq!(groups, vec![vec!["foo", "{foo}bar"], vec!["{}foo"]]);
}

#[test]
fn masters_serving_slots_come_from_cluster_nodes() {
    let text = "a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460\n\
                b2 127.0.0.1:7002@17002,host2 master - 0 0 2 connected 5461-10922\n\
                c3 127.0.0.1:7003@17003 master,fail - 0 0 3 connected 10923-16383\n\
                d4 127.0.0.1:7004@17004 slave a1 0 0 1 connected\n\
                e5 127.0.0.1:7005@17005 master - 0 0 5 connected\n";
    assert_eq!(
        connection::parse_masters(text),
        vec![
            ("127.0.0.1".to_owned(), 7001),
            ("127.0.0.1".to_owned(), 7002)
        ]
    );
}
