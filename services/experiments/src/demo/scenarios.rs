//! The scenarios themselves, each against the chain ([`Target`]) or an edge the demo
//! starts for it ([`DemoEdge`]).

use std::time::{Duration, Instant};

use super::{
    args::DemoArgs,
    report::{
        Concurrent, DemoReport, Effect, KeyReuse, Layered, Load, LostReply, ModeCounts, Outage,
        Storm, StormRun,
    },
};
use anyhow::Context;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use resilience::{
    Backoff, BackoffKind, RetryLayer, ServiceConfig,
    service_config::{CallPolicy, RetryPolicyConfig},
};
use retrychain_domain::{RetryMode, metadata};
use retrychain_harness::{ChainAddrs, ChainClient, InProcessService, charge_request};
use retrychain_proto::v1::{
    ChargeReply, ChargeRequest, Faults, Stats, payments_client::PaymentsClient,
};
use retrychain_serve::{ServiceCommand, args::HopArgs};
use tonic::{Code, Request, Response, transport::Channel};
use tower::Layer as _;

/// The chain the demo talks to.
pub(super) struct Target {
    /// Its addresses.
    pub(super) addrs: ChainAddrs,
    /// Its caller.
    pub(super) chain: ChainClient,
    /// A tag that keeps this run's accounts and keys apart from earlier runs'.
    pub(super) run: String,
}

pub(super) const LEDGER: usize = 4;

pub(super) const T: Duration = Duration::from_secs(30);

pub(super) async fn scenarios(target: &Target, args: &DemoArgs) -> anyhow::Result<DemoReport> {
    let lost_reply = target.lost_reply().await?;
    let key_reuse = target.key_reuse().await?;
    let concurrent = target.concurrent().await?;
    let hop2 = target.addrs.hop2.url.clone();
    // Four attempts, quick backoff (1 to 10 ms).
    let four_quick = |edge: &mut HopArgs| {
        edge.service.max_attempts = 4;
        edge.service.backoff_base_ms = 1;
        edge.service.backoff_cap_ms = 10;
    };

    let edge = DemoEdge::start("demo-edge", &hop2, |_| {}).await?;
    let layered = target.layered(&edge).await;
    edge.stop().await;
    let layered = layered?;

    let no_budget = DemoEdge::start("edge-no-budget", &hop2, |edge| {
        four_quick(edge);
        edge.service.no_budget = true;
    })
    .await?;
    let budgeted = DemoEdge::start("edge-budget", &hop2, four_quick).await?;
    let outage = target
        .outage(&no_budget, &budgeted, args.outage_requests)
        .await;
    no_budget.stop().await;
    budgeted.stop().await;
    let outage = outage?;

    let single =
        DemoEdge::start("edge-single", &hop2, |edge| edge.service.max_attempts = 1).await?;
    let storm = target
        .storm(&single, args.storm_clients, args.tick_ms)
        .await;
    single.stop().await;
    let storm = storm?;

    // g., through the chain's own edge, as it is configured: no knob turned for it.
    let mut edge = Vec::new();
    for _ in 0..4 {
        edge.push(retrychain_harness::connect(&target.addrs.edge.url).await?);
    }
    let metastability = crate::metastable::run(
        &target.chain.control(LEDGER),
        &edge,
        crate::metastable::Shape::default(),
        &target.run,
    )
    .await?;
    if let Some(path) = &args.metastability_svg {
        crate::metastable::draw(path, &metastability)?;
    }
    Ok(DemoReport {
        lost_reply,
        key_reuse,
        concurrent,
        layered,
        outage,
        storm,
        metastability,
    })
}

/// An edge the demo starts for itself, in this process, forwarding to the chain's hop2.
pub(super) struct DemoEdge {
    /// The service.
    service: InProcessService,
    /// Its caller (the chain below it is the target's).
    client: ChainClient,
}

impl DemoEdge {
    /// An edge named `name` in front of `hop2`, with `configure` applied to its defaults.
    pub(super) async fn start(
        name: &str,
        hop2: &str,
        configure: impl FnOnce(&mut HopArgs),
    ) -> anyhow::Result<Self> {
        let mut command = ServiceCommand::defaults("edge", "")?;
        let ServiceCommand::Edge(edge) = &mut command else {
            unreachable!("the defaults of an edge are an edge's")
        };
        edge.service.listen = Some(([127, 0, 0, 1], 0).into());
        edge.service.name = Some(name.to_owned());
        edge.service.allow_retry_mode_override = true;
        edge.downstream = Some(hop2.to_owned());
        configure(edge);
        let service = InProcessService::start(name, command).await?;
        let client = ChainClient::connect_one(&service.addr).await?;
        Ok(Self { service, client })
    }

    pub(super) fn payments(&self) -> PaymentsClient<Channel> {
        self.client.edge()
    }

    pub(super) fn channel(&self) -> Channel {
        self.client.channel(0)
    }

