//! How the edge says no to a connection, over the wire: a connection past its address's
//! limit, and one evicted to make room for another. Each is told with an HTTP/2 GOAWAY
//! (up to a bound on those being told at once), so its client learns which calls were not
//! processed, and a charge is made once or not at all.

use std::{net::IpAddr, time::Duration};

use crate::support::*;
use retrychain_proto::v1::payments_client::PaymentsClient;
use retrychain_tls::{Connector, Identity};
use tonic::{Code, transport::Channel};

/// The edge's limit on connections from one address, in these tests.
const PER_PEER: u32 = 4;

/// A chain whose edge holds at most [`PER_PEER`] connections from one address.
async fn chain_with_a_small_per_peer_limit() -> Chain {
    let mut options = Options::default();
    options.spec.edge().service.max_connections_per_peer = PER_PEER;
    Chain::spawn(options).await
}

/// A client of the edge on a connection of its own, made from `from` (a loopback address
/// of the test's: the harness's own connection, from 127.0.0.1, is not counted with it).
async fn client_from(chain: &Chain, from: &str) -> PaymentsClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(chain.addrs[EDGE].clone())
        .unwrap()
        .local_address(Some(from.parse::<IpAddr>().unwrap()))
        .connect()
        .await
        .unwrap();
    PaymentsClient::new(channel)
}

/// A TCP connection to the edge from `from`.
async fn socket_from(chain: &Chain, from: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket
        .connect(host_port(&chain.addrs[EDGE]).parse().unwrap())
        .await
        .unwrap()
}

/// A raw HTTP/2 connection to the edge from `from`.
async fn h2_from(chain: &Chain, from: &str) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = socket_from(chain, from).await;
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    send
}

/// The types of the HTTP/2 frames in `bytes` (a server's side of a connection), in order.
fn frame_types(bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let length = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
        types.push(bytes[at + 3]);
        at += 9 + length;
    }
    types
}

/// How a call on a connection the edge refused may fail: UNAVAILABLE, tonic's report of
/// the GOAWAY's REFUSED_STREAM (nothing was processed; safe to send again); or CANCELLED
/// from hyper's "connection closed", a call still queued in the client when the refused
/// connection ended, never sent (a race in hyper's client: [`assert_mostly_unavailable`]
/// bounds it). Never UNKNOWN ("connection reset") or INTERNAL, which do not say whether
/// the call was processed.
fn assert_refused(status: &tonic::Status) {
    let unsent = status.code() == Code::Cancelled
        && format!("{:?}", std::error::Error::source(status)).contains("connection closed");
    assert!(
        status.code() == Code::Unavailable || unsent,
        "a refused connection's call: {status:?}"
    );
}

/// Refused calls are told UNAVAILABLE, all but a few: with the edge closing a connection
/// it had no room for without a GOAWAY, these tests' calls read CANCELLED (storm's at
/// 1,000 connections, UNKNOWN and CANCELLED).
fn assert_mostly_unavailable(codes: &[Code]) {
    let refused = codes.iter().filter(|code| **code != Code::Ok).count();
    let unavailable = codes
        .iter()
        .filter(|code| **code == Code::Unavailable)
        .count();
    assert!(
        refused > 0 && unavailable * 10 >= refused * 9,
        "refusals reach tonic as UNAVAILABLE: {}",
        tally(codes)
    );
}

/// How many of `codes` are each code, for the test's output.
fn tally(codes: &[Code]) -> String {
    let mut counts = std::collections::BTreeMap::new();
    for code in codes {
        *counts.entry(format!("{code:?}")).or_insert(0) += 1;
    }
    format!("{counts:?}")
}

/// HTTP/2's GOAWAY frame type.
const GOAWAY: u8 = 0x7;

