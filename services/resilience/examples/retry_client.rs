//! A plain tonic client whose retries come only from a gRPC service config file, calling a
//! small server that fails on purpose, and printing what the retry layer did.
//!
//! ```text
//! cargo run -p resilience --example retry_client                       # examples/service-config.json
//! cargo run -p resilience --example retry_client -- my-config.json 3   # the server fails 3 calls first
//! ```
//!
//! Nothing here is retrychain's chain: just `resilience::RetryLayer` over a `Channel`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Instant,
};

use resilience::{AttemptInfo, Refusal, RetryLayer, RetryObserver, ServiceConfig};
use retrychain_proto::v1::{
    Account, ChargeReply, ChargeRequest, GetAccountRequest,
    payments_client::PaymentsClient,
    payments_server::{Payments, PaymentsServer},
};
use tonic::{Request, Response, Status, transport::Server};

/// Fails its first `failures` calls with UNAVAILABLE, then charges.
struct Flaky {
    failures: u32,
    calls: AtomicU32,
}

#[tonic::async_trait]
impl Payments for Flaky {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let previous = request
            .metadata()
            .get("grpc-previous-rpc-attempts")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none");
        if call <= self.failures {
            println!(
                "  server: call {call} (grpc-previous-rpc-attempts: {previous}) -> UNAVAILABLE"
            );
            return Err(Status::unavailable("failing on purpose"));
        }
        println!("  server: call {call} (grpc-previous-rpc-attempts: {previous}) -> OK");
        let charge = request.into_inner();
        Ok(Response::new(ChargeReply {
            charge_id: format!("charge-{call}"),
            account_id: charge.account_id,
            amount_cents: charge.amount_cents,
            balance_cents: charge.amount_cents,
        }))
    }

    async fn get_account(
        &self,
        _: Request<GetAccountRequest>,
    ) -> Result<Response<Account>, Status> {
        Err(Status::unimplemented("not in this example"))
    }
}

/// Prints what the layer does.
struct Print(Instant);

impl RetryObserver for Print {
    fn attempt(&self, path: &str, attempt: &AttemptInfo) {
        let why = match attempt.retry_of {
            Some(code) => format!(", a retry of {code:?}"),
            None => String::new(),
        };
        println!(
            "  layer:  {path} attempt {} at {:?}{why}",
            attempt.previous + 1,
            self.0.elapsed()
        );
    }

    fn refused(&self, path: &str, reason: Refusal) {
        println!("  layer:  {path} retry refused by the {}", reason.as_str());
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/service-config.json").into()
    });
    let failures: u32 = args.next().map_or(Ok(2), |n| n.parse())?;
    let config = ServiceConfig::parse(&std::fs::read_to_string(&path)?)?;
    println!("service config {path}: {config:#?}");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .add_service(PaymentsServer::new(Flaky {
                failures,
                calls: AtomicU32::new(0),
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{address}"))?.connect_lazy();
    let layer = RetryLayer::new(config).observer(Arc::new(Print(Instant::now())));
    let mut client =
        PaymentsClient::new(tower::ServiceBuilder::new().layer(layer).service(channel));

    println!("\nOne Charge; the server fails the first {failures} calls:");
    let mut request = Request::new(ChargeRequest {
        account_id: "alice".into(),
        amount_cents: 500,
    });
    request.set_timeout(std::time::Duration::from_secs(5));
    match client.charge(request).await {
        Ok(reply) => println!("\nclient: OK, {:?}", reply.into_inner()),
        Err(status) => println!("\nclient: {:?}: {}", status.code(), status.message()),
    }
    Ok(())
}
