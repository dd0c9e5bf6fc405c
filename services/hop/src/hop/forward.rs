//! A relay's `Payments` (hop2, hop3, hop4): each call forwarded as an HTTP/2 request with
//! its gRPC message left in the frames it came in.
//!
//! A relay acts on metadata alone: the deadline, the idempotency key, the trace, the retry
//! mode, the caller's signed statement. The edge has already decoded and validated the
//! message, and the ledger decodes it again before it acts on it, so a malformed message
//! still gets its status where it is first decoded. tonic's generated server and client
//! would read each message out of its frame into a buffer of their own and frame it again
//! into another, on the way in and on the way out: four buffers and four copies per
//! relayed call, for bytes the relay never reads. Here the request's body is read whole
//! into one buffer, its frame checked as tonic's server checks it (one whole,
//! uncompressed message within the size limit: a malformed frame is refused here, not
//! passed on to fail below), and sent on as it is; the reply's body likewise, its status
//! read where a gRPC client reads it, and answered with fresh trailers.
//!
//! Everything else a relay does is [`Hop`]'s, the same as the edge's: the call's scope
//! (its span, its line, its own DEADLINE_EXCEEDED), the outgoing metadata
//! ([`Hop::outgoing`]), the [`Downstream`](crate::Downstream) stack, and what of the answer
//! travels back up ([`relay`]).

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::{
    HeaderMap, HeaderValue, StatusCode,
    header::{CONTENT_TYPE, TE},
};
use http_body::Frame;
use http_body_util::BodyExt;
use retrychain_node::{RpcScope, server::MAX_REQUEST_BYTES};
use retrychain_proto::v1::payments_server::PaymentsServer;
use tonic::{
    Code, Request, Response, Status, body::Body, metadata::MetadataMap, server::NamedService,
};
use tower::ServiceExt;

use super::{Hop, relay};

/// A method a relay forwards.
struct Method {
    /// `/retrychain.v1.Payments/<name>`: the request's path, and the call's below.
    path: &'static str,
    /// The method's name, for the call's line and counters.
    name: &'static str,
    /// Whether a call must carry an idempotency key (one that changes something).
    key_required: bool,
}

/// Every `Payments` method. A method added to the proto is added here too (a test reads
/// the descriptor and fails until it is); until then a relay answers it UNIMPLEMENTED.
const METHODS: [Method; 2] = [
    Method {
        path: "/retrychain.v1.Payments/Charge",
        name: "Charge",
        key_required: true,
    },
    Method {
        path: "/retrychain.v1.Payments/GetAccount",
        name: "GetAccount",
        key_required: false,
    },
];

/// The length prefix and flag before each gRPC message in a body.
const FRAME_HEADER: usize = 5;

/// The largest reply read from the service below: tonic's default limit for a decoded
/// message, which a reply of this service never comes near (a `ChargeReply` is tens of
/// bytes); a larger one is a fault below, answered as one.
const MAX_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// `application/grpc`, on every answer and every call below.
const GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

/// A relay's `Payments`, served as HTTP/2 requests (see the module's documentation).
#[derive(Debug, Clone)]
pub struct Forwarding(Arc<Hop>);

impl Forwarding {
    /// `hop` (a relay's) serving `Payments` by forwarding each call's body unread.
    pub fn new(hop: Hop) -> Self {
        Self(Arc::new(hop))
    }
}

impl NamedService for Forwarding {
    const NAME: &'static str = <PaymentsServer<()> as NamedService>::NAME;
}

impl tower::Service<http::Request<Body>> for Forwarding {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Every call's readiness is the downstream stack's, awaited in `call`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let hop = Arc::clone(&self.0);
        Box::pin(async move { Ok(hop.forward(request).await) })
    }
}

