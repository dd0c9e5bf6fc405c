//! Replicas behind a hop: `--downstream` with several URLs, balanced per attempt (power of
//! two choices over a peak-EWMA load), a retry sent to a replica the call has not tried,
//! a killed replica ridden through and taken back once restarted, and the replica set
//! changed under load without losing a call or sending one to a removed replica.

use std::time::{Duration, Instant};

use crate::{load::*, support::*};
use futures::StreamExt;
use resilience::{Balancer, Downstream};
use retrychain_proto::v1::{GetAccountRequest, payments_client::PaymentsClient};
use tonic::Code;

/// A hop's command with the tests' defaults (fault injection, the override, quick
/// backoff), on 127.0.0.1 port 0, named `name`, forwarding to `downstream`.
fn hop_command(role: &str, name: &str, downstream: &str) -> ServiceCommand {
    let mut command = ServiceCommand::defaults(role, "").unwrap();
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut command else {
        unreachable!("a hop's defaults are a hop's")
    };
    args.service.listen = Some("127.0.0.1:0".parse().unwrap());
    args.service.name = Some(name.to_owned());
    args.service.fault_injection = true;
    args.service.allow_retry_mode_override = true;
    args.service.backoff_base_ms = 2;
    args.service.backoff_cap_ms = 20;
    args.downstream = Some(downstream.to_owned());
    command
}

/// hop4 and the ledger in this runtime, on a fresh database: what the replicas above
/// forward to. Returns them and hop4's URL.
async fn bottom() -> (Vec<InProcessService>, String, String) {
    let (ledger, url) = start_ledger(|_| {}).await;
    let hop4 = InProcessService::start("hop4", hop_command("relay", "hop4", &ledger.addr.url))
        .await
        .unwrap();
    let hop4_url = hop4.addr.url.clone();
    (vec![hop4, ledger], hop4_url, url)
}

/// Replicas of tier `tier` in this runtime, one per name, each forwarding to `downstream`.
async fn relays(tier: &str, names: &[&str], downstream: &str) -> Vec<InProcessService> {
    let mut replicas = Vec::new();
    for name in names {
        replicas.push(
            InProcessService::start(tier, hop_command("relay", name, downstream))
                .await
                .unwrap(),
        );
    }
    replicas
}

/// Three hop3 replicas as processes (to be killed, stopped or restarted), forwarding to
/// `hop4`, named `hop3-0` to `hop3-2`.
async fn hop3_processes(hop4: &str) -> Vec<ChildService> {
    let mut hop3 = Vec::new();
    for i in 0..3 {
        let launch = Launch {
            program: Some(BIN.into()),
            args: hop_command("relay", &format!("hop3-{i}"), hop4).to_args(),
            env: Vec::new(),
            logs: Logs::Capture,
        };
        hop3.push(ChildService::start("hop3", launch).await.unwrap());
    }
    hop3
}

async fn received(admin: &str) -> u64 {
    let channel = connect(admin).await;
    retrychain_proto::v1::control_client::ControlClient::new(channel)
        .get_stats(retrychain_proto::v1::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .requests_received
}

#[tokio::test]
async fn a_retry_goes_to_a_replica_the_call_has_not_tried() {
    let (_bottom, hop4, _db) = bottom().await;
    let hop3 = InProcessService::start("hop3", hop_command("relay", "hop3", &hop4))
        .await
        .unwrap();
    // Two hop2 replicas; the first fails every call it forwards (UNAVAILABLE).
    let hop2 = relays("hop2", &["hop2-a", "hop2-b"], &hop3.addr.url).await;
    let control = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&hop2[0].addr.admin_url).await,
    );
    control.clone().set_faults(failing()).await.unwrap();
    // The edge over both, two attempts, no budget: every call whose first attempt meets
    // the failing replica has exactly one retry, and it must not meet it again.
    let list = format!("{},{}", hop2[0].addr.url, hop2[1].addr.url);
    let mut edge_command = hop_command("edge", "edge", &list);
    edge_command.service_mut().max_attempts = 2;
    edge_command.service_mut().no_budget = true;
    let edge = InProcessService::start("edge", edge_command).await.unwrap();

    let client = PaymentsClient::new(connect(&edge.addr.url).await);
    let account = new_account();
    let mut failed = Vec::new();
    for _ in 0..200 {
        if let Err(status) = charge_on(
            &client,
            &account,
            100,
            Some(&new_key()),
            Duration::from_secs(5),
        )
        .await
        {
            failed.push(status);
        }
    }
    let on_failing = received(&hop2[0].addr.admin_url).await;
    let on_healthy = received(&hop2[1].addr.admin_url).await;
    let retries = {
        let channel = connect(&edge.addr.admin_url).await;
        retrychain_proto::v1::control_client::ControlClient::new(channel)
            .get_stats(retrychain_proto::v1::GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .retries
    };
    println!(
        "200 charges: {} failed; the failing replica got {on_failing}, the healthy one {on_healthy}, the edge retried {retries}",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "every retry went to the healthy replica: {failed:?}"
    );
    assert!(
        on_failing > 10,
        "the failing replica was drawn for first attempts"
    );
    assert_eq!(
        on_healthy, 200,
        "each charge reached the healthy replica once"
    );
    assert_eq!(
        retries, on_failing,
        "one retry per meeting with the failing replica"
    );
}

