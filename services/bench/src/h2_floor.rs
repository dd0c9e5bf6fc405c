//! The floor of a forwarder built on `h2`, the HTTP/2 implementation under hyper, tonic and
//! every retrychain service: each stream accepted is forwarded as it came — its headers,
//! its body's frames, the answer's headers, frames and trailers — on one HTTP/2 connection
//! to the downstream, and nothing else is done. No hyper, no tonic, no tower, no log line,
//! no metadata read: what is left is `h2`'s own per-stream work, tokio's and the kernel's.
//!
//! It is what `hop-cost --h2-floor` measures beside the relay, the bare tonic forwarder and
//! HAProxy: a relay on `h2` cannot cost less than this per request, so a goal below it
//! (relay / HAProxy ≤ 1.3) is out of reach of any forwarder on `h2`, however little it does
//! on top; a goal above it says how much the layers on top may cost.

use std::net::SocketAddr;

use anyhow::Context;
use bytes::Bytes;
use h2::{RecvStream, SendStream, client::SendRequest, server::SendResponse};
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
