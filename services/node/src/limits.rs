//! What a service facing untrusted clients bounds, below gRPC: how many connections it
//! holds (in all and per peer), how long a connection may take to say it speaks HTTP/2,
//! how large a request's metadata may be (how many requests it serves at once is the
//! adaptive concurrency limit's, `resilience::admission`). Deadlines (how long a request may take to arrive and be
//! answered) are `resilience::DeadlineLayer`'s; the HTTP/2 settings are in
//! [`crate::server`].
//!
//! hyper and tonic bound none of the first two: HTTP/2's handshake waits for the client's
//! preface forever, and there is no connection limit, so a client can hold any number of
//! idle sockets (and their buffers) for free. HTTP/2's own header limit (`h2`'s) answers a bare
//! HTTP 431 that gRPC clients report as UNKNOWN; [`MetadataLimit`] answers the
//! gRPC status instead, below the transport's own (larger) limit.

use std::{
    io,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures::Stream;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Sleep,
};
use tonic::Status;

/// Limits on the connections of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections held at once; past it, new ones wait in the kernel's accept queue until
    /// one closes.
    pub max_connections: usize,
    /// Connections held at once from one IP address. Past it, the oldest of that
    /// address's idle connections (none has sent a request, for [`EVICTABLE_AFTER`] at
    /// least) is sent a GOAWAY to make room; if there is none, the new one is refused
    /// ([`Refusal`]). Without it, one
    /// client could take every slot of `max_connections` and lock everybody else out;
    /// without the eviction, 256 idle sockets from an address (a NAT, a load balancer, an
    /// attacker on the same host) would lock out every other client behind it.
    pub max_per_peer: usize,
    /// How long a new connection may take to send the HTTP/2 preface and its first SETTINGS
    /// frame before it is closed: a real client sends them at once.
    pub preface_within: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_per_peer: 256,
            preface_within: Duration::from_secs(10),
        }
    }
}

/// The HTTP/2 client preface (24 bytes) and the frame header of the SETTINGS frame that
/// must follow it (9 bytes): what a connection must have sent before its silence timer
/// stops. One byte is not enough to hold a slot.
const PREFACE_BYTES: usize = 24 + 9;

/// Follows what a client sends on an HTTP/2 connection far enough to see its first call:
/// the preface, then each frame's header, its payload skipped, until a HEADERS frame opens
/// a stream. A connection counts as one that makes requests from then on. Counted in bytes
/// instead (more than 128: the preface, SETTINGS, WINDOW_UPDATE and a PING fit under it),
/// an idle client answering the server's keepalive PINGs (17 bytes each, every 30 s) passed
/// for one that makes requests after about 90 s, and could never be evicted.
#[derive(Debug, Clone)]
struct FirstCall {
    /// Bytes still to skip: the preface's, then a frame's payload.
    skip: usize,
    /// The frame header being read.
    header: [u8; 9],
    /// How much of it has been read.
    have: usize,
}

impl FirstCall {
    /// Before the client's first byte.
    fn new() -> Self {
        Self {
            skip: 24, // "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            header: [0; 9],
            have: 0,
        }
    }

    /// Follows `bytes`, the next the client sent: whether a call has begun.
    fn seen_in(&mut self, mut bytes: &[u8]) -> bool {
        const HEADERS: u8 = 0x1;
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (self.header.len() - self.have).min(bytes.len());
            self.header[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have == self.header.len() {
                if self.header[3] == HEADERS {
                    return true;
                }
                let [a, b, c, ..] = self.header;
                self.skip = u32::from_be_bytes([0, a, b, c]) as usize;
                self.have = 0;
            }
        }
        false
    }
}