#[tokio::test]
async fn a_killed_replica_is_ridden_through_and_takes_traffic_again_once_restarted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_bottom, hop4, database_url) = bottom().await;
    // Three hop3 replicas as processes, to be killed and restarted.
    let mut hop3 = hop3_processes(&hop4).await;
    let list: Vec<String> = hop3.iter().map(|s| s.addr.url.clone()).collect();
    // Its refused connections eject the killed replica; for 1 s here (30 s by default).
    let mut hop2_command = hop_command("relay", "hop2", &list.join(","));
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut hop2_command else {
        unreachable!()
    };
    args.ejection_base_ms = 1000;
    let hop2 = InProcessService::start("hop2", hop2_command).await.unwrap();
    let edge = InProcessService::start("edge", hop_command("edge", "edge", &hop2.addr.url))
        .await
        .unwrap();

    let load = Load::start(&edge.addr.url, 4);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    hop3[0].crash().await;
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    hop3[0].restart().await.unwrap();
    let restarted = Instant::now();
    // Re-admitted when its ejection (1 s, or 2 s if ejected twice) is over.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let sent = load.finish().await;

    let ok = sent.iter().filter(|s| s.code == Code::Ok).count();
    let while_down = sent
        .iter()
        .filter(|s| s.started > killed && s.started < restarted)
        .count();
    let after_restart = received(&hop3[0].addr.admin_url).await;
    assert!(
        while_down > 0,
        "charges were sent while the replica was down"
    );
    println!(
        "one of three hop3 replicas killed for 1.5 s: {ok} of {} charges succeeded ({:?}), {while_down} sent while it was down; after its restart it received {after_restart}",
        sent.len(),
        codes(&sent)
    );
    assert!(
        ok * 1000 >= sent.len() * 999,
        "at least 99.9% succeed: {:?}",
        codes(&sent)
    );
    assert!(
        after_restart > 0,
        "the restarted replica takes traffic again"
    );
    resend_and_check(&edge.addr.url, &database_url, &sent).await;
}