impl Hop {
    /// Serves one relayed call: the request's message read and checked as tonic's server
    /// reads it (before the call's scope begins, so a refused or stalled body is answered
    /// by the server's layers and counted by none), the metadata acted on, the message
    /// sent on as it came, the answer relayed.
    async fn forward(&self, request: http::Request<Body>) -> http::Response<Body> {
        let path = request.uri().path();
        let Some(method) = METHODS.iter().find(|method| method.path == path) else {
            return Status::unimplemented(format!("no method {path} in Payments")).into_http();
        };
        let (head, body) = request.into_parts();
        if let Some(refused) = refuse_compressed(&head.headers) {
            return refused;
        }
        let message = match read_request(body).await {
            Ok(message) => message,
            Err(status) => return status.into_http(),
        };
        let request =
            Request::from_parts(MetadataMap::from_headers(head.headers), head.extensions, ());
        let scope = RpcScope::begin(&self.node, method.name, &request);
        let (incoming, _, ()) = request.into_parts();
        let answer = scope
            .run(async {
                let outgoing = self.outgoing(&incoming, &scope, method.key_required, message)?;
                relay(self.send(method.path, outgoing).await)
            })
            .await;
        match answer {
            Ok(reply) => answer_with(reply),
            Err(status) => status.into_http(),
        }
    }

    /// Sends `outgoing` (its body the request's framed message) to `path` through the
    /// downstream stack, and reads the answer.
    async fn send(
        &self,
        path: &'static str,
        outgoing: Request<Bytes>,
    ) -> Result<Response<Bytes>, Status> {
        let (metadata, extensions, body) = outgoing.into_parts();
        let mut request = http::Request::new(Body::new(http_body_util::Full::new(body)));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = http::Uri::from_static(path);
        *request.version_mut() = http::Version::HTTP_2;
        *request.headers_mut() = metadata.into_headers();
        request
            .headers_mut()
            .insert(TE, HeaderValue::from_static("trailers"));
        request.headers_mut().insert(CONTENT_TYPE, GRPC);
        *request.extensions_mut() = extensions;
        let response = self
            .below
            .clone()
            .oneshot(request)
            .await
            .map_err(Status::from_error)?;
        read_reply(response).await
    }
}

/// A body read to its end: its data and its trailers.
struct Whole {
    /// Every data frame's bytes, in order, in a buffer of their own: a frame is a slice of
    /// the connection's receive buffer, and a call that kept it (a retry holds its request
    /// for the whole call) would keep that whole buffer alive.
    data: Bytes,
    /// The trailers, when the body ended with them.
    trailers: Option<HeaderMap>,
}

/// Why a body could not be read whole.
enum Unread {
    /// It failed (the peer reset the stream, the connection broke): the failure.
    Failed(Status),
    /// It is longer than the limit: what was read of it, up to the limit.
    TooLong(Bytes),
}

/// Reads `body` to its end, up to `limit` bytes of data.
async fn read_whole(mut body: Body, limit: usize) -> Result<Whole, Unread> {
    let mut data = BytesMut::new();
    let mut trailers = None;
    while let Some(frame) = body.frame().await {
        match frame.map_err(Unread::Failed)?.into_data() {
            Ok(chunk) if data.len() + chunk.len() > limit => {
                data.extend_from_slice(&chunk[..limit - data.len()]);
                return Err(Unread::TooLong(data.freeze()));
            }
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(frame) => trailers = frame.into_trailers().ok().or(trailers),
        }
    }
    Ok(Whole {
        data: data.freeze(),
        trailers,
    })
}

/// The answer to a request with messages compressed (`grpc-encoding` other than
/// `identity`), as tonic's servers answer it: UNIMPLEMENTED, saying what is accepted. No
/// service of the chain accepts compression, and a relay that sent such a message on would
/// leave the ledger unable to read it.
fn refuse_compressed(headers: &HeaderMap) -> Option<http::Response<Body>> {
    use resilience::wire::names;
    match headers
        .get(&names::GRPC_ENCODING)
        .map(HeaderValue::as_bytes)
    {
        None | Some(b"identity") => None,
        Some(encoding) => {
            let mut refused = Status::unimplemented(format!(
                "the request is compressed ({}), which this service does not accept",
                String::from_utf8_lossy(encoding)
            ))
            .into_http::<Body>();
            refused.headers_mut().insert(
                names::GRPC_ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
            Some(refused)
        }
    }
}

/// The one message of a unary gRPC body, still in its frame (the flag byte and the length
/// prefix), as tonic's decoder would accept it: uncompressed, whole, at most
/// `max_message` bytes (RESOURCE_EXHAUSTED past it, as every service of the chain says).
/// Bytes past the message are left out, as tonic leaves them unread.
fn one_message(data: Bytes, max_message: usize) -> Result<Bytes, Status> {
    let Some(header) = data.get(..FRAME_HEADER) else {
        return Err(Status::internal(if data.is_empty() {
            "missing message: the body ended before one"
        } else {
            "the body ended inside a message's frame header"
        }));
    };
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    match header[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "a message is marked compressed, and no grpc-encoding was given",
            ));
        }
        flag => {
            return Err(Status::internal(format!(
                "a message's compression flag is {flag}, neither 0 nor 1"
            )));
        }
    }
    if length > max_message {
        return Err(Status::resource_exhausted(format!(
            "request message too large: found {length} bytes, the limit is: {max_message} bytes"
        )));
    }
    if data.len() < FRAME_HEADER + length {
        return Err(Status::internal(format!(
            "the body ended inside a message: {} of its {length} bytes came",
            data.len() - FRAME_HEADER
        )));
    }
    Ok(data.slice(..FRAME_HEADER + length))
}

