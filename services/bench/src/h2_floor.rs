//! The floors under every service built on `h2`, the HTTP/2 implementation under hyper,
//! tonic and every retrychain service:
//!
//! - [`forward`]: each stream accepted is forwarded as it came — its headers, its body's
//!   frames, the answer's headers, frames and trailers — on one HTTP/2 connection to the
//!   downstream, and nothing else is done. No hyper, no tonic, no tower, no log line, no
//!   metadata read: what is left is `h2`'s own per-stream work, tokio's and the kernel's.
//!   It is what `hop-cost --h2-floor` measures beside the relay, the bare tonic forwarder
//!   and HAProxy: a relay on `h2` cannot cost less than this per request, so a goal below
//!   it is out of reach of any forwarder on `h2`, however little it does on top; a goal
//!   above it says how much the layers on top may cost.
//! - [`refuse`]: each stream is answered at once with the refusal an overloaded service
//!   sends (trailers-only: UNAVAILABLE, a pushback, `retrychain-overloaded`), its body
//!   read to its end apart and dropped, as the edge's admission does, and every stream
//!   already read answered before the next write. It is what `refusal-cost` measures
//!   beside the edge's refusal: the least a server on `h2` spends on a call it refuses.

use std::net::SocketAddr;

use anyhow::Context;
use bytes::Bytes;
use futures::FutureExt;
use h2::{RecvStream, SendStream, client::SendRequest, server::SendResponse};
use http::{HeaderValue, header::CONTENT_TYPE};
use resilience::wire::names;
use tokio::net::{TcpListener, TcpStream};

/// Serves `listener`, forwarding every stream to `downstream` over one connection.
pub async fn forward(listener: TcpListener, downstream: SocketAddr) -> anyhow::Result<()> {
    let tcp = TcpStream::connect(downstream)
        .await
        .with_context(|| format!("connecting to {downstream}"))?;
    tcp.set_nodelay(true)?;
    let (sender, connection) = h2::client::handshake(tcp).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            eprintln!("h2 floor: the downstream connection ended: {error}");
        }
    });
    loop {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        let sender = sender.clone();
        tokio::spawn(async move {
            let mut connection = match h2::server::handshake(tcp).await {
                Ok(connection) => connection,
                Err(_) => return,
            };
            while let Some(Ok((request, respond))) = connection.accept().await {
                tokio::spawn(stream(request, respond, sender.clone()));
            }
        });
    }
}

/// One stream, forwarded; a failure resets it.
async fn stream(
    request: http::Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    sender: SendRequest<Bytes>,
) {
    if forwarded(request, &mut respond, sender).await.is_err() {
        respond.send_reset(h2::Reason::INTERNAL_ERROR);
    }
}

async fn forwarded(
    request: http::Request<RecvStream>,
    respond: &mut SendResponse<Bytes>,
    sender: SendRequest<Bytes>,
) -> Result<(), h2::Error> {
    let (head, body) = request.into_parts();
    let mut sender = sender.ready().await?;
    let ends = body.is_end_stream();
    let (answer, up) = sender.send_request(http::Request::from_parts(head, ()), ends)?;
    if !ends {
        copy(body, up).await?;
    }
    let (head, body) = answer.await?.into_parts();
    let ends = body.is_end_stream();
    let down = respond.send_response(http::Response::from_parts(head, ()), ends)?;
    if !ends {
        copy(body, down).await?;
    }
    Ok(())
}

/// A body's frames from `from` to `to`, then its trailers: the last frame ends the stream
/// as it ended the one it came from, so no frame is added.
async fn copy(mut from: RecvStream, mut to: SendStream<Bytes>) -> Result<(), h2::Error> {
    while let Some(data) = from.data().await {
        let data = data?;
        from.flow_control().release_capacity(data.len())?;
        let ends = from.is_end_stream();
        to.send_data(data, ends)?;
        if ends {
            return Ok(());
        }
    }
    match from.trailers().await? {
        Some(trailers) => to.send_trailers(trailers),
        None => to.send_data(Bytes::new(), true),
    }
}

/// The message a refusal carries, as long as the edge's for a service at its ceiling.
pub const REFUSAL_MESSAGE: &str = "overloaded: this service is serving 1 call, its most at once";

/// Serves `listener`, answering every stream with a refusal (see the module docs).
pub async fn refuse(listener: TcpListener) -> anyhow::Result<()> {
    loop {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        tokio::spawn(async move {
            let mut connection = match h2::server::handshake(tcp).await {
                Ok(connection) => connection,
                Err(_) => return,
            };
            // Bodies still coming, read in this task too: no task a stream, the least a
            // server can do.
            let mut draining = futures::stream::FuturesUnordered::new();
            loop {
                tokio::select! {
                    accepted = connection.accept() => {
                        let Some(Ok(first)) = accepted else { return };
                        // Every stream already read is answered in this turn, so their
                        // answers leave in one write, not a write each.
                        let mut streams = vec![first];
                        while let Some(Some(Ok(next))) = connection.accept().now_or_never() {
                            streams.push(next);
                        }
                        for (request, mut respond) in streams {
                            // Answered at once. A body still coming is read to its end, as
                            // the edge's refusal does: dropped unread, its stream would be
                            // reset, and a client still sending it would see the reset,
                            // not the refusal.
                            let _ = respond.send_response(refusal(), true);
                            let body = request.into_body();
                            if !body.is_end_stream() {
                                draining.push(drain(body));
                            }
                        }
                    }
                    Some(()) = futures::StreamExt::next(&mut draining), if !draining.is_empty() => {}
                }
            }
        });
    }
}

/// Reads a refused request's body to its end, dropping it.
async fn drain(mut body: RecvStream) {
    while let Some(Ok(data)) = body.data().await {
        let _ = body.flow_control().release_capacity(data.len());
    }
}

/// A trailers-only gRPC answer: UNAVAILABLE, with the pushback and the overload mark.
fn refusal() -> http::Response<()> {
    let mut response = http::Response::new(());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(names::GRPC_STATUS, HeaderValue::from_static("14"));
    headers.insert(
        names::GRPC_MESSAGE,
        HeaderValue::from_static(REFUSAL_MESSAGE),
    );
    headers.insert(names::PUSHBACK, HeaderValue::from_static("100"));
    headers.insert(names::OVERLOADED, HeaderValue::from_static("1"));
    response
}