/// How a connection is refused when its address already holds
/// [`ConnectionLimits::max_per_peer`], none of which can make room (each makes requests,
/// or has been open less than [`EVICTABLE_AFTER`]).
///
/// A connection closed without a word breaks the calls its client has already sent on it:
/// tonic reports them UNKNOWN ("connection reset") or CANCELLED, codes that do not say
/// whether a charge was made. HTTP/2 has the word for it: a GOAWAY whose last stream is 0
/// says that no call on the connection was processed, so every one may be sent again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A plaintext HTTP/2 port: the connection is answered with the server's SETTINGS and
    /// a GOAWAY (last stream 0, REFUSED_STREAM, which gRPC clients report as UNAVAILABLE),
    /// then closed once its client closes, or after [`REFUSED_LINGER`].
    GoAway,
    /// A TLS port: the connection is closed before its handshake, which its client
    /// reports as a failure to connect (UNAVAILABLE) before any call is sent. A GOAWAY
    /// would first cost the server a TLS handshake for a connection it does not want.
    Close,
}

impl Refusal {
    /// How a port refuses: over TLS (`tls`) or in plaintext.
    pub fn of_port(tls: bool) -> Self {
        if tls { Self::Close } else { Self::GoAway }
    }
}

/// How long a refused connection is held after its GOAWAY, reading (and dropping) what
/// its client still sends. Closed with unread bytes, a socket sends a TCP reset, and a
/// reset can destroy the GOAWAY before the client reads it; a client that read it closes
/// on its own, at once.
pub const REFUSED_LINGER: Duration = Duration::from_secs(2);

/// How long a connection must have been open without a request before it may be evicted
/// to make room for another from its address. A younger one is most likely a client's
/// that is sending its first call this moment; evicting it would send it a GOAWAY with
/// NO_ERROR, which tonic reports as INTERNAL for a call it was about to send (measured: a
/// burst of 16 connections from one address against a limit of 4). A client of many new
/// connections at once gets the refusal instead ([`Refusal`]); what eviction is for,
/// sockets that hold a slot and ask nothing, are idle far longer.
pub const EVICTABLE_AFTER: Duration = Duration::from_secs(1);

/// How long a connection sent a GOAWAY to make room may stay idle before it is closed
/// outright. A client that has read the GOAWAY starts nothing more on the connection, and
/// a request it sent before reading it makes the connection busy: served to its end. One
/// that never answers the GOAWAY's PING (a socket holding a slot, not an HTTP/2 client)
/// would otherwise hold its socket until keepalive gave up on it, 40 s later.
pub const EVICTED_LINGER: Duration = Duration::from_secs(1);

/// The server's side of a refused connection: an empty SETTINGS frame (the server's
/// preface, which must come first) and a GOAWAY with last stream 0, REFUSED_STREAM, and a
/// few words for whoever reads the frame.
fn refusal_frames() -> Vec<u8> {
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    const REFUSED_STREAM: u32 = 0x7;
    const WHY: &[u8] = b"this address holds too many connections";
    let frame = |kind: u8, payload: &[u8]| {
        let length = u32::try_from(payload.len())
            .expect("a short frame")
            .to_be_bytes();
        let mut frame = vec![length[1], length[2], length[3], kind, 0, 0, 0, 0, 0];
        frame.extend_from_slice(payload);
        frame
    };
    let mut goaway = Vec::with_capacity(8 + WHY.len());
    goaway.extend_from_slice(&0u32.to_be_bytes()); // last stream: none was processed
    goaway.extend_from_slice(&REFUSED_STREAM.to_be_bytes());
    goaway.extend_from_slice(WHY);
    let mut frames = frame(SETTINGS, &[]);
    frames.extend(frame(GOAWAY, &goaway));
    frames
}