#[tokio::test]
async fn the_replica_set_changed_every_100_ms_under_load_loses_no_call() {
    let (_bottom, hop4, _db) = bottom().await;
    let hop3 = relays("hop3", &["hop3-0", "hop3-1", "hop3-2"], &hop4).await;
    let urls: Vec<String> = hop3.iter().map(|s| s.addr.url.clone()).collect();
    let balancer = Balancer::start(Downstream::Urls(urls.clone()), Default::default()).await;
    let client = PaymentsClient::new(balancer.clone());
    let account = new_account();
    // A first charge (straight to one replica), so that the reads find the account.
    let direct = PaymentsClient::new(connect(&urls[0]).await);
    charge_on(
        &direct,
        &account,
        100,
        Some(&new_key()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let mut client = client.clone();
            let account = account.clone();
            let stop = std::sync::Arc::clone(&stop);
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut request = tonic::Request::new(GetAccountRequest {
                        account_id: account.clone(),
                    });
                    request.set_timeout(Duration::from_secs(2));
                    match client.get_account(request).await {
                        Ok(_) => ok += 1,
                        Err(status) => failed.push(status),
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    // Every 100 ms for 10 s: a random non-empty subset of the three.
    let mut changes = 0;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let mask = 1 + uuid::Uuid::new_v4().as_bytes()[0] % 7;
        let subset: Vec<String> = (0..3)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| urls[i].clone())
            .collect();
        balancer.set_replicas(&subset);
        changes += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Then the first alone: once the calls in flight are done, the two removed replicas
    // receive nothing more while the load goes on.
    balancer.set_replicas(&urls[..1]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let removed_before = [
        received(&hop3[1].addr.admin_url).await,
        received(&hop3[2].addr.admin_url).await,
    ];
    let kept_before = received(&hop3[0].addr.admin_url).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let removed_after = [
        received(&hop3[1].addr.admin_url).await,
        received(&hop3[2].addr.admin_url).await,
    ];
    let kept_after = received(&hop3[0].addr.admin_url).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        removed_before, removed_after,
        "no call to a removed replica"
    );
    assert!(
        kept_after > kept_before,
        "the remaining replica took the load"
    );
    let results: Vec<(u32, Vec<tonic::Status>)> = futures::stream::iter(workers)
        .then(|w| async move { w.await.unwrap() })
        .collect()
        .await;
    let ok: u32 = results.iter().map(|(ok, _)| ok).sum();
    let failed: Vec<&tonic::Status> = results.iter().flat_map(|(_, f)| f).collect();
    println!(
        "{changes} changes of the replica set in 10 s: {ok} calls succeeded, {} failed",
        failed.len()
    );
    assert!(ok > 100, "calls went through meanwhile");
    assert!(failed.is_empty(), "no call lost to a change: {failed:?}");
}

#[tokio::test]
async fn up_with_replicas_balances_every_tier() {
    let _one = ONE_AT_A_TIME.lock().await;
    // Two replicas: every service's ports and the next ten up, admin ports 1000 above,
    // in a range the other tests' chains do not use.
    let base = (30000..42000u16)
        .step_by(20)
        .find(|base| {
            let ports = (*base..base + 15).chain(base + 1000..base + 1015);
            let held: Vec<_> = ports
                .map_while(|port| std::net::TcpListener::bind(("127.0.0.1", port)).ok())
                .collect();
            held.len() == 30
        })
        .expect("free ports");
    let (mut up, lines) = start_up(
        &["--replicas", "2", "--base-port", &base.to_string()],
        |_| {},
    );
    let layout = off_runtime(move || {
        loop {
            let line = lines.recv_timeout(Duration::from_secs(120))?;
            if line.starts_with("retrychain is up") {
                return Ok::<_, std::sync::mpsc::RecvTimeoutError>(line);
            }
        }
    })
    .await
    .expect("up says it is up");
    let port = |i: u16, r: u16| base + i + 10 * r;
    assert_eq!(
        layout,
        format!(
            "retrychain is up: edge :{} -> hop2 :{} :{} -> hop3 :{} :{} -> hop4 :{} :{} -> ledger :{} :{}",
            port(0, 0),
            port(1, 0),
            port(1, 1),
            port(2, 0),
            port(2, 1),
            port(3, 0),
            port(3, 1),
            port(4, 0),
            port(4, 1)
        )
    );
    // 80 charges, 8 at a time: with calls in flight, the load estimate spreads them.
    let edge = PaymentsClient::new(connect(&format!("http://127.0.0.1:{base}")).await);
    let account = new_account();
    let results: Vec<_> = futures::stream::iter(0..80)
        .map(|_| {
            let edge = edge.clone();
            let account = account.clone();
            async move {
                charge_on(
                    &edge,
                    &account,
                    100,
                    Some(&new_key()),
                    Duration::from_secs(5),
                )
                .await
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for i in 1..5u16 {
        let mut tier = Vec::new();
        for r in 0..2 {
            tier.push(received(&format!("http://127.0.0.1:{}", port(i, r) + 1000)).await);
        }
        println!("{}: {tier:?}", NAMES[usize::from(i)]);
        assert_eq!(tier.iter().sum::<u64>(), 80, "each charge once per tier");
        assert!(
            tier.iter().all(|n| *n > 0),
            "both replicas of {} served",
            NAMES[usize::from(i)]
        );
    }
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &up.0.id().to_string()])
        .status();
    assert!(up.0.wait().unwrap().success());
}

#[tokio::test]
async fn fifty_concurrent_charges_under_one_key_over_three_ledgers_execute_once() {
    let database_url = database().await;
    let mut ledgers = Vec::new();
    for _ in 0..3 {
        let mut command = ServiceCommand::defaults("ledger", &database_url).unwrap();
        let service = command.service_mut();
        service.listen = Some("127.0.0.1:0".parse().unwrap());
        service.fault_injection = true;
        ledgers.push(InProcessService::start("ledger", command).await.unwrap());
    }
    let list: Vec<String> = ledgers.iter().map(|l| l.addr.url.clone()).collect();
    let hop4 = InProcessService::start("hop4", hop_command("relay", "hop4", &list.join(",")))
        .await
        .unwrap();
    // A processor slow enough that the 50 overlap.
    for ledger in &ledgers {
        let control = retrychain_proto::v1::control_client::ControlClient::new(
            connect(&ledger.addr.admin_url).await,
        );
        control.clone().set_faults(delayed(200)).await.unwrap();
    }
    let client = PaymentsClient::new(connect(&hop4.addr.url).await);
    let (account, key) = (new_account(), new_key());
    let answers: Vec<Result<_, tonic::Status>> =
        futures::stream::iter(0..50)
            .map(|_| {
                let client = client.clone();
                let (account, key) = (account.clone(), key.clone());
                async move {
                    charge_on(&client, &account, 700, Some(&key), Duration::from_secs(10)).await
                }
            })
            .buffer_unordered(50)
            .collect()
            .await;
    let mut stats = Vec::new();
    for ledger in &ledgers {
        let channel = connect(&ledger.addr.admin_url).await;
        stats.push(
            retrychain_proto::v1::control_client::ControlClient::new(channel)
                .get_stats(retrychain_proto::v1::GetStatsRequest {})
                .await
                .unwrap()
                .into_inner(),
        );
    }
    let received: Vec<u64> = stats.iter().map(|s| s.requests_received).collect();
    let executions: u64 = stats.iter().map(|s| s.executions).sum();
    let replays: u64 = stats.iter().map(|s| s.replays).sum();
    println!(
        "50 charges under one key: received {received:?}, {executions} executed, {replays} replayed"
    );
    for answer in &answers {
        let reply = answer.as_ref().expect("every one answered");
        assert_eq!(reply.get_ref().balance_cents, 700, "the one charge's reply");
    }
    assert!(
        received.iter().filter(|n| **n > 0).count() >= 2,
        "spread over the ledgers"
    );
    assert_eq!(executions, 1);
    assert_eq!(replays, 49);
    assert_eq!(row_counts(&database_url).await.1, 1, "one charge row");
}

/// The defaults ride out one frozen replica: hop2 over three hop3 processes with nothing
/// set (a list of replicas gets a 1 s per-attempt timeout by default), one hop3 frozen
/// (SIGSTOP) for 8 s under load. Before the default, calls that met it waited their whole
/// 5 s deadline and failed DEADLINE_EXCEEDED; now none fails, and none takes much more
/// than one per-attempt timeout.
#[tokio::test]
async fn the_defaults_ride_out_a_replica_frozen_for_8_s() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_bottom, hop4, database_url) = bottom().await;
    let hop3 = hop3_processes(&hop4).await;
    let list: Vec<String> = hop3.iter().map(|s| s.addr.url.clone()).collect();
    let hop2 = InProcessService::start("hop2", hop_command("relay", "hop2", &list.join(",")))
        .await
        .unwrap();
    let edge = InProcessService::start("edge", hop_command("edge", "edge", &hop2.addr.url))
        .await
        .unwrap();
    let load = Load::start(&edge.addr.url, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    hop3[0].signal("STOP").await.unwrap();
    tokio::time::sleep(Duration::from_secs(8)).await;
    hop3[0].signal("CONT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = load.finish().await;
    let failed: Vec<&Sent> = sent.iter().filter(|s| s.code != Code::Ok).collect();
    let longest = sent.iter().map(|s| s.took).max().unwrap_or_default();
    let paid = sent
        .iter()
        .filter(|s| s.took >= Duration::from_millis(900))
        .count();
    println!(
        "one of three replicas frozen for 8 s under the defaults: {} charges, {} failed, {paid} paid a per-attempt timeout, the longest took {longest:?}",
        sent.len(),
        failed.len()
    );
    assert!(failed.is_empty(), "failed calls: {:?}", codes(&sent));
    assert!(
        longest < Duration::from_millis(2500),
        "no call much slower than one per-attempt timeout (1 s): {longest:?}"
    );
    resend_and_check(&edge.addr.url, &database_url, &sent).await;
}

#[tokio::test]
async fn a_frozen_replica_costs_at_most_one_per_try_timeout_and_is_avoided() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (_bottom, hop4, database_url) = bottom().await;
    let hop3 = hop3_processes(&hop4).await;
    let list: Vec<String> = hop3.iter().map(|s| s.addr.url.clone()).collect();
    // hop2 gives each attempt 300 ms at a replica and ejects one for 2 s.
    let per_try = Duration::from_millis(300);
    let mut hop2_command = hop_command("relay", "hop2", &list.join(","));
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut hop2_command else {
        unreachable!()
    };
    args.per_try_timeout_ms = Some(per_try.as_millis() as u64);
    args.ejection_base_ms = 2000;
    let hop2 = InProcessService::start("hop2", hop2_command).await.unwrap();
    let edge = InProcessService::start("edge", hop_command("edge", "edge", &hop2.addr.url))
        .await
        .unwrap();

    let load = Load::start(&edge.addr.url, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    hop3[0].signal("STOP").await.unwrap();
    let frozen = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    hop3[0].signal("CONT").await.unwrap();
    let thawed = Instant::now();
    // Once the calls it held are answered, what it receives is new traffic.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at_thaw = received(&hop3[0].addr.admin_url).await;
    // Ejected about when it froze, for 2 s: back in rotation within the next 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = received(&hop3[0].addr.admin_url).await;
    let sent = load.finish().await;

    let ok = sent.iter().filter(|s| s.code == Code::Ok).count();
    let slow = sent
        .iter()
        .filter(|s| s.started > frozen && s.started < thawed && s.took >= per_try)
        .count();
    let longest = sent.iter().map(|s| s.took).max().unwrap_or_default();
    println!(
        "one of three hop3 replicas frozen for 1.5 s: {ok} of {} charges succeeded ({:?}); {slow} paid the per-attempt timeout; the longest took {longest:?}; the thawed replica received {} calls in the 3 s after",
        sent.len(),
        codes(&sent),
        later - at_thaw
    );
    assert!(
        ok * 1000 >= sent.len() * 999,
        "charges keep succeeding: {:?}",
        codes(&sent)
    );
    assert!(
        slow <= 12,
        "avoided after a few timeouts (by its load estimate, or ejected after 5 in a row): {slow}"
    );
    assert!(
        longest < per_try * 2 + Duration::from_secs(1),
        "no charge pays more than one per-attempt timeout: {longest:?}"
    );
    // Whether it takes traffic again soon after the thaw depends on which kept it out:
    // an ejection ends after its time (2 s here) with a fresh estimate; the load estimate
    // alone (its 300 ms answers) forgets over about 10 s. Printed above, not asserted.
    let _ = (at_thaw, later);
    resend_and_check(&edge.addr.url, &database_url, &sent).await;
}

/// Replicas frozen and thawed again and again under load (each in turn), with a
/// per-attempt timeout shorter than the freezes: every attempt that runs out at it is told as a per-attempt
/// timeout (UNAVAILABLE, retried elsewhere), never as the call's own deadline. A client
/// sees DEADLINE_EXCEEDED only once its deadline has passed — whether it calls the edge
/// (which retries) or hop2 itself (one attempt, the answer unretried) — and every key is
/// still charged exactly once.
#[tokio::test]
async fn deadline_exceeded_reaches_a_caller_only_at_its_deadline_whatever_a_flapping_replica_does()
{
    let _one = ONE_AT_A_TIME.lock().await;
    let (_bottom, hop4, database_url) = bottom().await;
    let hop3 = hop3_processes(&hop4).await;
    let list: Vec<String> = hop3.iter().map(|s| s.addr.url.clone()).collect();
    // Long enough for a charge below hop3 in a debug build under this load (hop3, hop4
    // and the ledger each keep a 20 ms margin of it), short against the freezes.
    let per_try = Duration::from_millis(250);
    let mut hop2_command = hop_command("relay", "hop2", &list.join(","));
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut hop2_command else {
        unreachable!()
    };
    args.per_try_timeout_ms = Some(per_try.as_millis() as u64);
    args.ejection_base_ms = 500;
    let hop2 = InProcessService::start("hop2", hop2_command).await.unwrap();
    let edge = InProcessService::start("edge", hop_command("edge", "edge", &hop2.addr.url))
        .await
        .unwrap();

    let through_edge = Load::start(&edge.addr.url, 4);
    let at_hop2 = Load::start(&hop2.addr.url, 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Freezes of 100 to 580 ms, around the per-attempt timeout, 100 to 300 ms apart.
    let mut flaps = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        let frozen_for = Duration::from_millis(100 + (flaps * 37) % 480);
        let thawed_for = Duration::from_millis(100 + (flaps * 53) % 200);
        // Each replica in turn: the one frozen next is one the balancer is still using.
        let replica = &hop3[flaps as usize % hop3.len()];
        replica.signal("STOP").await.unwrap();
        tokio::time::sleep(frozen_for).await;
        replica.signal("CONT").await.unwrap();
        tokio::time::sleep(thawed_for).await;
        flaps += 1;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let edge_sent = through_edge.finish().await;
    let hop2_sent = at_hop2.finish().await;

    let early = |sent: &[Sent]| -> Vec<String> {
        sent.iter()
            .filter(|s| {
                s.code == Code::DeadlineExceeded
                    && s.took + Duration::from_millis(100) < LOAD_DEADLINE
            })
            .map(|s| format!("after {:?}: {}", s.took, s.message))
            .collect()
    };
    let per_try_failures = hop2_sent
        .iter()
        .filter(|s| s.code == Code::Unavailable && s.message.contains("per-attempt timeout"))
        .count();
    println!(
        "hop3 replicas frozen and thawed {flaps} times in 8 s (per-attempt timeout {per_try:?}): \
         through the edge {:?}; at hop2 {:?}, {per_try_failures} of them per-attempt timeouts",
        codes(&edge_sent),
        codes(&hop2_sent),
    );
    assert!(flaps >= 12, "{flaps}");
    assert!(
        per_try_failures > 0,
        "the freezes never outlasted an attempt: the test made no race"
    );
    for (who, sent) in [("the edge", &edge_sent), ("hop2", &hop2_sent)] {
        let early = early(sent);
        assert!(
            early.is_empty(),
            "{who}'s callers were told DEADLINE_EXCEEDED with time left: {early:?}"
        );
        assert!(
            sent.iter().all(|s| s.code != Code::Cancelled),
            "{who}: CANCELLED for a call nobody cancelled: {:?}",
            codes(sent)
        );
    }
    let ok = edge_sent.iter().filter(|s| s.code == Code::Ok).count();
    assert!(
        ok * 100 >= edge_sent.len() * 99,
        "through the edge, charges keep succeeding: {:?}",
        codes(&edge_sent)
    );
    let all: Vec<Sent> = edge_sent.into_iter().chain(hop2_sent).collect();
    resend_and_check(&edge.addr.url, &database_url, &all).await;
}

#[tokio::test]
async fn a_ledger_outage_ejects_no_relay() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (ledger, _db) = start_ledger(|_| {}).await;
    // Two hop4s over the one ledger, hop3 over both; the ledger's processor fails all.
    let mut hop4 = Vec::new();
    for i in 0..2 {
        hop4.push(
            InProcessService::start(
                "hop4",
                hop_command("relay", &format!("hop4-{i}"), &ledger.addr.url),
            )
            .await
            .unwrap(),
        );
    }
    let list: Vec<String> = hop4.iter().map(|s| s.addr.url.clone()).collect();
    let mut hop3_command = hop_command("relay", "hop3", &list.join(","));
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut hop3_command else {
        unreachable!()
    };
    // One of the two may be ejected: were the relayed failures held against them, one
    // would be, and would receive nothing while the other is in rotation.
    args.max_ejection_percent = 50;
    let hop3 = InProcessService::start("hop3", hop3_command).await.unwrap();
    let control = retrychain_proto::v1::control_client::ControlClient::new(
        connect(&ledger.addr.admin_url).await,
    );
    control.clone().set_faults(failing()).await.unwrap();
    let client = PaymentsClient::new(connect(&hop3.addr.url).await);
    let account = new_account();
    // 40 charges, 4 at a time (with calls in flight the load estimate spreads them).
    let batch = || {
        let (client, account) = (client.clone(), account.clone());
        futures::stream::iter(0..40)
            .map(move |_| {
                let (client, account) = (client.clone(), account.clone());
                async move {
                    charge_on(
                        &client,
                        &account,
                        100,
                        Some(&new_key()),
                        Duration::from_secs(2),
                    )
                    .await
                }
            })
            .buffer_unordered(4)
            .collect::<Vec<_>>()
    };
    for answer in batch().await {
        assert_eq!(answer.unwrap_err().code(), Code::Unavailable);
    }
    // 40 failures relayed by two hop4s (5 in a row would eject one): both still in
    // rotation, so both keep receiving calls.
    let before = [
        received(&hop4[0].addr.admin_url).await,
        received(&hop4[1].addr.admin_url).await,
    ];
    batch().await;
    let after = [
        received(&hop4[0].addr.admin_url).await,
        received(&hop4[1].addr.admin_url).await,
    ];
    println!("ledger failing everything: hop4s received {before:?}, then {after:?}");
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "neither hop4 was ejected"
    );
}

/// The sum of one metric's series in a `/metrics` text (`name{…} value` lines).
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter_map(|line| line.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Two replicas of every tier below the edge, the ledgers' processor failing and then
/// both ledgers stopped: bottom calls stay at most 3 per charge with the edge's retries
/// and exactly 243 in every-layer mode (balancing spreads them, it does not add any), and
/// no relay is ejected — each hop's per-endpoint metrics say so.
#[tokio::test]
async fn a_ledger_outage_over_replicas_keeps_3_and_243_and_ejects_no_relay() {
    use retrychain_harness::{ChainClient, InProcessChain};
    let _one = ONE_AT_A_TIME.lock().await;
    let mut options = Options::default();
    options.spec.replicas = 2;
    options.spec.database_url = Some(database().await);
    let mut chain = InProcessChain::start(options.spec).await.unwrap();
    let addrs = chain.addrs();
    let client = ChainClient::connect(&addrs).await.unwrap();
    let is_ledger = |s: &InProcessService| s.name.starts_with("ledger");
    let ledgers: Vec<String> = chain
        .services
        .iter()
        .chain(&chain.replicas)
        .filter(|s| is_ledger(s))
        .map(|s| s.addr.admin_url.clone())
        .collect();
    let relays: Vec<(String, String)> = chain
        .services
        .iter()
        .chain(&chain.replicas)
        .filter(|s| !is_ledger(s))
        .map(|s| (s.name.clone(), s.addr.admin_url.clone()))
        .collect();
    assert_eq!((ledgers.len(), relays.len()), (2, 7));
    let mut controls = Vec::new();
    for admin in &ledgers {
        controls.push(retrychain_proto::v1::control_client::ControlClient::new(
            connect(admin).await,
        ));
    }
    let bottom = || async {
        let mut sum = 0;
        for control in &controls {
            sum += bottom_calls(control).await;
        }
        sum
    };
    for control in &controls {
        control.clone().set_faults(failing()).await.unwrap();
    }

    // The edge's retries: 20 charges, each at most 3 bottom calls (the budget may refuse
    // some retries; never more).
    for _ in 0..20 {
        let status = client
            .charge(charge(
                &new_account(),
                100,
                None,
                Duration::from_secs(5),
                &[],
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    let edge_only = bottom().await;
    println!("edge-only: {edge_only} bottom calls for 20 charges");
    assert!((20..=60).contains(&edge_only), "{edge_only}");

    // Every layer retrying: 3^5, however the replicas shared them.
    let status = client
        .charge(charge(
            &new_account(),
            100,
            None,
            Duration::from_secs(20),
            &[("x-retry-mode", "every-layer")],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let every_layer = bottom().await - edge_only;
    println!("every-layer: {every_layer} bottom calls for one charge over two replicas a tier");
    assert_eq!(every_layer, 243);

    // Slower calls into the ledgers (each hop4 call 50 ms late): one edge attempt (27 of
    // them) now outlasts the per-attempt timeout a replicated hop takes by default (1 s),
    // which is sized for one call through the chain and must not cut an every-layer
    // attempt — all its retries below — short.
    let mut hop4s = Vec::new();
    for (name, admin) in relays.iter().filter(|(name, _)| name.starts_with("hop4")) {
        let control =
            retrychain_proto::v1::control_client::ControlClient::new(connect(admin).await);
        control.clone().set_faults(delayed(50)).await.unwrap();
        hop4s.push((name, control));
    }
    assert_eq!(hop4s.len(), 2);
    let before = bottom().await;
    let started = Instant::now();
    let status = client
        .charge(charge(
            &new_account(),
            100,
            None,
            Duration::from_secs(30),
            &[("x-retry-mode", "every-layer")],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let slow = bottom().await - before;
    let took = started.elapsed();
    println!("every-layer, hop4 calls 50 ms late: {slow} bottom calls in {took:?}");
    assert!(
        took > Duration::from_secs(3),
        "an edge attempt outlasted 1 s"
    );
    assert_eq!(slow, 243, "no attempt was cut by a per-attempt timeout");
    for (_, control) in &hop4s {
        control.clone().set_faults(faults()).await.unwrap();
    }

    // Both ledgers stopped: the hop4s lose their downstream; nobody above ejects a relay.
    let stopped: Vec<InProcessService> = {
        let mut stopped = Vec::new();
        for i in (0..chain.replicas.len()).rev() {
            if is_ledger(&chain.replicas[i]) {
                stopped.push(chain.replicas.remove(i));
            }
        }
        stopped.push(chain.services.remove(4));
        stopped
    };
    for ledger in stopped {
        ledger.stop().await.unwrap();
    }
    for _ in 0..20 {
        let status = client
            .charge(charge(
                &new_account(),
                100,
                None,
                Duration::from_secs(5),
                &[],
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    for (name, admin) in &relays {
        let text = scrape_metrics(admin).await;
        let calls = metric_sum(&text, "retrychain_endpoint_calls_total");
        let ejections = metric_sum(&text, "retrychain_endpoint_ejections_total");
        let failures = metric_sum(&text, "retrychain_endpoint_failures_total");
        println!("{name}: {calls} calls below, {failures} own failures, {ejections} ejections");
        assert!(calls > 0.0, "{name} called below");
        if !name.starts_with("hop4") {
            // Its replicas below are relays: they relayed every failure, had none.
            assert_eq!((failures, ejections), (0.0, 0.0), "{name}:\n{text}");
        }
    }
}

/// Adaptive throttling at the edge, the ledger's processor failing everything: the
/// edge sheds the load locally, so what reaches the ledger stays within K × accepted plus
/// the window's first few draws — far below what the clients send — and the edge's
/// `/metrics` shows the throttle's rejection probability near 1.
#[tokio::test]
async fn adaptive_throttling_keeps_a_failing_ledgers_load_near_k_times_accepted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut options = Options::default();
    options.spec.edge().service.adaptive_throttling = true;
    // A 2 s window (the default is 10 s): the throttle opens again within seconds.
    options.spec.edge().service.adaptive_throttling_window_ms = 2000;
    let chain = Chain::spawn(options).await;
    chain.fail_processor().await;
    chain.reset_stats().await;
    let edge = chain.edge().await;
    let sent = 400;
    let answers: Vec<_> = futures::stream::iter(0..sent)
        .map(|_| {
            let edge = edge.clone();
            async move { charge_on(&edge, &new_account(), 100, None, Duration::from_secs(5)).await }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let shed = answers
        .iter()
        .filter(|a| {
            a.as_ref().is_err_and(|s| {
                s.message()
                    .contains("rejected locally by adaptive throttling")
            })
        })
        .count();
    assert!(answers.iter().all(Result::is_err));
    let stats = chain.all_stats().await;
    let ledger = stats[4].requests_received;
    // Accepted below: charges the ledger committed (none: its processor fails them all).
    let accepted = stats[4].executions;
    println!(
        "{sent} charges, {shed} shed at the edge, the ledger received {ledger} (without the throttle: up to {})",
        sent * 3
    );
    // K × accepted + the window's slack: while nothing is accepted, an attempt goes with
    // probability 1/(requests + 1), about ln(requests) of them in all, plus those in
    // flight when the window filled.
    assert!(ledger <= 2 * accepted + 30, "the ledger received {ledger}");
    assert!(shed >= 350, "{shed} shed");
    let text = scrape_metrics(&chain.admins[0]).await;
    let p = metric_sum(&text, "retrychain_throttle_reject_probability");
    assert!(p > 0.95, "reject probability {p}");

    // The processor back: the edge opens again as its attempts are accepted.
    chain.set_faults(4, faults()).await;
    let mut ok_in_a_row = 0;
    let started = Instant::now();
    while ok_in_a_row < 20 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the throttle did not open again within 30 s"
        );
        match charge_on(&edge, &new_account(), 100, None, Duration::from_secs(5)).await {
            Ok(_) => ok_in_a_row += 1,
            Err(_) => ok_in_a_row = 0,
        }
        tokio::time::sleep(Duration::from_millis(10)).await; // 100 calls a second at most
    }
    println!(
        "open again {:?} after the processor came back",
        started.elapsed()
    );
}

/// A replica whose calls below are slow (each takes 2 s), behind an edge with a 300 ms
/// per-attempt timeout and a service config that retries only UNAVAILABLE: the replica
/// is told the per-attempt timeout, gives up first and answers DEADLINE_EXCEEDED; the
/// balancer tells that as its per-attempt timeout (UNAVAILABLE), so the edge retries it
/// on the other replica whatever its policy thinks of DEADLINE_EXCEEDED. The slowness is
/// below the replica (relayed), so it is not held against it; a replica slow itself
/// (frozen) is `a_frozen_replica_costs_at_most_one_per_try_timeout_and_is_avoided`.
#[tokio::test]
async fn a_slow_replica_costs_one_per_try_timeout_whatever_the_policy_retries() {
    let (_bottom, hop4, _db) = bottom().await;
    let hop3 = InProcessService::start("hop3", hop_command("relay", "hop3", &hop4))
        .await
        .unwrap();
    let hop2 = relays("hop2", &["hop2-slow", "hop2-ok"], &hop3.addr.url).await;
    retrychain_proto::v1::control_client::ControlClient::new(
        connect(&hop2[0].addr.admin_url).await,
    )
    .set_faults(delayed(2000))
    .await
    .unwrap();
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        r#"{"methodConfig": [{"name": [{"service": "retrychain.v1.Payments"}],
            "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    let list = format!("{},{}", hop2[0].addr.url, hop2[1].addr.url);
    let mut edge_command = hop_command("edge", "edge", &list);
    edge_command.service_mut().service_config = Some(config.path().to_owned());
    edge_command.service_mut().no_budget = true;
    let (ServiceCommand::Edge(args) | ServiceCommand::Relay(args)) = &mut edge_command else {
        unreachable!()
    };
    args.per_try_timeout_ms = Some(300);
    args.max_ejection_percent = 50;
    let edge = InProcessService::start("edge", edge_command).await.unwrap();

    let client = PaymentsClient::new(connect(&edge.addr.url).await);
    let account = new_account();
    let mut failed = Vec::new();
    let mut longest = Duration::ZERO;
    for _ in 0..40 {
        let started = Instant::now();
        if let Err(status) = charge_on(
            &client,
            &account,
            100,
            Some(&new_key()),
            Duration::from_secs(5),
        )
        .await
        {
            failed.push(status);
        }
        longest = longest.max(started.elapsed());
    }
    let text = scrape_metrics(&edge.addr.admin_url).await;
    let ejections = metric_sum(&text, "retrychain_endpoint_ejections_total");
    let failures = metric_sum(&text, "retrychain_endpoint_failures_total");
    println!(
        "40 charges: {} failed, longest {longest:?}; the edge counted {failures} own failures below, {ejections} ejections",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "each retried on the other replica: {failed:?}"
    );
    assert!(
        longest < Duration::from_millis(1500),
        "at most one per-attempt timeout each: {longest:?}"
    );
    assert_eq!(
        (failures, ejections),
        (0.0, 0.0),
        "slowness relayed from below is not the replica's own:\n{text}"
    );
}