/// The request's message, framed as it came ([`one_message`]).
async fn read_request(body: Body) -> Result<Bytes, Status> {
    match read_whole(body, FRAME_HEADER + MAX_REQUEST_BYTES).await {
        Ok(whole) => one_message(whole.data, MAX_REQUEST_BYTES),
        Err(Unread::Failed(status)) => Err(status),
        // Its length prefix says how large: unless the message fits and more came after
        // it, which no gRPC client sends to a unary method.
        Err(Unread::TooLong(read)) => match one_message(read, MAX_REQUEST_BYTES) {
            Err(status) => Err(status),
            Ok(_) => Err(Status::resource_exhausted(format!(
                "request body too large: more than {} bytes",
                FRAME_HEADER + MAX_REQUEST_BYTES
            ))),
        },
    }
}

/// The answer of the service below, as the tonic client would have read it: a failure
/// from a trailers-only answer, from the trailers or from the HTTP status, else the
/// reply's framed message and its metadata (headers and trailers).
async fn read_reply(response: http::Response<Body>) -> Result<Response<Bytes>, Status> {
    let (head, body) = response.into_parts();
    if let Some(status) = resilience::wire::failure_in(&head.headers) {
        return Err(status);
    }
    let whole = match read_whole(body, FRAME_HEADER + MAX_REPLY_BYTES).await {
        Ok(whole) => whole,
        Err(Unread::Failed(status)) => return Err(status),
        Err(Unread::TooLong(_)) => {
            return Err(Status::internal(format!(
                "the reply from below is over {MAX_REPLY_BYTES} bytes"
            )));
        }
    };
    // The code alone first: every answer's trailers carry one, and a success needs no more.
    let code = whole
        .trailers
        .as_ref()
        .and_then(resilience::wire::status_code)
        .or_else(|| resilience::wire::status_code(&head.headers));
    if code != Some(Code::Ok) {
        return Err(whole
            .trailers
            .as_ref()
            .and_then(resilience::wire::status_in)
            .or_else(|| resilience::wire::status_in(&head.headers))
            .unwrap_or_else(|| without_status(head.status)));
    }
    // A reply that tonic's client would not read is a fault below, not the caller's.
    let message = one_message(whole.data, MAX_REPLY_BYTES).map_err(|status| {
        Status::internal(format!(
            "the reply from below is not a gRPC message: {}",
            status.message()
        ))
    })?;
    let mut headers = head.headers;
    if let Some(trailers) = whole.trailers {
        headers.extend(trailers);
    }
    Ok(Response::from_parts(
        MetadataMap::from_headers(headers),
        message,
        Default::default(),
    ))
}

/// The status of an answer that carried no `grpc-status`, from its HTTP status, as gRPC's
/// clients infer it (grpc's `doc/http-grpc-status-mapping.md`); an HTTP 200 without one
/// broke the protocol mid-answer: UNKNOWN.
fn without_status(http: StatusCode) -> Status {
    let code = match http {
        StatusCode::BAD_REQUEST => Code::Internal,
        StatusCode::UNAUTHORIZED => Code::Unauthenticated,
        StatusCode::FORBIDDEN => Code::PermissionDenied,
        StatusCode::NOT_FOUND => Code::Unimplemented,
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::BAD_GATEWAY
        | StatusCode::SERVICE_UNAVAILABLE
        | StatusCode::GATEWAY_TIMEOUT => Code::Unavailable,
        _ => Code::Unknown,
    };
    Status::new(
        code,
        format!("the service below answered HTTP {http} without a grpc-status"),
    )
}