/// Refuses `stream` ([`Refusal::GoAway`]), holding its places under the listener's limit
/// (`_slot`) and among its address's leaving connections (`_leaving`) until it is closed.
async fn refuse(mut stream: TcpStream, _slot: OwnedSemaphorePermit, _leaving: Leaving) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(REFUSED_LINGER, async {
        stream.write_all(&refusal_frames()).await?;
        let mut dropped = [0u8; 1024];
        while stream.read(&mut dropped).await? != 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// One accepted connection, as its peer's list knows it.
#[derive(Debug)]
struct Conn {
    /// When it was accepted.
    since: std::time::Instant,
    /// Set once it has begun a call ([`FirstCall`]): it makes requests.
    busy: std::sync::atomic::AtomicBool,
    /// Set when it is to make room for another connection from its address.
    evicted: std::sync::atomic::AtomicBool,
    /// Wakes its pending read when it is evicted (its idle time starts counting).
    waker: futures::task::AtomicWaker,
    /// Tells its server to send it a GOAWAY when it is evicted ([`Guarded::evicted`]).
    goaway: tokio::sync::Notify,
}

/// Connections of one address on their way out at once: refused and being told so, or
/// evicted and not yet closed. Past it, a connection the address has no room for is closed
/// at once, without a GOAWAY, and none is evicted. Each holds a place under the listener's
/// limit while it leaves: without a bound, a client that never closes its sockets would
/// hold its 256 and another [`REFUSED_LINGER`] of its connection rate (at 2,000 a second,
/// the listener's every slot); with it, at most 512 of the 4,096. A client that reads its
/// GOAWAY closes at once, so the bound is reached only by one that does not, or by a
/// burst. Measured with storm's 1,000 connections at once (744 of them refused), 5 s at
/// 2,900 calls a second: with this bound, of 14,499 calls 3,837 were served, 9,262 refused
/// UNAVAILABLE and 1,400 CANCELLED (calls tonic had queued on a refused connection when it
/// closed: hyper cancels them, unsent), none UNKNOWN; with a bound of 16, most refusals
/// went untold, and 3,112 of 14,498 read UNKNOWN; before any GOAWAY, 7,230 UNKNOWN and
/// 3,465 CANCELLED of 14,499.
pub const MOST_LEAVING_PER_PEER: usize = 256;

/// One address's connections.
#[derive(Debug, Default)]
struct Address {
    /// Those it holds, oldest first.
    conns: Vec<Arc<Conn>>,
    /// Those on their way out ([`MOST_LEAVING_PER_PEER`]).
    leaving: usize,
}

/// The connections of each peer address, shared by a listener's accepted connections.
#[derive(Debug, Default)]
struct Peers(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, Address>>);

/// What [`Peers::admit`] made of a new connection.
enum Admission {
    /// Its place among its address's connections.
    Admitted(PeerSlot),
    /// No room for it: with a place among its address's leaving connections, to be told
    /// so; without, to be closed at once.
    Refused(Option<Leaving>),
}

impl Peers {
    /// One more connection from `peer`: at `max`, the oldest of its idle connections is
    /// evicted to make room (sent a GOAWAY, closed if it stays idle). It is refused when
    /// every one of them has made requests, or the oldest idle one is younger than
    /// [`EVICTABLE_AFTER`], or [`MOST_LEAVING_PER_PEER`] are already leaving.
    fn admit(self: &Arc<Self>, peer: std::net::IpAddr, max: usize) -> Admission {
        use std::sync::atomic::Ordering;
        let now = std::time::Instant::now();
        let mut peers = self.lock();
        let address = peers.entry(peer).or_default();
        if address.conns.len() >= max {
            if address.leaving >= MOST_LEAVING_PER_PEER {
                return Admission::Refused(None);
            }
            address.leaving += 1;
            let evictable = address
                .conns
                .iter()
                .position(|c| !c.busy.load(Ordering::Relaxed))
                .filter(|&idle| now.duration_since(address.conns[idle].since) >= EVICTABLE_AFTER);
            let Some(idle) = evictable else {
                return Admission::Refused(Some(Leaving {
                    peers: Arc::clone(self),
                    peer,
                }));
            };
            // It stays counted among the leaving until it closes ([`PeerSlot`]'s drop).
            let evicted = address.conns.remove(idle);
            evicted.evicted.store(true, Ordering::Release);
            evicted.goaway.notify_one();
            evicted.waker.wake();
            tracing::debug!(%peer, "evicted an idle connection (GOAWAY) to make room for a new one from its address");
        }
        let conn = Arc::new(Conn {
            since: now,
            busy: std::sync::atomic::AtomicBool::new(false),
            evicted: std::sync::atomic::AtomicBool::new(false),
            waker: futures::task::AtomicWaker::new(),
            goaway: tokio::sync::Notify::new(),
        });
        address.conns.push(Arc::clone(&conn));
        Admission::Admitted(PeerSlot {
            peers: Arc::clone(self),
            peer,
            conn,
        })
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<std::net::IpAddr, Address>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `peer` has one connection fewer on its way out.
    fn left(
        &self,
        peers: &mut std::collections::HashMap<std::net::IpAddr, Address>,
        peer: std::net::IpAddr,
    ) {
        if let Some(address) = peers.get_mut(&peer) {
            address.leaving -= 1;
            if address.conns.is_empty() && address.leaving == 0 {
                peers.remove(&peer);
            }
        }
    }
}

/// A connection's place among its address's leaving ones, given back when it is closed.
#[derive(Debug)]
struct Leaving {
    peers: Arc<Peers>,
    peer: std::net::IpAddr,
}

impl Drop for Leaving {
    fn drop(&mut self) {
        let mut peers = self.peers.lock();
        self.peers.left(&mut peers, self.peer);
    }
}

/// A connection's place among its peer's, given back when the connection is dropped.
#[derive(Debug)]
struct PeerSlot {
    peers: Arc<Peers>,
    peer: std::net::IpAddr,
    conn: Arc<Conn>,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut peers = self.peers.lock();
        // Set under the lock, by an eviction: then it is among the leaving.
        if self.conn.evicted.load(std::sync::atomic::Ordering::Relaxed) {
            self.peers.left(&mut peers, self.peer);
            return;
        }
        if let Some(address) = peers.get_mut(&self.peer) {
            address.conns.retain(|c| !Arc::ptr_eq(c, &self.conn));
            if address.conns.is_empty() && address.leaving == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

/// The connections `listener` accepts: at most `limits.max_connections` open at once and
/// `limits.max_per_peer` from one address (past it, an idle one is evicted to make room,
/// or the new one refused as `refusal` says, or closed at once past
/// [`MOST_LEAVING_PER_PEER`]), each closed if it has not sent the HTTP/2
/// preface within `limits.preface_within`. Accept errors (out of file descriptors, say) are yielded after
/// a short pause, so that a persistent one does not spin the accept loop.
pub fn incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
    refusal: Refusal,
) -> impl Stream<Item = io::Result<GuardedStream>> + Send + 'static {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let peers = Arc::new(Peers::default());
    futures::stream::unfold(
        (listener, slots, peers),
        move |(listener, slots, peers)| async move {
            let accepted = loop {
                let slot = Arc::clone(&slots).acquire_owned().await.ok()?;
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        let peer_slot = match peers.admit(peer.ip(), limits.max_per_peer) {
                            Admission::Admitted(peer_slot) => peer_slot,
                            Admission::Refused(leaving) => {
                                tracing::debug!(%peer, ?refusal, told = leaving.is_some(), "refused a connection: its address holds too many, none of them idle long enough to make room");
                                if let (Refusal::GoAway, Some(leaving)) = (refusal, leaving) {
                                    tokio::spawn(refuse(stream, slot, leaving));
                                }
                                continue; // else dropped: closed
                            }
                        };
                        let _ = stream.set_nodelay(true);
                        break Ok(GuardedStream {
                            stream,
                            _slot: slot,
                            _peer_slot: peer_slot,
                            received: 0,
                            first_call: Some(FirstCall::new()),
                            silence: Some(Box::pin(tokio::time::sleep(limits.preface_within))),
                            idle_after_goaway: None,
                        });
                    }
                    Err(error) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        break Err(error);
                    }
                }
            };
            Some((accepted, (listener, slots, peers)))
        },
    )
}