/// A client that has filled its address's connections with calls opens one more: the edge
/// answers it with a GOAWAY whose last stream is 0 and whose code is REFUSED_STREAM (no
/// call on it was processed, each may be sent again), and a call on it fails with that
/// code, which tonic reports as UNAVAILABLE. Before, the edge closed such a connection
/// without a word: the calls on it failed UNKNOWN or CANCELLED, codes that do not say
/// whether a charge was made. The connections the edge holds go on serving, and the
/// ledger counts exactly the charges answered OK.
#[tokio::test]
async fn a_connection_past_its_address_limit_is_refused_with_a_goaway_and_charges_nothing() {
    let chain = chain_with_a_small_per_peer_limit().await;
    let from = "127.0.0.5";
    let account = new_account();
    let deadline = Duration::from_secs(5);

    // The address's connections, each busy with calls.
    let mut held = Vec::new();
    for _ in 0..PER_PEER {
        let client = client_from(&chain, from).await;
        charge_on(&client, &account, 100, None, deadline)
            .await
            .expect("a charge on a connection the edge holds");
        held.push(client);
    }
    let mut ok = u64::from(PER_PEER);

    // One more, spoken to in raw HTTP/2: the refusal as it is on the wire.
    let connection = h2_from(&chain, from).await;
    let refused = async {
        let mut sender = connection.ready().await?;
        let request = http::Request::post(format!(
            "{}/retrychain.v1.Payments/Charge",
            chain.addrs[EDGE]
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let (response, _body) = sender.send_request(request, false)?;
        response.await.map(|_| ())
    }
    .await
    .expect_err("a connection past the limit serves nothing");
    assert!(refused.is_go_away(), "a GOAWAY, not a reset: {refused:?}");
    assert_eq!(
        refused.reason(),
        Some(h2::Reason::REFUSED_STREAM),
        "{refused:?}"
    );

    // Then as a tonic client sees it, while the held connections go on charging.
    let excess = (0..8).map(|_| {
        let (chain, account) = (&chain, &account);
        async move {
            let client = client_from(chain, from).await;
            let mut codes = Vec::new();
            for _ in 0..5 {
                match charge_on(&client, account, 100, None, deadline).await {
                    Ok(_) => codes.push(Code::Ok),
                    Err(status) => {
                        assert_refused(&status);
                        codes.push(status.code());
                    }
                }
            }
            codes
        }
    });
    let busy = held.iter().map(|client| {
        let account = &account;
        async move {
            for _ in 0..10 {
                charge_on(client, account, 100, None, deadline)
                    .await
                    .expect("a charge on a connection the edge holds");
            }
        }
    });
    let (excess, _) = tokio::join!(
        futures::future::join_all(excess),
        futures::future::join_all(busy)
    );
    ok += u64::from(PER_PEER) * 10;
    let codes: Vec<Code> = excess.into_iter().flatten().collect();
    eprintln!("calls on refused connections: {}", tally(&codes));
    assert!(
        !codes.contains(&Code::Ok),
        "no call went through a refused connection: {codes:?}"
    );
    assert_mostly_unavailable(&codes);
    let (_, charges) = chain.account(&account).await.unwrap();
    assert_eq!(
        charges as u64, ok,
        "exactly the charges answered OK were made"
    );
}

/// A burst of new connections from one address, each sending a call at once: past the
/// limit, the edge evicts none of them (each is taken for a client about to send its first
/// call, and evicting it would break that call), and refuses the rest as above. No call
/// fails with a code that hides whether it was charged, and the ledger counts exactly the
/// charges answered OK. Measured before the rule: evicted with a GOAWAY (NO_ERROR), a call
/// tonic was sending on a connection failed INTERNAL.
#[tokio::test]
async fn a_burst_of_connections_breaks_no_call_it_has_sent() {
    let chain = chain_with_a_small_per_peer_limit().await;
    let from = "127.0.0.6";
    let account = new_account();
    let burst = (0..16).map(|_| {
        let (chain, account) = (&chain, &account);
        async move {
            let client = client_from(chain, from).await;
            let mut codes = Vec::new();
            for _ in 0..3 {
                match charge_on(&client, account, 100, None, Duration::from_secs(5)).await {
                    Ok(_) => codes.push(Code::Ok),
                    Err(status) => {
                        assert_refused(&status);
                        codes.push(status.code());
                    }
                }
            }
            codes
        }
    });
    let codes: Vec<Code> = futures::future::join_all(burst)
        .await
        .into_iter()
        .flatten()
        .collect();
    eprintln!("a burst of 16 connections, 3 calls each: {}", tally(&codes));
    let ok = codes.iter().filter(|code| **code == Code::Ok).count();
    assert!(ok > 0, "the connections the edge holds serve: {codes:?}");
    assert_mostly_unavailable(&codes);
    let (_, charges) = chain.account(&account).await.unwrap_or_default();
    assert_eq!(
        charges as usize, ok,
        "exactly the charges answered OK were made: {codes:?}"
    );
}

/// Connections holding the address's every slot without a request (a NAT's, a load
/// balancer's, an attacker's on the same host) do not lock out a client behind them: once
/// they have been idle [`retrychain_node::limits::EVICTABLE_AFTER`], the oldest is evicted
/// to make room. It is told with a GOAWAY, and closed when it stays idle after it
/// ([`retrychain_node::limits::EVICTED_LINGER`]). Before that, they are taken for a
/// client's connections about to send their first calls, and the newcomer is refused.
#[tokio::test]
async fn an_idle_connection_evicted_to_make_room_is_sent_a_goaway_then_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chain = chain_with_a_small_per_peer_limit().await;
    let from = "127.0.0.7";
    let mut idle = Vec::new();
    let opened = std::time::Instant::now();
    for _ in 0..PER_PEER {
        let mut socket = socket_from(&chain, from).await;
        // The preface, an empty SETTINGS frame and ten PINGs (as many bytes as an idle
        // client's answers to half an hour of keepalive PINGs): a connection, and nothing
        // asked of it. Counted in bytes, it passed for one that makes requests.
        socket
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .await
            .unwrap();
        for _ in 0..10 {
            socket
                .write_all(b"\x00\x00\x08\x06\x00\x00\x00\x00\x00idle....")
                .await
                .unwrap();
        }
        idle.push(socket);
    }
    let refused = client_from(&chain, from).await;
    let answer = charge_on(&refused, &new_account(), 100, None, Duration::from_secs(5)).await;
    // On a machine slow enough that the idle connections were already old enough, the
    // newcomer may have evicted one: this check is for a machine that was not.
    if opened.elapsed() < retrychain_node::limits::EVICTABLE_AFTER {
        let status =
            answer.expect_err("young idle connections are not evicted: the newcomer is refused");
        assert_refused(&status);
    } else {
        println!(
            "the idle connections took {:?} to open: the refusal of a newcomer among young ones went unchecked",
            opened.elapsed()
        );
    }
    drop(refused);

    tokio::time::sleep(retrychain_node::limits::EVICTABLE_AFTER + Duration::from_millis(200)).await;
    let client = client_from(&chain, from).await;
    charge_on(&client, &new_account(), 100, None, Duration::from_secs(5))
        .await
        .expect("a client behind the idle connections is served");

    // What each idle connection reads, until it is closed or the GOAWAY's grace is long
    // past.
    let reads = idle.iter_mut().map(|socket| async move {
        let mut read = Vec::new();
        let closed = tokio::time::timeout(
            retrychain_node::limits::EVICTED_LINGER + Duration::from_secs(2),
            async {
                let mut buf = [0u8; 1024];
                loop {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => read.extend_from_slice(&buf[..n]),
                    }
                }
            },
        )
        .await
        .is_ok();
        (closed, frame_types(&read))
    });
    let seen = futures::future::join_all(reads).await;
    let evicted: Vec<_> = seen.iter().filter(|(closed, _)| *closed).collect();
    assert_eq!(evicted.len(), 1, "one connection made room: {seen:?}");
    assert!(
        evicted[0].1.contains(&GOAWAY),
        "it was told with a GOAWAY before it was closed: {seen:?}"
    );
    assert!(
        seen.iter()
            .filter(|(closed, _)| !*closed)
            .all(|(_, frames)| !frames.contains(&GOAWAY)),
        "the others were left alone: {seen:?}"
    );
}

