//! What a newcomer tripped on, each through the real binary: boolean flags from the
//! environment in their usual spellings, and `up`'s options that contradict each other.

use std::time::Duration;

use crate::support::*;
use retrychain_proto::v1::{Faults, control_client::ControlClient};
use tonic::Code;

/// A relay started with `RETRYCHAIN_FAULT_INJECTION` (and the other booleans) set to
/// `value`: whether its Control takes faults.
async fn fault_injection_with(value: &str) -> Result<(), tonic::Status> {
    let launch = Launch {
        program: Some(BIN.into()),
        args: args(&[
            "relay",
            "--listen",
            "127.0.0.1:0",
            "--downstream",
            "http://127.0.0.1:9",
        ]),
        env: [
            "RETRYCHAIN_FAULT_INJECTION",
            "RETRYCHAIN_ALLOW_RETRY_MODE_OVERRIDE",
            "RETRYCHAIN_NO_BUDGET",
        ]
        .into_iter()
        .map(|var| (var.to_owned(), value.to_owned()))
        .collect(),
        logs: Logs::Capture,
    };
    let relay = ChildService::start("relay", launch)
        .await
        .unwrap_or_else(|e| panic!("a relay with booleans set to {value:?} did not start: {e:#}"));
    let mut control = ControlClient::new(connect(&relay.addr.admin_url).await);
    let answer = control.set_faults(Faults::default()).await.map(|_| ());
    relay.stop().await;
    answer
}

/// `RETRYCHAIN_FAULT_INJECTION=1` used to be refused ("possible values: true, false") and
/// every service exited. Every boolean flag takes 1/0, true/false, yes/no, on/off from its
/// environment variable.
#[tokio::test]
async fn boolean_flags_take_the_usual_spellings_from_the_environment() {
    for yes in ["1", "true", "yes", "on", "TRUE", "Yes"] {
        assert!(fault_injection_with(yes).await.is_ok(), "{yes:?} means on");
    }
    for no in ["0", "false", "no", "off"] {
        let refused = fault_injection_with(no).await.expect_err(no);
        assert_eq!(refused.code(), Code::PermissionDenied, "{no:?} means off");
    }
}

/// One port of `up`'s layout taken (by this test; in the trial, by an outgoing connection
/// in the kernel's ephemeral range): `up` names it, and who holds it, before it starts
/// anything — not a chain dead half-way through its thirty ports.
#[tokio::test]
async fn up_names_a_busy_port_before_starting_anything() {
    let base = free_base_port();
    let busy = std::net::TcpListener::bind(("127.0.0.1", base + 2)).unwrap();
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(BIN)
            .args(["up", "--base-port", &base.to_string()])
            .env_remove("DATABASE_URL")
            .output(),
    )
    .await
    .expect("up answers at once")
    .unwrap();
    drop(busy);
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains(&format!("port {} (hop3) is taken", base + 2)),
        "{said}"
    );
    assert!(said.contains("nothing was started"), "{said}");
    assert!(said.contains("--base-port"), "{said}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("started, pid"),
        "no service was started"
    );
}

/// 256 idle connections from one address (a NAT, a load balancer, an attacker on the same
/// host) used to lock every other client at that address out. Now, at the per-peer cap,
/// the oldest connection idle since [`retrychain_node::limits::EVICTABLE_AFTER`] is
/// evicted to make room: a new client that makes requests is served. (How the evicted one
/// is told, a GOAWAY: `connections::an_idle_connection_…`.)
#[tokio::test]
async fn a_client_is_served_beside_256_idle_connections_from_its_address() {
    use tokio::io::AsyncWriteExt;
    let chain = Chain::spawn(Options::default()).await;
    let edge = chain.addrs[EDGE].trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..256 {
        let mut socket = tokio::net::TcpStream::connect(&edge).await.unwrap();
        // The preface and an empty SETTINGS frame: a connection, and nothing asked of it.
        socket
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .await
            .unwrap();
        idle.push(socket);
    }
    tokio::time::sleep(retrychain_node::limits::EVICTABLE_AFTER + Duration::from_millis(200)).await;
    let newcomer = retrychain_proto::v1::payments_client::PaymentsClient::new(
        connect(&chain.addrs[EDGE]).await,
    );
    let reply = charge_on(&newcomer, &new_account(), 100, None, Duration::from_secs(5)).await;
    assert!(
        reply.is_ok(),
        "a new client behind the idle ones: {reply:?}"
    );
}

/// `DATABASE_URL` left in the shell and `up --postgres ha`: which database was meant? `up`
/// says so and starts nothing, instead of running on that database without a word.
#[tokio::test]
async fn up_refuses_a_database_url_with_postgres_ha() {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(BIN)
            .args(["up", "--postgres", "ha", "--base-port", "1"])
            .env("DATABASE_URL", "postgres://somebody@127.0.0.1:1/elsewhere")
            .output(),
    )
    .await
    .expect("up answers at once")
    .unwrap();
    assert!(!output.status.success());
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("--postgres ha") && said.contains("DATABASE_URL"),
        "{said}"
    );
}