/// An accepted connection holding its slots (of the listener's limit and of its peer's)
/// until it is dropped, and closed (a read error) if its preface does not come in time.
#[derive(Debug)]
pub struct GuardedStream {
    /// The socket.
    stream: TcpStream,
    /// The connection's place under the listener's limit.
    _slot: OwnedSemaphorePermit,
    /// The connection's place under its peer's limit.
    _peer_slot: PeerSlot,
    /// Bytes read so far, until the preface is in.
    received: usize,
    /// Watches for its first call, once it is one that makes requests (`None` over TLS,
    /// whose plaintext [`Counted`] watches instead: [`Guarded`]).
    first_call: Option<FirstCall>,
    /// Until the preface is in: when the connection is given up.
    silence: Option<Pin<Box<Sleep>>>,
    /// Once evicted: when it is closed if it is still idle ([`EVICTED_LINGER`]).
    idle_after_goaway: Option<Pin<Box<Sleep>>>,
}

/// A connection accepted under [`ConnectionLimits`], as its server sees it: told when its
/// TLS handshake starts and ends, and telling when it is to be sent a GOAWAY.
///
/// What the socket reads during a handshake is ciphertext (a client hello and a
/// certificate are hundreds of bytes, and a request's bytes may arrive in the same read as
/// the handshake's end), so whether the connection makes requests is judged above TLS, on
/// the plaintext ([`Counted`], through [`Guarded::activity`]).
pub trait Guarded {
    /// The handle that marks this connection as one that makes requests.
    fn activity(&self) -> Activity;
    /// The handshake begins: the socket's own count stops judging.
    fn handshake_starts(&mut self);
    /// The handshake is over: it proved a live client, so the preface timer is off (HTTP/2
    /// keepalive notices a peer that vanishes).
    fn handshake_done(&mut self);
    /// Completes when the connection is evicted to make room for another from its address:
    /// its server then sends it a GOAWAY, so that a request already on its way is served,
    /// not broken.
    fn evicted(&self) -> impl Future<Output = ()> + Send + 'static;
}

