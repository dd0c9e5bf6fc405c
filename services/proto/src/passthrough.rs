//! `Payments` for a service that forwards messages without reading them: the relays
//! (hop2, hop3, hop4) serve and call it with each request and reply left as the bytes it
//! arrived in.
//!
//! A relay acts on metadata alone (the deadline, the idempotency key, the trace, the retry
//! mode, the caller's signed statement); the edge has already decoded and validated the
//! message, and the ledger decodes it again before acting on it. Decoding it into a prost
//! struct at each relay and encoding it back would cost every forwarded call two
//! allocations and a copy for nothing, and a malformed message still gets its status
//! where it is first decoded: at the edge, or at the ledger for a caller that skips the
//! edge. On the wire nothing differs: the service and method names are the proto's, so
//! the server is reached on the same paths and the client calls the same ones.

use prost::bytes::{Buf, BufMut, Bytes};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

pub use generated::{payments_client, payments_server};

/// tonic-build's client and server for [`BytesCodec`], from `build.rs`.
#[allow(clippy::default_constructed_unit_structs)] // generated code builds every codec with `default()`
mod generated {
    include!(concat!(env!("OUT_DIR"), "/retrychain.v1.Payments.rs"));
}

/// A gRPC message as its encoded bytes: decoding takes the frame's payload without
/// copying it (it is split off the receive buffer), encoding copies it once into the
/// send buffer.
#[derive(Debug, Clone, Copy, Default)]
pub struct BytesCodec;

impl Codec for BytesCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self::Encoder {
        *self
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl Encoder for BytesCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for BytesCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1::{
        ChargeReply, ChargeRequest,
        payments_server::{Payments as Decoding, PaymentsServer as DecodingServer},
    };

    /// Answers with the request's account id as the charge id: proves what arrived.
    #[derive(Debug, Clone, Copy)]
    struct Echo;

    #[tonic::async_trait]
    impl Decoding for Echo {
        async fn charge(
            &self,
            request: tonic::Request<ChargeRequest>,
        ) -> Result<tonic::Response<ChargeReply>, Status> {
            let request = request.into_inner();
            Ok(tonic::Response::new(ChargeReply {
                charge_id: request.account_id,
                amount_cents: request.amount_cents,
                ..Default::default()
            }))
        }

        async fn get_account(
            &self,
            _: tonic::Request<crate::v1::GetAccountRequest>,
        ) -> Result<tonic::Response<crate::v1::Account>, Status> {
            Err(Status::unimplemented("echo"))
        }
    }

    #[test]
    fn both_servers_serve_the_same_service() {
        use tonic::server::NamedService;
        assert_eq!(
            <payments_server::PaymentsServer<()> as NamedService>::NAME,
            <DecodingServer<()> as NamedService>::NAME,
        );
    }

    #[tokio::test]
    async fn a_message_sent_as_bytes_arrives_as_the_proto_message_and_the_reply_comes_back_as_its_bytes()
     {
        let mut client = payments_client::PaymentsClient::new(DecodingServer::new(Echo));
        let request = ChargeRequest {
            account_id: "acct-ü".to_owned(),
            amount_cents: 1234,
        };
        let reply = client
            .charge(Bytes::from(request.encode_to_vec()))
            .await
            .expect("served")
            .into_inner();
        let reply = ChargeReply::decode(reply).expect("a ChargeReply");
        assert_eq!(reply.charge_id, "acct-ü");
        assert_eq!(reply.amount_cents, 1234);
    }

    #[tokio::test]
    async fn bytes_that_are_no_message_are_refused_where_they_are_decoded() {
        let mut client = payments_client::PaymentsClient::new(DecodingServer::new(Echo));
        let status = client
            .charge(Bytes::from_static(&[0xff, 0xff, 0xff]))
            .await
            .expect_err("not a ChargeRequest");
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    }
}
