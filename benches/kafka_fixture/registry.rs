//! The least of a Confluent schema registry the Kafka source needs: `GET /schemas/ids/{id}`,
//! served from a thread on a free loopback port, one request per connection. The source fetches
//! each schema once and caches it, so this is off the measured path.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;

/// Starts serving `schemas` (id, Avro schema text); returns the base URL.
pub fn serve(schemas: Vec<(u32, String)>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("registry port");
    let url = format!(
        "http://{}",
        listener.local_addr().expect("registry address")
    );
    let schemas = Arc::new(schemas);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(&stream);
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            // The headers: read up to the empty line; a GET has no body.
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let id = request
                .split_whitespace()
                .nth(1)
                .and_then(|path| path.strip_prefix("/schemas/ids/"))
                .and_then(|id| id.parse::<u32>().ok());
            let found = id.and_then(|id| schemas.iter().find(|(i, _)| *i == id));
            let (status, body) = match found {
                Some((_, text)) => ("200 OK", serde_json::json!({ "schema": text })),
                None => (
                    "404 Not Found",
                    serde_json::json!({"error_code": 40403, "message": "Schema not found"}),
                ),
            };
            let body = body.to_string();
            let _ = write!(
                &stream,
                "HTTP/1.1 {status}\r\nContent-Type: application/vnd.schemaregistry.v1+json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    url
}
