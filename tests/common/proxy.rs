//! A TCP proxy on loopback between refract and a server, that can black-hole the network: it
//! stops forwarding without closing any socket (no FIN, no RST), as a dead route, a partitioned
//! network or a lost NAT entry do. The connections caught in the black hole stay dead for good
//! (their bytes are never delivered, their sockets stay open until the proxy is dropped), as
//! TCP flows whose state a middlebox lost; connections opened once it is lifted are forwarded.
//! A client that only waits for bytes on a dead connection waits forever.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often a forwarding thread looks whether the black hole started or the proxy stopped.
const POLL: Duration = Duration::from_millis(20);

/// A proxy to `upstream`, listening on a free port of 127.0.0.1.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

/// What the proxy's threads share.
#[derive(Default)]
struct Shared {
    /// Whether the network is black-holed now.
    hole: AtomicBool,
    /// Whether the proxy is dropped: every thread ends, closing its sockets.
    stopped: AtomicBool,
    /// The dead flag of every connection so far.
    connections: Mutex<Vec<Arc<AtomicBool>>>,
}

impl Proxy {
    /// Starts a proxy to `upstream` (`host:port`).
    pub fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("the proxy listens");
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        let upstream = upstream.to_owned();
        let accepting = shared.clone();
        std::thread::spawn(move || accept_loop(&listener, &upstream, &accepting));
        Proxy { addr, shared }
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Black-holes the network: every open connection is dead from now on, and so is every
    /// connection opened until [`Proxy::lift`].
    pub fn black_hole(&self) {
        self.shared.hole.store(true, Ordering::SeqCst);
        for dead in self.shared.connections.lock().unwrap().iter() {
            dead.store(true, Ordering::SeqCst);
        }
    }

    /// Ends the black hole for connections opened from now on.
    pub fn lift(&self) {
        self.shared.hole.store(false, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.lock().unwrap().len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
    }
}

fn accept_loop(listener: &TcpListener, upstream: &str, shared: &Arc<Shared>) {
    while !shared.stopped.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(_) => return,
        };
        let dead = Arc::new(AtomicBool::new(shared.hole.load(Ordering::SeqCst)));
        shared.connections.lock().unwrap().push(dead.clone());
        let Ok(server) = TcpStream::connect(upstream) else {
            continue;
        };
        for (from, to) in [
            (client.try_clone().unwrap(), server.try_clone().unwrap()),
            (server, client),
        ] {
            let (dead, shared) = (dead.clone(), shared.clone());
            std::thread::spawn(move || pump(from, to, &dead, &shared));
        }
    }
}

/// Copies `from` to `to` until either closes or the proxy stops; once `dead`, reads nothing more
/// and drops what it had read, keeping both sockets open.
fn pump(mut from: TcpStream, mut to: TcpStream, dead: &AtomicBool, shared: &Shared) {
    from.set_read_timeout(Some(POLL)).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    while !shared.stopped.load(Ordering::SeqCst) {
        if dead.load(Ordering::SeqCst) {
            std::thread::sleep(POLL);
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        if dead.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    // A connection that ended by itself (not dead) is closed both ways, as a router passes a FIN.
    if !dead.load(Ordering::SeqCst) {
        let _ = to.shutdown(std::net::Shutdown::Write);
    }
    // Dead: the sockets stay open until the proxy is dropped.
    while dead.load(Ordering::SeqCst) && !shared.stopped.load(Ordering::SeqCst) {
        std::thread::sleep(POLL);
    }
}
