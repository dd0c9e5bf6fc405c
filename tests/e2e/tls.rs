//! TLS with identities, through real processes and real handshakes: a chain started as
//! `up --tls` starts it (a throwaway CA, every tier's certificate), called as the operator
//! would call it — and as an intruder would: without a certificate, with one from another
//! authority, with the right authority but the wrong identity, in plaintext. Then the
//! certificates and the authority itself are rotated under load, and a bad file is
//! dropped in, without a failed call.

use std::{
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::support::*;
use retrychain_harness::{ChainSpec, ChainTls, LocalChain};
use retrychain_proto::v1::{
    GetAccountRequest, GetStatsRequest, control_client::ControlClient,
    payments_client::PaymentsClient,
};
use retrychain_tls::{ClientAuth, Connector, Identity, Tls, TlsFiles, issue::Authority};
use tonic::{Code, transport::Endpoint};

/// A channel to `url` presenting `files`' certificate, to a server that must be `expected`.
async fn channel_as(
    files: TlsFiles,
    url: &str,
    expected: &str,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let tls = Tls::load(files, ClientAuth::Optional).unwrap();
    Endpoint::from_shared(url.to_owned())
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(Connector::new(tls, Identity::of_service(expected)))
        .await
}

/// Requests hop3 has handled, from its Control, asked over TLS as the operator.
async fn handled(tls: &ChainTls, admin_url: &str) -> u64 {
    let mut control = ControlClient::new(tls.connect(admin_url, "hop3").await.unwrap());
    let stats = control.get_stats(GetStatsRequest {}).await.unwrap();
    stats.into_inner().requests_received
}

#[tokio::test]
async fn a_chain_over_mutual_tls_charges_and_each_tier_accepts_only_the_one_above() {
    let dir = tempfile::tempdir().unwrap();
    let (chain, tls) = tls_chain(dir.path(), |_| {}).await;
    let addrs = chain.addrs();
    assert!(addrs.edge.url.starts_with("https://"), "{}", addrs.edge.url);

    // The operator, over TLS: a charge, and its repeat replayed.
    let edge = tls.connect(&addrs.edge.url, "edge").await.unwrap();
    let mut payments = PaymentsClient::new(edge);
    let account = new_account();
    let first = payments
        .charge(charge(
            &account,
            500,
            Some("tls-1"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap();
    assert_eq!(first.get_ref().balance_cents, 500);
    let again = payments
        .charge(charge(
            &account,
            500,
            Some("tls-1"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap();
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    let balance = payments
        .get_account(GetAccountRequest {
            account_id: account.clone(),
        })
        .await
        .unwrap();
    assert_eq!(balance.get_ref().balance_cents, 500);

    // Plaintext to the edge's TLS port: no answer of any kind.
    let plain = addrs.edge.url.replacen("https://", "http://", 1);
    let mut plaintext = PaymentsClient::new(Endpoint::from_shared(plain).unwrap().connect_lazy());
    let refused = plaintext
        .charge(charge(
            &account,
            1,
            Some("tls-plain"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap_err();
    println!("plaintext to the edge: {refused:?}");
    assert_ne!(refused.code(), Code::Ok);

    // hop3, reached directly with a certificate of the right authority but the wrong
    // identity (the operator's): PERMISSION_DENIED, naming it, before any work.
    let before = handled(&tls, &addrs.hop3.admin_url).await;
    let hop3 = tls.connect(&addrs.hop3.url, "hop3").await.unwrap();
    let denied = PaymentsClient::new(hop3)
        .charge(charge(
            &account,
            1,
            Some("tls-bypass"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(
        denied
            .message()
            .contains("spiffe://retrychain/operator may not call")
            && denied.message().contains("spiffe://retrychain/hop2"),
        "{denied:?}"
    );
    assert_eq!(
        handled(&tls, &addrs.hop3.admin_url).await,
        before,
        "no work done"
    );

    // A certificate naming hop2 from another authority (its client trusts ours): the
    // handshake is refused.
    let elsewhere = tempfile::tempdir().unwrap();
    let other = ChainTls::create(elsewhere.path()).unwrap();
    let forged = TlsFiles {
        ca: tls.files_of("operator").ca,
        ..other.files_of("hop2")
    };
    // (In TLS 1.3 the client's side of the handshake may finish before the server has
    // judged its certificate: then the first call fails instead.)
    match channel_as(forged, &addrs.hop3.url, "hop3").await {
        Err(error) => println!("hop2's name from another CA: {error:?}"),
        Ok(channel) => {
            let status = PaymentsClient::new(channel)
                .charge(charge(
                    &account,
                    1,
                    Some("tls-forged"),
                    Duration::from_secs(5),
                    &[],
                ))
                .await
                .unwrap_err();
            println!("hop2's name from another CA: {status:?}");
            assert!(
                !matches!(status.code(), Code::Ok | Code::PermissionDenied),
                "the handshake was not refused: {status:?}"
            );
        }
    }
    assert_eq!(
        handled(&tls, &addrs.hop3.admin_url).await,
        before,
        "no work done"
    );

    // Control on the admin port, over TLS too: the operator steers, a tier may not; Prometheus
    // (the CA alone, no client certificate, HTTP/1.1) still reads /metrics.
    let as_hop2 = channel_as(tls.files_of("hop2"), &addrs.hop3.admin_url, "hop3")
        .await
        .unwrap();
    let steered = ControlClient::new(as_hop2)
        .get_stats(GetStatsRequest {})
        .await
        .unwrap_err();
    assert_eq!(steered.code(), Code::PermissionDenied, "{steered:?}");
    assert!(
        steered
            .message()
            .contains("spiffe://retrychain/hop2 may not call"),
        "{steered:?}"
    );
    let metrics_url = format!("{}/metrics", addrs.hop3.admin_url);
    let metrics = Command::new("curl")
        .args(["-sf", "--http1.1", "--cacert"])
        .arg(tls.files_of("operator").ca)
        .arg(&metrics_url)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        metrics.status.success() && text.contains("retrychain_"),
        "{metrics_url}: {text}{}",
        String::from_utf8_lossy(&metrics.stderr)
    );
    let plain_admin = addrs.hop3.admin_url.replacen("https://", "http://", 1);
    let plain = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!("{plain_admin}/metrics"))
        .output()
        .unwrap();
    assert!(
        !plain.status.success(),
        "plaintext /metrics answered on a TLS admin port"
    );

    // A client that means to call hop2 but reaches hop3: its own check refuses the server.
    let mistaken = channel_as(tls.files_of("operator"), &addrs.hop3.url, "hop2").await;
    let error = mistaken.expect_err("hop3 is not hop2");
    let chain_of_errors = format!("{error:?}");
    assert!(
        chain_of_errors.contains("spiffe://retrychain/hop3, not spiffe://retrychain/hop2"),
        "{chain_of_errors}"
    );

    // grpcurl, as users meet it: with the printed flags it charges; with only the CA (no
    // client certificate) hop3 refuses the handshake.
    let operator = tls.files_of("operator");
    let (ca, cert, key) = (
        operator.ca.display().to_string(),
        operator.cert.display().to_string(),
        operator.key.display().to_string(),
    );
    let edge = addrs.edge.host_port().replace("127.0.0.1", "localhost");
    let body = format!(r#"{{"account_id":"{account}","amount_cents":7}}"#);
    let output = Command::new(grpcurl())
        .args(["-cacert", &ca, "-cert", &cert, "-key", &key])
        .args(["-H", "idempotency-key: tls-grpcurl", "-d", &body, &edge])
        .arg("retrychain.v1.Payments/Charge")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(text.contains("\"balanceCents\": \"507\""), "{text}");
    let hop3 = addrs.hop3.host_port().replace("127.0.0.1", "localhost");
    let output = Command::new(grpcurl())
        .args(["-cacert", &ca, "-d", &body, &hop3])
        .arg("retrychain.v1.Payments/Charge")
        .output()
        .unwrap();
    assert!(
        !output.status.success(),
        "hop3 answered a caller without a certificate"
    );
    println!(
        "grpcurl to hop3 without a certificate: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );

    chain.stop().await;
}

/// Under load: every tier's authority rotated (the new CA trusted beside the old, new
/// certificates issued by it, the old CA dropped), then a bad certificate file dropped in.
/// No call fails; new connections use the new material (a restarted hop3 is reached over
/// it, and a client that trusts only the new CA is served).
#[tokio::test]
async fn certificates_and_the_authority_rotate_under_load_without_a_failed_call() {
    let dir = tempfile::tempdir().unwrap();
    let (mut chain, tls) = tls_chain(dir.path(), |_| {}).await;
    let addrs = chain.addrs();
    let edge = tls.connect(&addrs.edge.url, "edge").await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut load = Vec::new();
    for worker in 0..4 {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        // A client as gRPC's own are: a call that never left (caught between a GOAWAY and
        // the new connection) is sent again — gRFC A6's transparent retry, which tonic's bare
        // client lacks (it answers such a call CANCELLED). One attempt otherwise.
        let transparent = tower::ServiceBuilder::new()
            .layer(resilience::RetryLayer::new(resilience::ServiceConfig::default()).unary())
            .service(edge.clone());
        let mut payments = PaymentsClient::new(transparent);
        load.push(tokio::spawn(async move {
            let account = new_account();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let key = format!("rotate-{worker}-{i}");
                match payments
                    .charge(charge(&account, 1, Some(&key), Duration::from_secs(5), &[]))
                    .await
                {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(status) => {
                        println!("failed during rotation: {status:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    let names = ["edge", "hop2", "hop3", "hop4", "ledger", "operator"];
    let settle = || tokio::time::sleep(Duration::from_millis(2500));
    settle().await;

    // 1. The new authority trusted beside the old (everyone's ca.crt holds both).
    let new_ca = Authority::new("retrychain rotated CA").unwrap();
    let old_ca_pem = std::fs::read_to_string(tls.files_of("operator").ca).unwrap();
    for name in names {
        let files = tls.files_of(name);
        let both = format!("{old_ca_pem}{}", new_ca.cert_pem());
        std::fs::write(files.ca.with_extension("crt.new"), both).unwrap();
        std::fs::rename(files.ca.with_extension("crt.new"), &files.ca).unwrap();
    }
    settle().await;
    // 2. Every certificate re-issued by the new authority, still trusting both.
    for name in names {
        let issued = new_ca.issue(&Identity::named(name)).unwrap();
        let files = tls.files_of(name);
        std::fs::write(files.key.with_extension("key.new"), &issued.key_pem).unwrap();
        std::fs::write(files.cert.with_extension("crt.new"), &issued.cert_pem).unwrap();
        std::fs::rename(files.key.with_extension("key.new"), &files.key).unwrap();
        std::fs::rename(files.cert.with_extension("crt.new"), &files.cert).unwrap();
    }
    settle().await;
    // 3. The old authority dropped.
    for name in names {
        tls.issue(&new_ca, name, &[&new_ca]).unwrap();
    }
    settle().await;
    // 4. A bad certificate for the edge: logged and ignored, the edge keeps serving.
    std::fs::write(tls.files_of("edge").cert, "not a certificate").unwrap();
    settle().await;

    stop.store(true, Ordering::Relaxed);
    for worker in load {
        worker.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    println!("{ok} charges succeeded and {failed} failed across the rotation");
    assert!(ok > 100, "{ok}");
    assert_eq!(failed, 0);

    // Every service took every step's material into use (and closed the connections made
    // with the old, so the steps were crossed by new handshakes between tiers).
    for service in &chain.services {
        let log = service.log();
        let renewals = log
            .matches("TLS material changed: new connections use it")
            .count();
        println!("{}: {renewals} renewals", service.name);
        assert!(
            renewals >= 2,
            "{} took new material {renewals} times",
            service.name
        );
    }

    // A new connection that trusts only the new authority is served by the edge (on the
    // material it last read well), and hop3 restarted reads the new material and is
    // reached by hop2 over a new connection.
    let fresh = tls.connect(&addrs.edge.url, "edge").await.unwrap();
    let account = new_account();
    PaymentsClient::new(fresh.clone())
        .charge(charge(
            &account,
            3,
            Some("after-rotation"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap();
    let hop3 = chain
        .services
        .iter_mut()
        .find(|s| s.name == "hop3")
        .unwrap();
    hop3.restart().await.unwrap();
    let mut payments = PaymentsClient::new(fresh);
    for i in 0..20 {
        payments
            .charge(charge(
                &account,
                1,
                Some(&format!("after-restart-{i}")),
                Duration::from_secs(5),
                &[],
            ))
            .await
            .unwrap();
    }
    let logs = chain.services[0].log();
    assert!(
        logs.contains("TLS material changed but cannot be used"),
        "the edge said nothing of the bad file:\n{logs}"
    );
    chain.stop().await;
}

/// `up --tls` as a user meets it: the grpcurl lines it prints are run as printed — the
/// charge over TLS succeeds, the call straight to hop3 is PERMISSION_DENIED — and the
/// certificates are gone once it stops.
#[tokio::test]
async fn up_tls_prints_grpcurl_lines_that_work_as_printed() {
    let base = free_base_port();
    let database_url = database().await;
    let (mut up, lines) = start_up(&["--tls", "--base-port", &base.to_string()], |command| {
        command.env("DATABASE_URL", &database_url);
    });
    let mut printed = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !printed.iter().any(|l: &String| l.starts_with("Ctrl-C")) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        printed.push(lines.recv_timeout(left).expect("up printed its hints"));
    }
    let dir = printed
        .iter()
        .find_map(|l| l.strip_prefix("TLS: ").and_then(|l| l.rsplit_once(" in ")))
        .map(|(_, dir)| dir.to_owned())
        .expect("up says where the certificates are");
    // Runs a printed grpcurl line through the shell, as a user pastes it.
    let run = |line: &str| {
        let output = Command::new("bash")
            .arg("-c")
            .arg(line.trim().replacen("grpcurl", &grpcurl(), 1))
            .output()
            .unwrap();
        (
            output.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        )
    };
    let charge = printed
        .iter()
        .find(|l| l.contains("-cacert") && l.contains("idempotency-key: order-1"))
        .expect("a charge line over TLS");
    let (ok, said) = run(charge);
    assert!(ok && said.contains("\"balanceCents\": \"500\""), "{said}");
    let (ok, said) = run(charge);
    assert!(
        ok && said.contains("\"balanceCents\": \"500\""),
        "replayed: {said}"
    );
    let to_hop3 = printed
        .iter()
        .find(|l| l.contains(&format!("localhost:{}", base + 2)))
        .expect("a line calling hop3 directly");
    let (ok, said) = run(to_hop3);
    assert!(!ok && said.contains("PermissionDenied"), "{said}");
    assert!(
        said.contains("spiffe://retrychain/operator may not call"),
        "{said}"
    );
    let stats = printed
        .iter()
        .find(|l| l.contains("-cacert") && l.contains("Control/GetStats"))
        .expect("a Control line over TLS");
    let (ok, said) = run(stats);
    assert!(ok && said.contains("\"service\": \"ledger\""), "{said}");
    // The callers' lines: alice's token charges her account, bob's may not read it.
    let hers = printed
        .iter()
        .find(|l| l.contains("alice.jwt") && l.contains("Payments/Charge"))
        .expect("a charge line with alice's token");
    let (ok, said) = run(hers);
    assert!(ok && said.contains("\"balanceCents\": \"700\""), "{said}");
    let his = printed
        .iter()
        .find(|l| l.contains("bob.jwt") && l.contains("Payments/GetAccount"))
        .expect("a GetAccount line with bob's token");
    let (ok, said) = run(his);
    assert!(!ok && said.contains("PermissionDenied"), "{said}");

    Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status()
        .unwrap();
    let status = up.0.wait().unwrap();
    assert!(status.success(), "up exited with {status}");
    assert!(!Path::new(&dir).exists(), "{dir} was left behind");
}

/// A chain over TLS on a Postgres of its own (as `up --tls` starts it): the ledger's
/// sessions are TLS 1.3 with the server's certificate and name checked (verify-full), and
/// a client that asks for no TLS is refused by the server.
#[tokio::test]
async fn the_ledger_reaches_its_own_postgres_over_verified_tls() {
    use sqlx::Connection;
    let dir = tempfile::tempdir().unwrap();
    let tls = ChainTls::create(dir.path()).unwrap();
    let options = Options::processes();
    let spec = ChainSpec {
        database_url: None,
        tls: Some(tls.clone()),
        ..options.spec
    };
    let chain = LocalChain::start(spec).await.unwrap();
    let url = chain.own_database().unwrap().url();
    assert!(url.contains("sslmode=verify-full"), "{url}");
    let edge = tls.connect(&chain.addrs().edge.url, "edge").await.unwrap();
    PaymentsClient::new(edge)
        .charge(charge(
            &new_account(),
            5,
            Some("pg-tls"),
            Duration::from_secs(5),
            &[],
        ))
        .await
        .unwrap();

    // The ledger's sessions, as the server sees them.
    let mut probe = sqlx::PgConnection::connect(&url).await.unwrap();
    let (sessions, all_tls, version): (i64, bool, Option<String>) = sqlx::query_as(
        "SELECT count(*), coalesce(bool_and(s.ssl), false), max(s.version)
           FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&mut probe)
    .await
    .unwrap();
    println!("the ledger's sessions: {sessions}, all over TLS: {all_tls}, {version:?}");
    assert!(
        sessions >= 1 && all_tls,
        "{sessions} sessions, all TLS: {all_tls}"
    );
    assert_eq!(version.as_deref(), Some("TLSv1.3"));

    // No TLS: the server lets no TCP client in without it.
    let plain = url.replace("sslmode=verify-full", "sslmode=disable");
    let refused = sqlx::PgConnection::connect(&plain).await.unwrap_err();
    println!("without TLS: {refused}");
    assert!(
        refused.to_string().contains("no pg_hba.conf entry"),
        "{refused}"
    );
    // Another authority: the server's certificate is not trusted.
    let elsewhere = tempfile::tempdir().unwrap();
    let other = ChainTls::create(elsewhere.path()).unwrap();
    let untrusted = url.replace(
        &tls.files_of("postgres").ca.display().to_string(),
        &other.files_of("postgres").ca.display().to_string(),
    );
    assert!(sqlx::PgConnection::connect(&untrusted).await.is_err());
    chain.stop().await;
}

/// Runs `op` on a formation off the runtime (it blocks: processes, polling).
async fn on_formation<T: Send + 'static>(
    formation: &Arc<std::sync::Mutex<tempgres::HaFormation>>,
    op: impl FnOnce(&tempgres::HaFormation) -> T + Send + 'static,
) -> T {
    let formation = Arc::clone(formation);
    tokio::task::spawn_blocking(move || op(&formation.lock().unwrap()))
        .await
        .unwrap()
}

/// The TCP client sessions of the server at `url` and of its standbys' replication: how
/// many, and whether all are TLS 1.3.
async fn tls_sessions(url: &str) -> ((i64, bool), (i64, bool)) {
    use sqlx::Connection;
    let mut probe = sqlx::PgConnection::connect(url).await.unwrap();
    let clients: (i64, bool) = sqlx::query_as(
        "SELECT count(*), coalesce(bool_and(s.ssl AND s.version = 'TLSv1.3'), false)
           FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE a.backend_type = 'client backend' AND a.client_addr IS NOT NULL
            AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&mut probe)
    .await
    .unwrap();
    let replication: (i64, bool) = sqlx::query_as(
        "SELECT count(*), coalesce(bool_and(s.ssl AND s.version = 'TLSv1.3'), false)
           FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)",
    )
    .fetch_one(&mut probe)
    .await
    .unwrap();
    (clients, replication)
}

/// A pg_auto_failover formation over TLS (what `up --postgres ha --tls` starts): every
/// server serves the chain's Postgres certificate; the ledger's multi-host URL asks for
/// `verify-full`; on the primary every TCP session (the ledger's, the keepers') and the
/// standby's replication are TLS 1.3, and neither node lets a client in without TLS;
/// after a switchover the same holds on the new primary, charges go on, and a repeated key
/// replays the charge made before it.
#[tokio::test]
async fn a_formation_over_tls_is_reached_verified_through_a_switchover() {
    let dir = tempfile::tempdir().unwrap();
    let tls = ChainTls::create(dir.path()).unwrap();
    let own = tls.files_of("postgres");
    let server = tempgres::ServerTls {
        cert: own.cert,
        key: own.key,
        ca: own.ca,
    };
    let formation =
        tokio::task::spawn_blocking(move || tempgres::HaFormation::start_with(Some(&server)))
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("a pg_auto_failover formation over TLS: {e}"));
    let formation = Arc::new(std::sync::Mutex::new(formation));
    let url = on_formation(&formation, |f| f.uri()).await;
    assert!(url.contains("sslmode=verify-full"), "{url}");
    let spec = ChainSpec {
        database_url: Some(url),
        tls: Some(tls.clone()),
        ..Options::processes().spec
    };
    let chain = LocalChain::start(spec).await.unwrap();
    let edge = PaymentsClient::new(tls.connect(&chain.addrs().edge.url, "edge").await.unwrap());
    let account = new_account();
    let first = edge
        .clone()
        .charge(charge(
            &account,
            5,
            Some("ha-tls-1"),
            Duration::from_secs(10),
            &[],
        ))
        .await
        .unwrap();

    for round in ["before", "after"] {
        let primary = on_formation(&formation, |f| {
            let i = f.primary().unwrap().expect("a primary");
            (i, f.node_url(i))
        })
        .await;
        let ((sessions, all_tls), (standbys, replication_tls)) = tls_sessions(&primary.1).await;
        println!(
            "{round} the switchover, node{} primary: {sessions} TCP sessions, all TLS 1.3: {all_tls}; {standbys} standby, over TLS 1.3: {replication_tls}",
            primary.0 + 1
        );
        assert!(
            sessions >= 1 && all_tls,
            "{round}: {sessions} sessions, all TLS: {all_tls}"
        );
        assert!(
            standbys >= 1 && replication_tls,
            "{round}: {standbys} standbys, over TLS: {replication_tls}"
        );
        // And no session without TLS, on either node.
        let nodes = on_formation(&formation, |f| [f.node_url(0), f.node_url(1)]).await;
        for node in nodes {
            use sqlx::Connection;
            let plain = node.replace("sslmode=verify-full", "sslmode=disable");
            let refused = sqlx::PgConnection::connect(&plain).await.unwrap_err();
            assert!(
                refused.to_string().contains("no pg_hba.conf entry"),
                "{round}, {plain}: {refused}"
            );
        }
        if round == "after" {
            break;
        }
        on_formation(&formation, |f| f.switchover().unwrap()).await;
        on_formation(&formation, move |f| {
            f.wait_until(Duration::from_secs(90), |nodes| {
                nodes
                    .iter()
                    .any(|n| n.name != format!("node{}", primary.0 + 1) && n.reported == "primary")
                    && nodes.iter().any(|n| n.reported == "secondary")
            })
            .unwrap()
        })
        .await;
        // Charges go on on the new primary (the ledger reconnects; the edge retries).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let again = edge
                .clone()
                .charge(charge(
                    &account,
                    7,
                    Some("ha-tls-2"),
                    Duration::from_secs(10),
                    &[],
                ))
                .await;
            match again {
                Ok(_) => break,
                Err(status) if std::time::Instant::now() < deadline => {
                    println!("after the switchover: {status:?}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(status) => panic!("no charge within 30 s of the switchover: {status:?}"),
            }
        }
    }
    let replayed = edge
        .clone()
        .charge(charge(
            &account,
            5,
            Some("ha-tls-1"),
            Duration::from_secs(10),
            &[],
        ))
        .await
        .unwrap();
    assert_eq!(
        header(&replayed, IDEMPOTENT_REPLAYED).as_deref(),
        Some("true")
    );
    assert_eq!(replayed.get_ref().charge_id, first.get_ref().charge_id);
    chain.stop().await;
    drop(formation);
}

/// A Charge request as `caller`'s bearer token (`None`: no credentials) carries it.
fn charge_as(
    token: Option<&str>,
    account: &str,
    amount: i64,
    key: &str,
    extra: &[(&'static str, &str)],
) -> tonic::Request<retrychain_proto::v1::ChargeRequest> {
    let bearer = token.map(|token| format!("Bearer {token}"));
    let mut metadata: Vec<(&'static str, &str)> = extra.to_vec();
    if let Some(bearer) = &bearer {
        metadata.push(("authorization", bearer));
    }
    charge(
        account,
        amount,
        Some(key),
        Duration::from_secs(5),
        &metadata,
    )
}

/// Callers at the edge of a TLS chain: without credentials or with a bad token
/// UNAUTHENTICATED before any work; a token's subject or a certificate's identity is the
/// caller; an account is its creator's — another caller's Charge under the same key is
/// PERMISSION_DENIED (never the first caller's reply replayed), its GetAccount too — while
/// the same key on the second caller's own account is a second key; a caller cannot name
/// itself with `x-caller`; one caller over its in-flight limit is refused at once while
/// another is served; and the JWKS rotates without a restart.
#[tokio::test]
async fn callers_are_authenticated_own_their_accounts_and_are_limited_apart() {
    let dir = tempfile::tempdir().unwrap();
    let (chain, tls) = tls_chain(dir.path(), |spec| spec.edge().caller_max_in_flight = 2).await;
    let addrs = chain.addrs();
    let client = retrychain_harness::ChainClient::connect_tls(&addrs, &tls)
        .await
        .unwrap();
    let anonymous = PaymentsClient::new(
        tls.connect_without_certificate(&addrs.edge.url)
            .await
            .unwrap(),
    );
    let alice = tls.token("alice", Duration::from_secs(600)).unwrap();
    let bob = tls.token("bob", Duration::from_secs(600)).unwrap();
    let (mine, theirs) = (new_account(), new_account());
    let hop2_handled = || async {
        let stats = client.control(1).get_stats(GetStatsRequest {}).await;
        stats.unwrap().into_inner().requests_received
    };
    let before = hop2_handled().await;

    // No credentials at all; a token that is not one; a token from a key the JWKS does not
    // hold: UNAUTHENTICATED, and nothing reaches hop2.
    let stranger = retrychain_tls::issue::TokenIssuer::new("not-ours")
        .unwrap()
        .token("mallory", None, None, Duration::from_secs(600));
    for (token, says) in [
        (None, "credentials are required"),
        (Some("not.a.jwt"), "not a JWT"),
        (Some(stranger.as_str()), "no key \"not-ours\""),
    ] {
        let refused = anonymous
            .clone()
            .charge(charge_as(token, &mine, 100, "k-1", &[]))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        assert!(refused.message().contains(says), "{refused:?}");
    }
    assert_eq!(hop2_handled().await, before, "no work done");

    // Alice's charge makes the account hers.
    let first = anonymous
        .clone()
        .charge(charge_as(Some(&alice), &mine, 100, "k-1", &[]))
        .await
        .unwrap();
    assert_eq!(first.get_ref().balance_cents, 100);

    // Bob under the same key, on her account: refused, not replayed; nor may he read it,
    // nor claim to be her.
    for extra in [&[][..], &[("x-caller", "jwt:alice")][..]] {
        let denied = anonymous
            .clone()
            .charge(charge_as(Some(&bob), &mine, 100, "k-1", extra))
            .await
            .unwrap_err();
        assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
        assert!(
            denied.metadata().get("idempotent-replayed").is_none(),
            "{denied:?}"
        );
    }
    let mut read = tonic::Request::new(GetAccountRequest {
        account_id: mine.clone(),
    });
    read.metadata_mut()
        .insert("authorization", format!("Bearer {bob}").parse().unwrap());
    let denied = anonymous.clone().get_account(read).await.unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    // The operator (its certificate) is a caller of its own too.
    let as_operator = client
        .payments(0)
        .get_account(GetAccountRequest {
            account_id: mine.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        as_operator.code(),
        Code::PermissionDenied,
        "{as_operator:?}"
    );

    // The same key on Bob's own account is his key: a charge, not a replay.
    let his = anonymous
        .clone()
        .charge(charge_as(Some(&bob), &theirs, 100, "k-1", &[]))
        .await
        .unwrap();
    assert!(his.metadata().get("idempotent-replayed").is_none());
    assert_eq!(his.get_ref().balance_cents, 100);
    // Alice's balance is hers alone: one charge.
    let mut read = tonic::Request::new(GetAccountRequest {
        account_id: mine.clone(),
    });
    read.metadata_mut()
        .insert("authorization", format!("Bearer {alice}").parse().unwrap());
    let account = anonymous.clone().get_account(read).await.unwrap();
    assert_eq!(
        (account.get_ref().balance_cents, account.get_ref().charges),
        (100, 1)
    );

    // Per-caller limits: each charge held 600 ms at the ledger; Alice sends six at once
    // (her limit is 2), Bob one beside them.
    client
        .set_faults(
            4,
            retrychain_proto::v1::Faults {
                delay_ms: 600,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let hers = (0..6).map(|i| {
        let (anonymous, alice, mine) = (anonymous.clone(), alice.clone(), mine.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(20 * i)).await;
            let started = std::time::Instant::now();
            let answer = anonymous
                .clone()
                .charge(charge_as(
                    Some(&alice),
                    &mine,
                    1,
                    &format!("burst-{i}"),
                    &[],
                ))
                .await;
            (answer.map(|_| ()).map_err(|s| s.code()), started.elapsed())
        }
    });
    let mut his_client = anonymous.clone();
    let bobs = his_client.charge(charge_as(Some(&bob), &theirs, 1, "burst-b", &[]));
    let (hers, bobs) = tokio::join!(futures::future::join_all(hers), bobs);
    client.clear_faults(4).await.unwrap();
    assert!(bobs.is_ok(), "Bob was not served: {bobs:?}");
    let refused: Vec<_> = hers
        .iter()
        .filter(|(answer, _)| *answer == Err(Code::ResourceExhausted))
        .collect();
    let served = hers.iter().filter(|(answer, _)| answer.is_ok()).count();
    println!("alice's burst: {hers:?}");
    assert!(served >= 2, "{hers:?}");
    assert!(refused.len() >= 3, "{hers:?}");
    assert!(
        refused
            .iter()
            .all(|(_, took)| *took < Duration::from_millis(300)),
        "refused at once: {hers:?}"
    );

    // The JWKS rotates: a new key published beside the old, then alone. Old tokens work
    // until their key is gone; new ones as soon as theirs is published.
    let old = tls.token_issuer().unwrap();
    let new = retrychain_tls::issue::TokenIssuer::new("callers-2").unwrap();
    retrychain_tls::issue::write_jwks(&tls.jwks(), &[&old, &new]).unwrap();
    let fresh = new.token("alice", None, None, Duration::from_secs(600));
    let answers = |token: String| {
        let (anonymous, mine) = (anonymous.clone(), mine.clone());
        async move {
            let mut read = tonic::Request::new(GetAccountRequest { account_id: mine });
            read.metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            anonymous.clone().get_account(read).await.map(|_| ())
        }
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while answers(fresh.clone()).await.is_err() {
        assert!(
            std::time::Instant::now() < until,
            "the new key was never taken"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    answers(alice.clone())
        .await
        .expect("the old key still holds");
    // A broken JWKS is ignored: both keys keep working.
    std::fs::write(tls.jwks(), b"{\"keys\": [").unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    answers(fresh.clone()).await.expect("the keys in use stay");
    answers(alice.clone()).await.expect("the keys in use stay");
    retrychain_tls::issue::write_jwks(&tls.jwks(), &[&new]).unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match answers(alice.clone()).await {
            Err(status) if status.code() == Code::Unauthenticated => break,
            _ => assert!(std::time::Instant::now() < until, "the old key stayed"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    answers(fresh).await.expect("the new key holds");
}

/// The operator's tools against a chain over TLS: `storm` charges through the edge and reads
/// the edge's and the ledger's counters as the operator; `top --once` scrapes every admin
/// port over TLS, each service checked as its tier. Without the material, both refuse
/// the https:// addresses with a message saying what is missing.
#[tokio::test]
async fn storm_and_top_reach_a_chain_over_tls_as_the_operator() {
    let dir = tempfile::tempdir().unwrap();
    let (chain, tls) = tls_chain(dir.path(), |_| {}).await;
    let addrs = chain.addrs();
    let operator = tls.dir.join("operator");
    let storm = Command::new(BIN)
        .args(["storm", "--json", "--duration", "2s", "--concurrency", "4"])
        .args([
            "--edge",
            &addrs.edge.url,
            "--edge-admin",
            &addrs.edge.admin_url,
        ])
        .args([
            "--ledger",
            &addrs.ledger.url,
            "--ledger-admin",
            &addrs.ledger.admin_url,
        ])
        .arg("--tls-dir")
        .arg(&operator)
        .output()
        .unwrap();
    assert!(
        storm.status.success(),
        "{}",
        String::from_utf8_lossy(&storm.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&storm.stdout).unwrap();
    println!("storm over TLS: {report}");
    assert!(report["ok"].as_u64().unwrap() > 10, "{report}");
    assert_eq!(report["ok"], report["requests"], "{report}");
    assert_eq!(report["ledgers_read"], 1, "{report}");
    assert!(report["bottom_calls"].as_u64().unwrap() >= report["ok"].as_u64().unwrap());

    let admins: Vec<String> = addrs.all().iter().map(|a| a.admin_url.clone()).collect();
    let top = Command::new(BIN)
        .args([
            "top",
            "--once",
            "--interval-ms",
            "300",
            "--admin",
            &admins.join(","),
        ])
        .arg("--tls-dir")
        .arg(&operator)
        .output()
        .unwrap();
    let frame = String::from_utf8_lossy(&top.stdout);
    assert!(
        top.status.success(),
        "{frame}{}",
        String::from_utf8_lossy(&top.stderr)
    );
    for name in retrychain_harness::NAMES {
        assert!(
            frame
                .lines()
                .any(|l| l.starts_with(name) && l.split_whitespace().nth(1) == Some("up")),
            "{name} not up in:\n{frame}"
        );
    }

    let without = Command::new(BIN)
        .args(["top", "--once", "--admin", &admins.join(",")])
        .output()
        .unwrap();
    assert!(!without.status.success());
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("--tls-dir"),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
}

/// A stolen tier key: hop2's certificate and key, used to call hop3 directly as if it were
/// hop2 relaying for Alice. Below the edge the ledger takes the caller only from the edge's
/// signed statement of that very call: without one, with one hop2's key made, or with the
/// edge's statement of another call of Alice's, nothing is charged and nothing is read
/// (UNAUTHENTICATED or PERMISSION_DENIED); the edge's own calls for her are served.
#[tokio::test]
async fn a_stolen_tier_key_cannot_charge_or_read_as_another_caller() {
    use retrychain_domain::Caller;
    use retrychain_node::statement::{self, CALLER_SIGNER, CALLER_STATEMENT, Call};
    use std::time::SystemTime;

    let dir = tempfile::tempdir().unwrap();
    let (chain, tls) = tls_chain(dir.path(), |_| {}).await;
    let addrs = chain.addrs();
    let client = retrychain_harness::ChainClient::connect_tls(&addrs, &tls)
        .await
        .unwrap();
    let edge = PaymentsClient::new(
        tls.connect_without_certificate(&addrs.edge.url)
            .await
            .unwrap(),
    );
    let alice = tls.token("alice", Duration::from_secs(600)).unwrap();
    let as_alice =
        |account: &str, amount: i64, key: &str| charge_as(Some(&alice), account, amount, key, &[]);
    let read_as_alice = |account: &str| {
        let mut read = tonic::Request::new(GetAccountRequest {
            account_id: account.to_owned(),
        });
        read.metadata_mut()
            .insert("authorization", format!("Bearer {alice}").parse().unwrap());
        read
    };

    // Alice's account, made through the edge.
    let hers = new_account();
    let first = edge
        .clone()
        .charge(as_alice(&hers, 100, "alice-1"))
        .await
        .unwrap();
    assert_eq!(first.get_ref().balance_cents, 100);
    let executions = || async {
        let stats = client.control(4).get_stats(GetStatsRequest {}).await;
        stats.unwrap().into_inner().executions
    };
    let executed = executions().await;

    // The thief: hop2's certificate, calling hop3 — which accepts hop2, as it must.
    let stolen = channel_as(tls.files_of("hop2"), &addrs.hop3.url, "hop3")
        .await
        .unwrap();
    let thief = PaymentsClient::new(stolen);
    let alice_id = Caller::parse("jwt:alice").unwrap();
    let now = SystemTime::now();
    let later = now + Duration::from_secs(30);
    // What the edge signed for Alice's first charge (the statement a relay saw pass), and
    // for a read of her account; and what hop2's own key makes.
    let edge_key = Tls::load(tls.files_of("edge"), ClientAuth::Optional).unwrap();
    let hop2_key = Tls::load(tls.files_of("hop2"), ClientAuth::Optional).unwrap();
    let her_charge = Call {
        method: "Charge",
        key: Some("alice-1"),
        account: &hers,
        amount: Some(100),
    };
    let statement_of = |signer: &Tls, call: &Call<'_>| {
        let mut metadata = tonic::metadata::MetadataMap::new();
        statement::sign(signer, &alice_id, call, later, &mut metadata).unwrap();
        (
            metadata.get_bin(CALLER_STATEMENT).unwrap().clone(),
            metadata.get_bin(CALLER_SIGNER).unwrap().clone(),
        )
    };
    let copied = statement_of(&edge_key, &her_charge);
    let forged = statement_of(
        &hop2_key,
        &Call {
            key: Some("stolen-2"),
            amount: Some(5_000),
            ..her_charge
        },
    );
    type Statement = (
        tonic::metadata::BinaryMetadataValue,
        tonic::metadata::BinaryMetadataValue,
    );
    /// `request` as a relay would send it for Alice, with `statement` beside it.
    fn with<T>(mut request: tonic::Request<T>, statement: Option<&Statement>) -> tonic::Request<T> {
        let metadata = request.metadata_mut();
        metadata.insert("x-caller", "jwt:alice".parse().unwrap());
        if let Some((signed, signer)) = statement {
            metadata.insert_bin(CALLER_STATEMENT, signed.clone());
            metadata.insert_bin(CALLER_SIGNER, signer.clone());
        }
        request
    }
    let theft = |key: &str| charge(&hers, 5_000, Some(key), Duration::from_secs(5), &[]);
    let cases = [
        ("no statement", None, Code::Unauthenticated),
        ("hop2's own statement", Some(&forged), Code::Unauthenticated),
        (
            "the edge's, of another call",
            Some(&copied),
            Code::PermissionDenied,
        ),
    ];
    for (i, (what, statement, code)) in cases.iter().enumerate() {
        let refused = thief
            .clone()
            .charge(with(theft(&format!("stolen-{}", i + 1)), *statement))
            .await
            .unwrap_err();
        println!("a charge as alice with {what}: {refused:?}");
        assert_eq!(refused.code(), *code, "{what}: {refused:?}");
        let read = with(
            tonic::Request::new(GetAccountRequest {
                account_id: hers.clone(),
            }),
            *statement,
        );
        let refused = thief.clone().get_account(read).await.unwrap_err();
        println!("a read of alice's account with {what}: {refused:?}");
        assert_eq!(refused.code(), *code, "{what}: {refused:?}");
    }
    // The edge's statement of her first charge, replayed for that very charge, asks only
    // what she asked: its saved reply, and no second charge.
    let replayed = thief
        .clone()
        .charge(with(
            charge(&hers, 100, Some("alice-1"), Duration::from_secs(5), &[]),
            Some(&copied),
        ))
        .await
        .unwrap();
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(replayed.get_ref().charge_id, first.get_ref().charge_id);
    assert_eq!(executions().await, executed, "nothing charged");

    // The edge's own calls for her: served, her balance only what she charged.
    edge.clone()
        .charge(as_alice(&hers, 20, "alice-2"))
        .await
        .unwrap();
    let account = edge
        .clone()
        .get_account(read_as_alice(&hers))
        .await
        .unwrap();
    assert_eq!(
        (account.get_ref().balance_cents, account.get_ref().charges),
        (120, 2)
    );
    chain.stop().await;
}