/// Over TLS, a connection past the limit is closed before its handshake (a GOAWAY would
/// first cost the edge a handshake for a connection it does not want): its client fails to
/// connect, and reports the call UNAVAILABLE before sending it. Nothing is charged, and
/// the connections the edge holds go on serving.
#[tokio::test]
async fn over_tls_a_connection_past_the_limit_fails_to_connect_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let (chain, tls) = tls_chain(dir.path(), |spec| {
        spec.edge().service.max_connections_per_peer = PER_PEER;
    })
    .await;
    let url = chain.addrs().edge.url.clone();
    let connector = Connector::new(tls.operator().unwrap(), Identity::of_service("edge"));
    // The operator's client, on a connection of its own from 127.0.0.8.
    let client = || {
        let connector = connector.clone();
        let dial = tower::service_fn(move |uri: http::Uri| {
            let connector = connector.clone();
            async move {
                let socket = tokio::net::TcpSocket::new_v4()?;
                socket.bind("127.0.0.8:0".parse().unwrap())?;
                let port = uri.port_u16().unwrap_or(443);
                let tcp = socket
                    .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
                    .await?;
                let stream = connector.handshake(&uri, tcp).await?;
                std::io::Result::Ok(hyper_util::rt::TokioIo::new(stream))
            }
        });
        PaymentsClient::new(
            tonic::transport::Endpoint::from_shared(url.clone())
                .unwrap()
                .connect_with_connector_lazy(dial),
        )
    };
    let account = new_account();
    let deadline = Duration::from_secs(5);
    let mut held = Vec::new();
    for _ in 0..PER_PEER {
        let payments = client();
        charge_on(&payments, &account, 100, None, deadline)
            .await
            .expect("a charge on a connection the edge holds");
        held.push(payments);
    }
    for _ in 0..3 {
        let status = charge_on(&client(), &account, 100, None, deadline)
            .await
            .expect_err("a connection past the limit serves nothing");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    for payments in &held {
        charge_on(payments, &account, 100, None, deadline)
            .await
            .expect("the held connections go on serving");
    }
    let mut reader = PaymentsClient::new(tls.connect(&url, "edge").await.unwrap());
    let balance = reader
        .get_account(retrychain_proto::v1::GetAccountRequest {
            account_id: account.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        balance.balance_cents,
        100 * 2 * i64::from(PER_PEER),
        "exactly the charges answered OK were made"
    );
}

/// A client that opens connection after connection and never closes one (nor reads what
/// it is told) holds no more than its address's limit and
/// [`retrychain_node::limits::MOST_LEAVING_PER_PEER`] refusals being told: past those,
/// a connection its address has no room for is closed at once, without its GOAWAY.
/// Without the bound, each refusal would hold one of the listener's places for its
/// [`retrychain_node::limits::REFUSED_LINGER`], and a fast enough client would hold them
/// all.
#[tokio::test]
async fn refusals_being_told_are_bounded_per_address() {
    use retrychain_node::limits::{MOST_LEAVING_PER_PEER, REFUSED_LINGER};
    use tokio::io::AsyncReadExt;
    let chain = chain_with_a_small_per_peer_limit().await;
    let from = "127.0.0.10";
    let mut held = Vec::new();
    for _ in 0..PER_PEER {
        let client = client_from(&chain, from).await;
        charge_on(&client, &new_account(), 100, None, Duration::from_secs(5))
            .await
            .expect("a charge on a connection the edge holds");
        held.push(client);
    }
    let opened = std::time::Instant::now();
    let mut sockets = Vec::new();
    for _ in 0..MOST_LEAVING_PER_PEER + 16 {
        sockets.push(socket_from(&chain, from).await);
    }
    let took = opened.elapsed();
    // What each has been told within a fraction of the refusals' linger.
    let told = sockets.iter_mut().map(|socket| async move {
        let mut read = Vec::new();
        let _ = tokio::time::timeout(REFUSED_LINGER / 4, async {
            let mut buf = [0u8; 256];
            while let Ok(n @ 1..) = socket.read(&mut buf).await {
                read.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        frame_types(&read).contains(&GOAWAY)
    });
    let told = futures::future::join_all(told).await;
    let goaways = told.iter().filter(|told| **told).count();
    if took < REFUSED_LINGER / 2 {
        assert_eq!(
            goaways,
            MOST_LEAVING_PER_PEER,
            "refusals told at once, of {} refused: {told:?}",
            told.len()
        );
        assert!(
            !told[told.len() - 1],
            "the last refusals are closed without a GOAWAY"
        );
    } else {
        println!(
            "{} connections took {took:?} to open: the bound went unchecked",
            told.len()
        );
    }
    for client in &held {
        charge_on(client, &new_account(), 100, None, Duration::from_secs(5))
            .await
            .expect("the held connections go on serving");
    }
}