/// The gRPC answer for `reply`: its metadata in the headers, its framed message, and
/// trailers saying OK.
fn answer_with(reply: Response<Bytes>) -> http::Response<Body> {
    let (metadata, message, _) = reply.into_parts();
    let mut trailers = HeaderMap::with_capacity(1);
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let frames: [Result<Frame<Bytes>, Infallible>; 2] =
        [Ok(Frame::data(message)), Ok(Frame::trailers(trailers))];
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    let mut response = http::Response::new(Body::new(body));
    *response.headers_mut() = metadata.into_headers();
    response.headers_mut().insert(CONTENT_TYPE, GRPC);
    response
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn every_method_of_the_proto_is_forwarded() {
        let set = prost_types::FileDescriptorSet::decode(retrychain_proto::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set");
        let service = set
            .file
            .iter()
            .filter(|file| file.package() == "retrychain.v1")
            .flat_map(|file| &file.service)
            .find(|service| service.name() == "Payments")
            .expect("Payments");
        let mut in_proto: Vec<String> = service
            .method
            .iter()
            .map(|method| {
                assert!(
                    !method.client_streaming() && !method.server_streaming(),
                    "{}: a relay reads a request and a reply whole, unary methods only",
                    method.name()
                );
                format!("/retrychain.v1.Payments/{}", method.name())
            })
            .collect();
        let mut forwarded: Vec<String> = METHODS.iter().map(|m| m.path.to_owned()).collect();
        in_proto.sort();
        forwarded.sort();
        assert_eq!(forwarded, in_proto);
        for method in &METHODS {
            assert!(method.path.ends_with(&format!("/{}", method.name)));
        }
    }

    fn body(frames: Vec<Frame<Bytes>>) -> Body {
        let frames: Vec<Result<Frame<Bytes>, Status>> = frames.into_iter().map(Ok).collect();
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    /// A framed message of `len` bytes, its flag `flag`.
    fn framed(flag: u8, len: u32, payload: &[u8]) -> Vec<u8> {
        let mut bytes = vec![flag];
        bytes.extend_from_slice(&len.to_be_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    #[tokio::test]
    async fn a_body_is_read_whole_across_frames_with_its_trailers() {
        let whole = read_whole(
            body(vec![
                Frame::data(Bytes::from_static(b"\0\0\0")),
                Frame::data(Bytes::from_static(b"\0\x01")),
                Frame::data(Bytes::from_static(b"z")),
                Frame::trailers(HeaderMap::new()),
            ]),
            64,
        )
        .await
        .ok()
        .expect("read");
        assert_eq!(&whole.data[..], b"\0\0\0\0\x01z");
        assert!(whole.trailers.is_some());
        let long = body(vec![
            Frame::data(Bytes::from(vec![0; 40])),
            Frame::data(Bytes::from(vec![0; 40])),
        ]);
        match read_whole(long, 64).await {
            Err(Unread::TooLong(read)) => assert_eq!(read.len(), 64),
            _ => panic!("read past the limit"),
        }
    }

    #[tokio::test]
    async fn a_request_is_one_whole_uncompressed_message_within_the_limit() {
        let read = |bytes: Vec<u8>| read_request(body(vec![Frame::data(Bytes::from(bytes))]));
        // One message, and what came after it left out.
        let mut two = framed(0, 2, b"hi");
        two.extend(framed(0, 1, b"!"));
        assert_eq!(
            &read(two).await.expect("read")[..],
            &framed(0, 2, b"hi")[..]
        );
        // None, or cut short: what tonic's server answers INTERNAL.
        for cut in [vec![], vec![0, 0], framed(0, 5, b"abc")] {
            let status = read(cut.clone()).await.expect_err("cut");
            assert_eq!(status.code(), Code::Internal, "{cut:?}: {status:?}");
        }
        // Compressed, or a flag that means nothing.
        for flag in [1, 2, 255] {
            let status = read(framed(flag, 1, b"x")).await.expect_err("flag");
            assert_eq!(status.code(), Code::Internal, "flag {flag}");
        }
        // Over the limit, said from the prefix whether or not the rest came.
        let limit = MAX_REQUEST_BYTES as u32;
        for bytes in [
            framed(0, limit + 1, &[]),
            framed(0, limit + 1, &vec![0; MAX_REQUEST_BYTES + 1]),
        ] {
            let status = read(bytes).await.expect_err("too large");
            assert_eq!(status.code(), Code::ResourceExhausted);
            assert!(
                status
                    .message()
                    .contains(&format!("found {} bytes", limit + 1)),
                "{status:?}"
            );
        }
        // A message at the limit, with more after it than the body may hold.
        let mut past = framed(0, limit, &vec![0; MAX_REQUEST_BYTES]);
        past.extend(framed(0, 3, b"abc"));
        let status = read(past).await.expect_err("too long");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            read(framed(0, limit, &vec![0; MAX_REQUEST_BYTES]))
                .await
                .expect("at the limit")
                .len(),
            FRAME_HEADER + MAX_REQUEST_BYTES
        );
    }

    #[test]
    fn a_compressed_request_is_refused_saying_what_is_accepted() {
        let with = |encoding: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(encoding) = encoding {
                headers.insert("grpc-encoding", HeaderValue::from_static(encoding));
            }
            refuse_compressed(&headers)
        };
        assert!(with(None).is_none());
        assert!(with(Some("identity")).is_none());
        let refused = with(Some("gzip")).expect("refused");
        let status = resilience::wire::status_in(refused.headers()).expect("a status");
        assert_eq!(status.code(), Code::Unimplemented);
        assert_eq!(refused.headers()["grpc-accept-encoding"], "identity");
    }

    #[tokio::test]
    async fn a_reply_says_its_status_where_grpc_puts_it() {
        let ok_trailers = || {
            let mut map = HeaderMap::new();
            map.insert("grpc-status", HeaderValue::from_static("0"));
            map.insert("x-from-trailers", HeaderValue::from_static("yes"));
            map
        };
        let reply = |status: StatusCode, frames| {
            let mut response = http::Response::new(body(frames));
            *response.status_mut() = status;
            response
        };
        let message = || Frame::data(Bytes::from_static(b"\0\0\0\0\x02hi"));

        // A reply, its trailers' metadata kept.
        let ok = read_reply(reply(
            StatusCode::OK,
            vec![message(), Frame::trailers(ok_trailers())],
        ))
        .await
        .expect("ok");
        assert_eq!(&ok.get_ref()[..], b"\0\0\0\0\x02hi");
        assert!(ok.metadata().get("x-from-trailers").is_some());

        // A trailers-only failure.
        let failed = Status::unavailable("down").into_http::<Body>();
        let status = read_reply(failed).await.expect_err("failed");
        assert_eq!(
            (status.code(), status.message()),
            (Code::Unavailable, "down")
        );

        // A failure in the trailers, after headers.
        let mut trailers = HeaderMap::new();
        Status::aborted("later").add_header(&mut trailers).unwrap();
        let status = read_reply(reply(StatusCode::OK, vec![Frame::trailers(trailers)]))
            .await
            .expect_err("failed");
        assert_eq!(status.code(), Code::Aborted);

        // No grpc-status at all: from the HTTP status, UNKNOWN on a 200.
        for (http, code) in [
            (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable),
            (StatusCode::NOT_FOUND, Code::Unimplemented),
            (StatusCode::OK, Code::Unknown),
        ] {
            let status = read_reply(reply(http, vec![message()]))
                .await
                .expect_err("no status");
            assert_eq!(status.code(), code, "{http}");
        }

        // OK without a message, or with one tonic's client would not read: a fault below.
        let status = read_reply(reply(StatusCode::OK, vec![Frame::trailers(ok_trailers())]))
            .await
            .expect_err("no message");
        assert_eq!(status.code(), Code::Internal);
        let compressed = Frame::data(Bytes::from(framed(1, 2, b"hi")));
        let status = read_reply(reply(
            StatusCode::OK,
            vec![compressed, Frame::trailers(ok_trailers())],
        ))
        .await
        .expect_err("compressed");
        assert_eq!(status.code(), Code::Internal);
    }
}
