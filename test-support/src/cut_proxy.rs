//! A TCP proxy a test can cut and restore: the network between a program and a server it
//! calls (the operators and the Kubernetes API server, say) going away and coming back.
//!
//! [`CutProxy::start`] listens on a loopback port and forwards every connection to the
//! upstream address, byte for byte (TLS passes through untouched). [`CutProxy::cut`] takes the
//! server away in one of two ways ([`Cut`]): `Refuse` closes every connection at once and
//! closes each new one as soon as it is accepted (the caller sees resets: the server is down);
//! `BlackHole` stops moving bytes on every connection, old and new, without closing any (the
//! caller's calls hang until its own timeouts: the network is gone). [`CutProxy::restore`]
//! forwards again; connections black-holed meanwhile are closed then (their callers have
//! given up on them), new ones are forwarded.

use std::net::SocketAddr;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How the proxy takes the server away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Every connection is closed, new ones too, at once.
    Refuse,
    /// Nothing moves on any connection, and none is closed.
    BlackHole,
}

/// What the proxy does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Forward,
    Cut(Cut),
}

/// A proxy to one upstream address (see the module doc). Dropping it stops it.
#[derive(Debug)]
pub struct CutProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accept: JoinHandle<()>,
}

impl CutProxy {
    /// Listens on `127.0.0.1` (a free port) and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> CutProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("the cut proxy cannot listen: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("the cut proxy's address: {e}"));
        let (mode, _) = watch::channel(Mode::Forward);
        let modes = mode.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(connection(client, upstream, modes.subscribe()));
            }
        });
        CutProxy { addr, mode, accept }
    }

    /// Where the programs connect (in place of the upstream address).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Takes the server away (see [`Cut`]).
    pub fn cut(&self, how: Cut) {
        self.mode.send_replace(Mode::Cut(how));
    }

    /// Forwards again.
    pub fn restore(&self) {
        self.mode.send_replace(Mode::Forward);
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Every connection ends with the channel.
        self.mode.send_replace(Mode::Cut(Cut::Refuse));
    }
}

/// One connection: forwarded while the mode says so; closed on `Refuse`; held without moving
/// bytes on `BlackHole` until the mode changes again, then closed.
async fn connection(client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let now = *mode.borrow_and_update();
    match now {
        Mode::Cut(Cut::Refuse) => {
            reset(client);
            return;
        }
        Mode::Cut(Cut::BlackHole) => {
            // Held, unread, until the next change.
            let _ = mode.changed().await;
            reset(client);
            return;
        }
        Mode::Forward => {}
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        reset(client);
        return;
    };
    let (mut client, mut server) = (client, server);
    let cut = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {
            let _ = client.shutdown().await;
            return;
        }
        cut = until_cut(&mut mode) => cut,
    };
    if cut == Some(Mode::Cut(Cut::BlackHole)) {
        // Nothing moves any more; both ends stay open until the next change.
        let _ = mode.changed().await;
    }
    reset(client);
    reset(server);
}

/// The mode once it is no longer `Forward`; `None` when the proxy is gone.
async fn until_cut(mode: &mut watch::Receiver<Mode>) -> Option<Mode> {
    let cut = mode.wait_for(|m| *m != Mode::Forward).await.ok()?;
    let cut = *cut;
    Some(cut)
}

/// Closes `stream` with a reset (no orderly end: the peer sees the connection broken).
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