impl Guarded for GuardedStream {
    fn activity(&self) -> Activity {
        Activity(Arc::clone(&self._peer_slot.conn))
    }

    fn handshake_starts(&mut self) {
        self.first_call = None;
    }

    fn handshake_done(&mut self) {
        self.silence = None;
    }

    fn evicted(&self) -> impl Future<Output = ()> + Send + 'static {
        let conn = Arc::clone(&self._peer_slot.conn);
        async move { conn.goaway.notified().await }
    }
}

/// Marks a connection as one that makes requests: it is then never evicted to make room for
/// another from its address.
#[derive(Debug, Clone)]
pub struct Activity(Arc<Conn>);

/// A stream whose reads count toward its connection's [`Activity`]: over TLS, the
/// plaintext, judged as a plaintext connection's bytes are.
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    activity: Activity,
    /// Watches for its first call, until it has seen it.
    first_call: Option<FirstCall>,
}

impl<S> Counted<S> {
    /// Counts what is read from `inner` toward `activity`.
    pub fn new(inner: S, activity: Activity) -> Self {
        Self {
            inner,
            activity,
            first_call: Some(FirstCall::new()),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use std::sync::atomic::Ordering;
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read
            && let Some(first_call) = self.first_call.as_mut()
            && first_call.seen_in(&buf.filled()[before..])
        {
            self.activity.0.busy.store(true, Ordering::Relaxed);
            self.first_call = None;
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl GuardedStream {
    /// Whether the connection, evicted to make room, has stayed idle [`EVICTED_LINGER`]
    /// since. Asked when a read waits: it registers to be woken when the connection is
    /// evicted, and when that time is up.
    fn idle_after_goaway(&mut self, cx: &mut Context<'_>) -> bool {
        use std::sync::atomic::Ordering;
        let conn = &self._peer_slot.conn;
        if conn.busy.load(Ordering::Relaxed) {
            return false; // it makes requests: its GOAWAY lets them finish
        }
        conn.waker.register(cx.waker());
        if !conn.evicted.load(Ordering::Acquire) {
            return false;
        }
        self.idle_after_goaway
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(EVICTED_LINGER)))
            .as_mut()
            .poll(cx)
            .is_ready()
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        use std::sync::atomic::Ordering;
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read {
            let new = &buf.filled()[before..];
            if self.silence.is_some() {
                self.received += new.len();
            }
            if let Some(first_call) = self.first_call.as_mut()
                && first_call.seen_in(new)
            {
                self._peer_slot.conn.busy.store(true, Ordering::Relaxed);
                self.first_call = None;
            }
        }
        if read.is_pending() && self.idle_after_goaway(cx) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed while idle: its address reached its connection limit, a new connection took its place, and it sent nothing after its GOAWAY",
            )));
        }
        let Some(silence) = self.silence.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) => {
                if self.received >= PREFACE_BYTES {
                    self.silence = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match silence.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not send the HTTP/2 preface in time",
                ))),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Gives the answers tonic's decoder makes to a request message it could not read the
