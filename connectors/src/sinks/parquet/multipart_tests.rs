//! Publishing in parts: whole on a local disk and on S3 (moto's server, from PyPI, as
//! scripts/test installs it), and a failed upload aborted on S3, so that no parts are left
//! behind (S3 keeps, and bills, the parts of an upload never completed or aborted).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::{MultipartUpload, PutResult, UploadPart};

use super::*;

#[tokio::test]
async fn large_files_are_uploaded_in_parts_and_appear_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (store, root) =
        crate::sinks::object_json::open_store(&format!("file://{}", dir.path().display())).unwrap();
    let path = root.clone().join("big.parquet");
    let bytes = bytes::Bytes::from(vec![7u8; MULTIPART_THRESHOLD + PART_SIZE / 2]);
    put(&*store, &path, bytes.clone()).await.unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("big.parquet")).unwrap(),
        bytes.to_vec()
    );
    let local = dir.path().join("local.parquet");
    std::fs::write(&local, &bytes).unwrap();
    let from_file = root.clone().join("from-file.parquet");
    put_file(&*store, &from_file, &local).await.unwrap();
    assert!(std::fs::read(dir.path().join("from-file.parquet")).unwrap() == bytes.to_vec());
}

/// moto's S3 server on a free port, with bucket `lake`; killed when dropped.
struct Moto {
    port: u16,
    child: Child,
}

impl Moto {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 (moto[server] is installed by scripts/test)");
        let mut moto = Self { port, child };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto's server exited ({status}): python3 -m pip install 'moto[server]'");
            }
            assert!(Instant::now() < deadline, "moto did not listen within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let created = moto.request("PUT", "/lake");
        assert!(created.starts_with("HTTP/1.1 200"), "{created}");
        moto
    }

    /// An unsigned request (moto does not check signatures) and its whole response.
    fn request(&self, method: &str, target: &str) -> String {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            stream,
            "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }

    fn store(&self) -> AmazonS3 {
        AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{}", self.port))
            .with_allow_http(true)
            .with_bucket_name("lake")
            .with_region("us-east-1")
            .with_access_key_id("test")
            .with_secret_access_key("test")
            .build()
            .unwrap()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real upload whose part number `fail_at` (0-based) fails, as a dropped link would: the
/// parts before it reach the store.
#[derive(Debug)]
struct FailingPart {
    upload: Box<dyn MultipartUpload>,
    next: usize,
    fail_at: usize,
}

#[async_trait]
impl MultipartUpload for FailingPart {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.next += 1;
        if self.next - 1 == self.fail_at {
            return Box::pin(async {
                Err(object_store::Error::Generic {
                    store: "test",
                    source: "the connection was reset".into(),
                })
            });
        }
        self.upload.put_part(data)
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.upload.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.upload.abort().await
    }
}

#[tokio::test]
async fn on_s3_a_large_file_appears_whole_and_a_failed_upload_leaves_no_parts() {
    if !crate::test_support::python_module("moto") {
        return;
    }
    let moto = Moto::start();
    let store = moto.store();
    let bytes = bytes::Bytes::from(
        (0..MULTIPART_THRESHOLD + PART_SIZE / 2)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );

    let whole = Path::from("t/changes/whole.parquet");
    put(&store, &whole, bytes.clone()).await.unwrap();
    let read = store.get(&whole).await.unwrap().bytes().await.unwrap();
    assert!(
        read == bytes,
        "the object read back differs from what was put"
    );
    // A compaction's new state goes up from its local file, a part read at a time.
    let local = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(local.path(), &bytes).unwrap();
    let from_file = Path::from("t/current/part-0.parquet");
    put_file(&store, &from_file, local.path()).await.unwrap();
    let read = store.get(&from_file).await.unwrap().bytes().await.unwrap();
    assert!(read == bytes, "the object put from a file differs from it");
    let uploads = moto.request("GET", "/lake?uploads");
    assert!(!uploads.contains("<Upload>"), "{uploads}");

    // The third part fails: two have reached the store when it does.
    let failed = Path::from("t/changes/failed.parquet");
    let upload = Box::new(FailingPart {
        upload: store.put_multipart(&failed).await.unwrap(),
        next: 0,
        fail_at: 2,
    });
    let error = upload_parts(upload, &failed, parts_of(bytes))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("reset"), "{error}");
    let uploads = moto.request("GET", "/lake?uploads");
    assert!(
        !uploads.contains("<Upload>"),
        "the failed upload was left in progress, its parts kept: {uploads}"
    );
    assert!(matches!(
        store.head(&failed).await,
        Err(object_store::Error::NotFound { .. })
    ));
}
