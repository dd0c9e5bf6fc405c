//! A real gRFC A6 client that no one here wrote — Python's grpcio (gRPC core) with
//! `grpc.enable_retries` and a service config `retryPolicy` of 5 attempts on UNAVAILABLE —
//! against the chain: "retry at one layer" must hold with the client counted as a layer.
//!
//! Needs a Python with `grpcio` and `grpcio-tools`: `$RETRYCHAIN_PYTHON` (scripts/test makes
//! a venv under target/ and sets it), else `python3`.

use std::{path::PathBuf, process::Command, sync::OnceLock};

use crate::support::*;

/// The client: one Charge through a channel configured by the service config, printing
/// what came back as one JSON line.
const CLIENT: &str = r#"
import json, sys
import grpc
from retrychain.v1 import retrychain_pb2, retrychain_pb2_grpc

target, account, amount, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
config = {
    "methodConfig": [{
        "name": [{"service": "retrychain.v1.Payments"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.01s",
            "maxBackoff": "0.1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }]
}
channel = grpc.insecure_channel(target, options=[
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(config)),
])
stub = retrychain_pb2_grpc.PaymentsStub(channel)
metadata = [("idempotency-key", key)] if key else None
request = retrychain_pb2.ChargeRequest(account_id=account, amount_cents=amount)
try:
    reply, call = stub.Charge.with_call(request, metadata=metadata, timeout=20)
    headers = dict(call.initial_metadata())
    print(json.dumps({"code": "OK", "charge_id": reply.charge_id,
                      "replayed": headers.get("idempotent-replayed")}))
except grpc.RpcError as error:
    trailers = dict(error.trailing_metadata() or ())
    print(json.dumps({"code": error.code().name, "details": error.details(),
                      "pushback": trailers.get("grpc-retry-pushback-ms")}))
"#;

/// The Python interpreter and a directory holding the generated stubs and the client.
fn python() -> &'static (String, PathBuf) {
    static READY: OnceLock<(String, PathBuf)> = OnceLock::new();
    READY.get_or_init(|| {
        let python = std::env::var("RETRYCHAIN_PYTHON").unwrap_or_else(|_| "python3".into());
        let dir = tempfile::tempdir().unwrap().keep();
        let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
        let output = Command::new(&python)
            .args(["-m", "grpc_tools.protoc", "-I", proto])
            .arg(format!("--python_out={}", dir.display()))
            .arg(format!("--grpc_python_out={}", dir.display()))
            .arg(format!("{proto}/retrychain/v1/retrychain.proto"))
            .output()
            .unwrap_or_else(|e| panic!("running {python}: {e}"));
        assert!(
            output.status.success(),
            "generating the Python stubs needs grpcio-tools (pip install grpcio grpcio-tools, \
             or set RETRYCHAIN_PYTHON): {}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::fs::write(dir.join("client.py"), CLIENT).unwrap();
        (python, dir)
    })
}

/// One Charge from grpcio; the JSON line it printed.
async fn grpcio_charge(target: &str, account: &str, key: &str) -> serde_json::Value {
    let (python, dir) = python();
    let args = [
        dir.join("client.py").display().to_string(),
        host_port(target),
        account.to_owned(),
        "500".to_owned(),
        key.to_owned(),
    ];
    let (python, dir) = (python.clone(), dir.clone());
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(args)
            .env("PYTHONPATH", dir)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test]
async fn a_retrying_grpcio_client_adds_no_layer_of_retries() {
    let chain = Chain::spawn(Options::default()).await;
    chain.fail_processor().await;

    // Through the edge: the edge retries (3 attempts), then answers with pushback -1,
    // which gRPC core obeys: 3 bottom calls, not 5 × 3 = 15.
    let answer = grpcio_charge(&chain.addrs[EDGE], &new_account(), &new_key()).await;
    assert_eq!(answer["code"], "UNAVAILABLE", "{answer}");
    assert_eq!(answer["pushback"], "-1", "{answer}");
    let stats = chain.all_stats().await;
    assert_eq!(stats[EDGE].requests_received, 1, "the client did not retry");
    assert_eq!(
        stats[LEDGER].downstream_attempts, 3,
        "3 bottom calls, not 15"
    );

    // The control: straight at hop2, which tries once and says nothing about retrying,
    // the same client does retry, five times — so the 3 above is the edge's doing.
    chain.reset_stats().await;
    let answer = grpcio_charge(&chain.addrs[1], &new_account(), &new_key()).await;
    assert_eq!(answer["code"], "UNAVAILABLE", "{answer}");
    assert_eq!(chain.stats(LEDGER).await.downstream_attempts, 5);
}

#[tokio::test]
async fn grpcio_charges_succeed_and_replay() {
    let chain = Chain::spawn(Options::default()).await;
    let (account, key) = (new_account(), new_key());
    let first = grpcio_charge(&chain.addrs[EDGE], &account, &key).await;
    assert_eq!(first["code"], "OK", "{first}");
    assert!(first["replayed"].is_null(), "{first}");
    let again = grpcio_charge(&chain.addrs[EDGE], &account, &key).await;
    assert_eq!(again["code"], "OK", "{again}");
    assert_eq!(again["replayed"], "true", "{again}");
    assert_eq!(again["charge_id"], first["charge_id"]);
    assert_eq!(chain.account(&account).await, Some((500, 1)));
}
