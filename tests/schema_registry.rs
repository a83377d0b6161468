//! The schema registry client against a registry speaking Confluent's REST API
//! ([`common::registry::TestRegistry`]): registration and fetch, the id cache, unknown ids, an
//! outage ridden out by retries, the fallback files, basic auth.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use refract_connectors::schema_registry::{RegistryError, SchemaRegistry};
use refract_schemas::avro::{connect_schema, parse_schema};

use common::registry::TestRegistry;

/// A Debezium-style value schema, as AvroConverter writes it (Connect names on the types).
const ORDERS: &str = r#"{"type":"record","name":"Value","namespace":"dbserver1.public.orders","fields":[
    {"name":"id","type":"int"},
    {"name":"created_at","type":{"type":"long","connect.version":1,"connect.name":"io.debezium.time.MicroTimestamp"}},
    {"name":"amount","type":["null",{"type":"bytes","scale":2,"precision":12,"connect.version":1,
        "connect.parameters":{"scale":"2","connect.decimal.precision":"12"},
        "connect.name":"org.apache.kafka.connect.data.Decimal","logicalType":"decimal"}],"default":null}],
    "connect.name":"dbserver1.public.orders.Value"}"#;

/// Retries fast enough for tests: the policy, not its timing, is under test.
const QUICK_BACKOFF: Duration = Duration::from_millis(10);

fn client(registry: &TestRegistry) -> SchemaRegistry {
    SchemaRegistry::new(&registry.url.as_str().into(), None, None, None).unwrap()
}

/// Waits until `done` holds, failing the test after 10 s.
async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `f` on the runtime with a deadline, so a hung client fails the test.
async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("the client answered in time")
}

#[tokio::test]
async fn registered_schemas_are_fetched_with_their_connect_names() {
    let registry = TestRegistry::start();
    let schema = parse_schema(ORDERS).unwrap();
    let writer = client(&registry);
    let id = within(writer.register("orders-value", &schema))
        .await
        .unwrap();
    assert_eq!(
        within(writer.register("orders-value", &schema))
            .await
            .unwrap(),
        id,
        "the same schema keeps its id"
    );

    let fetched = within(client(&registry).schema(id)).await.unwrap();
    assert_eq!(fetched.canonical_form(), schema.canonical_form());
    // The Connect names went to the registry and came back: the decoder will see them.
    let connect = connect_schema(&fetched).unwrap();
    assert_eq!(
        connect["fields"][1]["name"],
        "io.debezium.time.MicroTimestamp"
    );
    assert_eq!(connect["fields"][2]["parameters"]["scale"], "2");
}

#[tokio::test]
async fn fetched_schemas_are_cached() {
    let registry = TestRegistry::start();
    let id = registry.insert(ORDERS);
    let reader = client(&registry);
    let first = within(reader.schema(id)).await.unwrap();
    assert_eq!(registry.requests(), 1);
    let second = within(reader.schema(id)).await.unwrap();
    assert_eq!(
        registry.requests(),
        1,
        "the second fetch came from the cache"
    );
    assert!(std::sync::Arc::ptr_eq(&first, &second));
}

#[tokio::test]
async fn unknown_ids_are_bad_input_without_retries() {
    let registry = TestRegistry::start();
    registry.insert(ORDERS);
    let reader = client(&registry).with_retry(5, QUICK_BACKOFF);
    let err = within(reader.schema(999)).await.unwrap_err();
    assert!(matches!(err, RegistryError::UnknownSchema(999)), "{err:?}");
    assert!(!err.is_retryable());
    assert_eq!(registry.requests(), 1, "a 404 is not retried");
}

#[tokio::test]
async fn an_outage_is_ridden_out_by_retries() {
    let registry = TestRegistry::start();
    let id = registry.insert(ORDERS);
    registry.set_down(true);
    let reader = client(&registry).with_retry(1000, QUICK_BACKOFF);
    let fetch = tokio::spawn(async move { reader.schema(id).await });
    wait_for("two refused attempts", || registry.requests() >= 2).await;
    assert!(
        !fetch.is_finished(),
        "still retrying while the registry is down"
    );
    registry.set_down(false);
    let schema = within(fetch).await.unwrap().unwrap();
    assert_eq!(
        schema.canonical_form(),
        parse_schema(ORDERS).unwrap().canonical_form()
    );
    assert!(registry.requests() >= 3);
}

#[tokio::test]
async fn a_fallback_file_stands_in_for_a_registry_that_stays_down() {
    let registry = TestRegistry::start();
    let id = registry.insert(ORDERS);
    registry.set_down(true);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(format!("{id}.avsc")), ORDERS).unwrap();
    let reader = SchemaRegistry::new(
        &registry.url.as_str().into(),
        None,
        None,
        Some(dir.path().to_owned()),
    )
    .unwrap()
    .with_retry(3, QUICK_BACKOFF);

    let schema = within(reader.schema(id)).await.unwrap();
    assert_eq!(
        registry.requests(),
        3,
        "the fallback only after every attempt"
    );
    let connect = connect_schema(&schema).unwrap();
    assert_eq!(
        connect["fields"][1]["name"],
        "io.debezium.time.MicroTimestamp"
    );

    // No file for this id: unavailable, and worth retrying later.
    let err = within(reader.schema(id + 1)).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Unavailable { attempts: 3, .. }),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert_eq!(registry.requests(), 6);
}

#[tokio::test]
async fn basic_auth_is_sent_and_the_password_never_shown() {
    let registry = TestRegistry::start_with_auth("svc", "hunter2");
    let id = registry.insert(ORDERS);

    let anonymous = client(&registry);
    let err = within(anonymous.schema(id)).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::Rejected { status: 401, .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());

    let given = SchemaRegistry::new(
        &registry.url.as_str().into(),
        Some("svc".into()),
        Some("hunter2".into()),
        None,
    )
    .unwrap();
    within(given.schema(id)).await.unwrap();

    let in_url = registry.url.replace("http://", "http://svc:hunter2@");
    let from_url = SchemaRegistry::new(&in_url.into(), None, None, None).unwrap();
    within(from_url.schema(id)).await.unwrap();

    let wrong = registry.url.replace("http://", "http://svc:wrong-secret@");
    let err = within(
        SchemaRegistry::new(&wrong.clone().into(), None, None, None)
            .unwrap()
            .schema(id),
    )
    .await
    .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("wrong-secret"), "{shown}");

    registry.set_down(true);
    let err = within(
        SchemaRegistry::new(&wrong.clone().into(), None, None, None)
            .unwrap()
            .with_retry(2, QUICK_BACKOFF)
            .schema(id),
    )
    .await
    .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(err.is_retryable(), "{shown}");
    assert!(!shown.contains("wrong-secret"), "{shown}");
}