/// codes this service's contract gives them (a trailers-only answer, before any handler
/// ran):
///
/// - a message over the size limit, which tonic refuses from its length prefix with
///   OUT_OF_RANGE: RESOURCE_EXHAUSTED, as gRPC core, grpc-java and grpc-go answer it;
/// - bytes that are not the method's protobuf message, which tonic answers INTERNAL:
///   INVALID_ARGUMENT. The request is at fault, not the server, and INVALID_ARGUMENT is
///   what a client reads as "do not send this again"; the relays forward a message
///   unread, so this is said where it is first decoded (the edge, or the ledger for a
///   caller that skips the edge).
///
/// Only those answers are rewritten: an OUT_OF_RANGE or INTERNAL of the service's own (a
/// balance that would overflow), and any failure a service relays from below
/// (`retrychain-relayed`), go through as they are.
#[derive(Debug, Clone)]
pub struct RequestDecodeFailures<S> {
    /// The server's services.
    inner: S,
}

impl<S> RequestDecodeFailures<S> {
    /// `inner`, its decoder's refusals told with the contract's codes.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

/// What tonic's decoder says of a message over its limit.
const TONIC_OVERSIZE: &str = "Error, decoded message length too large";

/// What prost says of bytes that are not the message (`prost::DecodeError`'s `Display`).
const PROST_UNDECODABLE: &str = "failed to decode Protobuf message";

impl<S, B, RB> tower::Service<http::Request<B>> for RequestDecodeFailures<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = S::Response;
    type Error = S::Error;
    #[allow(clippy::type_complexity)] // a named future, no box: every request passes here
    type Future = futures::future::Map<
        S::Future,
        fn(Result<http::Response<RB>, S::Error>) -> Result<http::Response<RB>, S::Error>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use futures::FutureExt;
        self.inner.call(request).map(|answer| {
            answer.map(|mut response| {
                with_contract_codes(response.headers_mut());
                response
            })
        })
    }
}

/// Rewrites a decoder's refusal in `headers` (a trailers-only answer) with the contract's
/// code, keeping what it said.
fn with_contract_codes(headers: &mut http::HeaderMap) {
    use resilience::wire::names;
    // Most answers are successes: no grpc-status in the headers, nothing parsed.
    if !headers.contains_key(&names::GRPC_STATUS) || resilience::wire::is_relayed(headers) {
        return;
    }
    let Some(status) = resilience::wire::status_in(headers) else {
        return;
    };
    let status = match status.code() {
        tonic::Code::OutOfRange if status.message().starts_with(TONIC_OVERSIZE) => {
            let sizes = status
                .message()
                .split_once(": ")
                .map_or("", |(_, sizes)| sizes);
            Status::resource_exhausted(format!("request message too large: {sizes}"))
        }
        tonic::Code::Internal if status.message().starts_with(PROST_UNDECODABLE) => {
            Status::invalid_argument(format!(
                "the request is not a valid message of the method: {}",
                status.message()
            ))
        }
        _ => return,
    };
    headers.remove(&names::GRPC_STATUS);
    headers.remove(&names::GRPC_MESSAGE);
    headers.remove(&names::GRPC_STATUS_DETAILS);
    let _ = status.add_header(headers);
}