    pub(super) async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self.client.stats(0).await?)
    }

    pub(super) async fn reset(&self) -> anyhow::Result<()> {
        Ok(self.client.reset_stats().await?)
    }

    pub(super) async fn stop(self) {
        let _ = self.service.stop().await;
    }
}

/// A Charge under the demo's 30 s deadline.
pub(super) fn charge(
    account: &str,
    amount: i64,
    key: &str,
    mode: Option<RetryMode>,
) -> Request<ChargeRequest> {
    charge_request(account, amount, Some(key), T, mode)
}

pub(super) fn replayed(response: &Response<ChargeReply>) -> bool {
    response
        .metadata()
        .get(metadata::IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true")
}

pub(super) fn code_name(code: Code) -> String {
    resilience::wire::code_name(code).to_owned()
}

impl Target {
    pub(super) async fn connect(addrs: ChainAddrs) -> anyhow::Result<Self> {
        let chain = ChainClient::connect(&addrs).await?;
        let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        Ok(Self { addrs, chain, run })
    }

    pub(super) fn edge(&self) -> PaymentsClient<Channel> {
        self.chain.edge()
    }

    pub(super) async fn faults(&self, faults: Faults) -> anyhow::Result<()> {
        self.chain.set_faults(LEDGER, faults).await?;
        Ok(())
    }

    pub(super) async fn stats(&self, i: usize) -> anyhow::Result<Stats> {
        Ok(self.chain.stats(i).await?)
    }

    pub(super) fn name(&self, what: &str) -> String {
        format!("demo-{}-{what}", self.run)
    }

    pub(super) async fn effect(&self, account: &str) -> anyhow::Result<Effect> {
        let (balance_cents, executions) = self.chain.account(account).await?.unwrap_or((0, 0));
        Ok(Effect {
            executions,
            balance_cents,
        })
    }

    /// A charge whose reply is lost; returns nothing (the client saw an error).
    pub(super) async fn lose_a_reply(&self, account: &str, key: &str) -> anyhow::Result<()> {
        self.chain.lose_replies_at(LEDGER, 1.0).await?;
        let lost = self.edge().charge(charge(account, 500, key, None)).await;
        self.chain.clear_faults(LEDGER).await?;
        anyhow::ensure!(lost.is_err(), "the reply should have been lost");
        Ok(())
    }

    pub(super) async fn lost_reply(&self) -> anyhow::Result<LostReply> {
        let fresh = self.name("lost-fresh");
        self.lose_a_reply(&fresh, &self.name("k1")).await?;
        self.edge()
            .charge(charge(&fresh, 500, &self.name("k2"), None))
            .await?;

        let same = self.name("lost-same");
        let key = self.name("k3");
        self.lose_a_reply(&same, &key).await?;
        let retry = self.edge().charge(charge(&same, 500, &key, None)).await?;
        let again = self.edge().charge(charge(&same, 500, &key, None)).await?;
        Ok(LostReply {
            fresh_key: self.effect(&fresh).await?,
            same_key: self.effect(&same).await?,
            same_charge_id: retry.get_ref().charge_id == again.get_ref().charge_id,
            replayed: replayed(&retry),
        })
    }

    pub(super) async fn key_reuse(&self) -> anyhow::Result<KeyReuse> {
        let account = self.name("reuse");
        let key = self.name("k4");
        self.edge()
            .charge(charge(&account, 500, &key, None))
            .await?;
        let before = self.effect(&account).await?;
        let code = match self.edge().charge(charge(&account, 900, &key, None)).await {
            Ok(_) => "OK".to_owned(),
            Err(status) => code_name(status.code()),
        };
        Ok(KeyReuse {
            code,
            before,
            after: self.effect(&account).await?,
        })
    }

    pub(super) async fn concurrent(&self) -> anyhow::Result<Concurrent> {
        let delay = 200;
        self.faults(Faults {
            delay_ms: delay,
            ..Faults::default()
        })
        .await?;
        let account = self.name("concurrent");
        let key = self.name("k5");
        let (mut a, mut b) = (self.edge(), self.edge());
        let start = Instant::now();
        let (first, second) = tokio::join!(
            a.charge(charge(&account, 500, &key, None)),
            b.charge(charge(&account, 500, &key, None))
        );
        let elapsed = start.elapsed();
        self.chain.clear_faults(LEDGER).await?;
        let (first, second) = (first?, second?);
        Ok(Concurrent {
            executions: self.effect(&account).await?.executions,
            same_reply: first.get_ref() == second.get_ref(),
            elapsed_ms: elapsed.as_secs_f64() * 1e3,
            processor_delay_ms: delay,
        })
    }

    pub(super) async fn layered(&self, edge: &DemoEdge) -> anyhow::Result<Layered> {
        self.chain.fail_processor().await?;
        let mut counts = Vec::new();
        for mode in [RetryMode::EveryLayer, RetryMode::EdgeOnly] {
            self.chain.reset_stats_of(1..5).await?;
            edge.reset().await?;
            let result = edge
                .payments()
                .charge(charge(
                    &self.name("layered"),
                    100,
                    &self.name(mode.as_str()),
                    Some(mode),
                ))
                .await;
            let mut received = vec![edge.stats().await?.requests_received];
            for i in 1..5 {
                received.push(self.stats(i).await?.requests_received);
            }
            counts.push(ModeCounts {
                bottom_calls: self.stats(LEDGER).await?.downstream_attempts,
                received,
                code: result.map_or_else(|s| code_name(s.code()), |_| "OK".into()),
            });
        }
        self.chain.clear_faults(LEDGER).await?;
        let edge_only = counts.pop().context("two modes")?;
        let every_layer = counts.pop().context("two modes")?;
        Ok(Layered {
            every_layer,
            edge_only,
        })
    }

    pub(super) async fn outage(
        &self,
        no_budget: &DemoEdge,
        budget: &DemoEdge,
        requests: u64,
    ) -> anyhow::Result<Outage> {
        self.chain.fail_processor().await?;
        let mut loads = Vec::new();
        for (label, edge) in [("no-budget", no_budget), ("budget", budget)] {
            self.chain.reset_stats_of([LEDGER]).await?;
            edge.reset().await?;
            let bar = progress(requests, &format!("e. outage, {label}"));
            let unexpected = futures::stream::iter(0..requests)
                .map(|i| {
                    let mut client = edge.payments();
                    let key = self.name(&format!("outage-{label}-{i}"));
                    let account = self.name("outage");
                    async move {
                        let result = client
                            .charge(charge(&account, 100, &key, Some(RetryMode::EdgeOnly)))
                            .await;
                        result.err().map(|status| status.code())
                    }
                })
                .buffer_unordered(16)
                .filter(|code| {
                    bar.inc(1);
                    std::future::ready(*code != Some(Code::Unavailable))
                })
                .count()
                .await;
            bar.finish_and_clear();
            anyhow::ensure!(
                unexpected == 0,
                "{unexpected} outage requests ended other than UNAVAILABLE"
            );
            let first = edge.stats().await?.requests_received;
            let bottom_calls = self.stats(LEDGER).await?.downstream_attempts;
            loads.push(Load {
                first,
                bottom_calls,
                load: bottom_calls as f64 / first.max(1) as f64,
            });
        }
        self.chain.clear_faults(LEDGER).await?;
        Ok(Outage {
            requests,
            no_budget: loads[0],
            budget: loads[1],
        })
    }

    pub(super) async fn storm(
        &self,
        edge: &DemoEdge,
        clients: usize,
        tick_ms: u64,
    ) -> anyhow::Result<Storm> {
        let tick = Duration::from_millis(tick_ms);
        self.faults(Faults {
            delay_ms: tick_ms as u32,
            processor_capacity: 1,
            ..Faults::default()
        })
        .await?;
        let mut runs = Vec::new();
        for kind in BackoffKind::ALL {
            self.chain.reset_stats_of([LEDGER]).await?;
            let bar = progress(clients as u64, &format!("f. storm, {kind}"));
            // Clients that retry until they are served (within two minutes), with this
            // backoff: the retry engine over the edge's channel, retrying the contract's
            // retryable codes.
            let until_served =
                ServiceConfig::every_method(CallPolicy::Retry(RetryPolicyConfig::new(
                    u32::MAX,
                    Backoff::new(kind, 2 * tick, 64 * tick),
                    resilience::classify::RETRYABLE.to_vec(),
                )));
            let retrying = RetryLayer::new(until_served)
                .min_attempt(Duration::from_millis(1))
                .layer(edge.channel());
            let start = Instant::now();
            let attempts = (0..clients).map(|i| {
                let mut client = PaymentsClient::new(retrying.clone());
                let bar = &bar;
                let account = self.name(&format!("storm-{kind}-{i}"));
                let key = self.name(&format!("storm-{kind}-{i}"));
                async move {
                    let mut request = charge(&account, 100, &key, Some(RetryMode::EdgeOnly));
                    request.set_timeout(Duration::from_secs(120));
                    let outcome = client.charge(request).await;
                    bar.inc(1);
                    outcome.is_ok()
                }
            });
            let succeeded = futures::future::join_all(attempts)
                .await
                .into_iter()
                .filter(|ok| *ok)
                .count();
            let elapsed = start.elapsed();
            bar.finish_and_clear();
            runs.push(StormRun {
                bottom_calls: self.stats(LEDGER).await?.downstream_attempts,
                succeeded,
                elapsed_ms: elapsed.as_secs_f64() * 1e3,
            });
        }
        self.chain.clear_faults(LEDGER).await?;
        Ok(Storm {
            clients,
            tick_ms,
            none: runs[0],
            exponential: runs[1],
            full: runs[2],
            equal: runs[3],
            decorrelated: runs[4],
        })
    }
}

pub(super) fn progress(len: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg:<24} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_owned());
    bar
}