/// The largest request metadata accepted, counted as HTTP/2 counts a header list (each
/// entry's name and value plus 32 bytes): gRPC core's hard limit. A Charge needs a few
/// hundred bytes; 1,000 small headers are about 40 KiB.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// The transport's own limit (`SETTINGS_MAX_HEADER_LIST_SIZE`), above
/// [`MAX_METADATA_BYTES`] so that a list between the two gets a gRPC status from
/// [`MetadataLimit`]. Past it, `h2` answers HTTP 431 before any gRPC code runs (clients
/// that honour the setting, as grpc-go does, refuse to send such a list in the first place),
/// and past four times it the connection is closed.
pub const MAX_HEADER_LIST_BYTES: u32 = 64 * 1024;

/// Refuses a request whose metadata is over [`MAX_METADATA_BYTES`] with RESOURCE_EXHAUSTED,
/// before it is read further: a gRPC answer (trailers-only), where the transport would give
/// a bare HTTP error.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetadataLimit;

impl MetadataLimit {
    /// The check, for `tower::filter::FilterLayer`: the request, or the status refusing it.
    pub fn check<B>(request: http::Request<B>) -> Result<http::Request<B>, Status> {
        let size: usize = request
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 32)
            .sum();
        if size > MAX_METADATA_BYTES {
            return Err(Status::resource_exhausted(format!(
                "request metadata of {size} bytes (name + value + 32 per entry, {} entries) is over the limit of {MAX_METADATA_BYTES}",
                request.headers().len()
            )));
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as a client sends it: `kind`, on stream `stream`, with `length` bytes of
    /// payload.
    fn frame(kind: u8, stream: u32, length: usize) -> Vec<u8> {
        let len = u32::try_from(length).unwrap().to_be_bytes();
        let mut frame = vec![len[1], len[2], len[3], kind, 0];
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend(std::iter::repeat_n(0xAB, length));
        frame
    }

    /// An idle client: the preface, SETTINGS with every setting, a WINDOW_UPDATE, then
    /// 1,000 keepalive PING acks (over 8 hours of the server's PINGs) and SETTINGS acks.
    fn idle_client() -> Vec<u8> {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend(frame(0x4, 0, 36));
        bytes.extend(frame(0x8, 0, 4));
        for _ in 0..1000 {
            bytes.extend(frame(0x6, 0, 8));
            bytes.extend(frame(0x4, 0, 0));
        }
        bytes
    }

    #[test]
    fn pings_and_settings_are_not_a_call_and_headers_are_however_the_bytes_arrive() {
        let idle = idle_client();
        let mut call = idle.clone();
        call.extend(frame(0x1, 1, 120)); // a call's HEADERS
        call.extend(frame(0x0, 1, 200));
        // Whole, and cut at every point into two reads, and one byte at a time.
        let mut whole = FirstCall::new();
        assert!(!whole.seen_in(&idle));
        let mut whole = FirstCall::new();
        assert!(whole.seen_in(&call));
        for cut in [
            1,
            23,
            24,
            25,
            32,
            33,
            60,
            idle.len() - 1,
            idle.len(),
            idle.len() + 4,
        ] {
            let mut reads = FirstCall::new();
            let first = reads.seen_in(&call[..cut]);
            assert!(!first, "cut at {cut}: no call yet");
            assert!(reads.seen_in(&call[cut..]), "cut at {cut}");
        }
        let mut bytewise = FirstCall::new();
        let at = call
            .iter()
            .position(|byte| bytewise.seen_in(std::slice::from_ref(byte)))
            .expect("the call is seen");
        assert_eq!(
            at,
            idle.len() + 8,
            "seen once the HEADERS frame's header is whole"
        );
    }
}
