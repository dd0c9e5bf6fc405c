//! `retrychain demo`: the design notes' scenarios, measured on running services.
//!
//! Runs against a chain it starts (like `up`, on `--base-port`) or an existing one
//! (`--edge`, `--hop2` … `--ledger`, e.g. a `docker compose up` deployment started with its
//! demo settings). Scenarios a–c go through the chain's own edge. d–f need edges configured
//! in particular ways (a retry-mode override, no budget, a single attempt), so the demo
//! starts its own edges locally, pointed at the chain's hop2, and names the mode of every
//! request with `x-retry-mode`: the figures do not depend on how the chain was configured.
//! The chain must allow fault injection on its ledger. Scenario g ([`crate::metastable`])
//! loads the chain's own edge at 0.8× its measured capacity and slows the processor for
//! two seconds, once per retry mode.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use resilience::{
    Backoff, BackoffKind, RetryLayer, ServiceConfig,
    service_config::{CallPolicy, RetryPolicyConfig},
};
use retrychain_node::{RetryMode, metadata};
use retrychain_proto::v1::{
    ChargeReply, ChargeRequest, Faults, Stats, payments_client::PaymentsClient,
};
use retrychain_serve::{ServiceCommand, args::HopArgs};
use serde::Serialize;
use tonic::{Code, Request, Response, transport::Channel};
use tower::Layer as _;

use retrychain_harness::{
    ChainAddrs, ChainClient, ChainSpec, InProcessService, ServiceAddr, charge_request, with_chain,
};

/// Flags of `demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Print one JSON object instead of the report.
    #[arg(long, env = "RETRYCHAIN_DEMO_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub json: bool,
    /// An existing chain's edge; with --hop2 … --ledger. Unset: start a chain here.
    #[arg(long, env = "RETRYCHAIN_EDGE", requires_all = ["hop2", "hop3", "hop4", "ledger"])]
    pub edge: Option<String>,
    /// The existing chain's hop2 (the demo's own edges forward to it).
    #[arg(long, env = "RETRYCHAIN_HOP2")]
    pub hop2: Option<String>,
    /// The existing chain's hop3 (for its counters).
    #[arg(long, env = "RETRYCHAIN_HOP3")]
    pub hop3: Option<String>,
    /// The existing chain's hop4 (for its counters).
    #[arg(long, env = "RETRYCHAIN_HOP4")]
    pub hop4: Option<String>,
    /// The existing chain's ledger (counters and faults).
    #[arg(long, env = "RETRYCHAIN_LEDGER")]
    pub ledger: Option<String>,
    /// The existing edge's admin address (Control) [default: --edge's port + 1000].
    #[arg(long, env = "RETRYCHAIN_EDGE_ADMIN")]
    pub edge_admin: Option<String>,
    /// hop2's admin address [default: --hop2's port + 1000].
    #[arg(long, env = "RETRYCHAIN_HOP2_ADMIN")]
    pub hop2_admin: Option<String>,
    /// hop3's admin address [default: --hop3's port + 1000].
    #[arg(long, env = "RETRYCHAIN_HOP3_ADMIN")]
    pub hop3_admin: Option<String>,
    /// hop4's admin address [default: --hop4's port + 1000].
    #[arg(long, env = "RETRYCHAIN_HOP4_ADMIN")]
    pub hop4_admin: Option<String>,
    /// The ledger's admin address [default: --ledger's port + 1000].
    #[arg(long, env = "RETRYCHAIN_LEDGER_ADMIN")]
    pub ledger_admin: Option<String>,
    /// For a chain started here: Postgres URL (unset: a throwaway cluster).
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: Option<String>,
    /// For a chain started here: the edge's port; the others take the next four.
    #[arg(long, default_value_t = 50061, env = "RETRYCHAIN_DEMO_BASE_PORT")]
    pub base_port: u16,
    /// Requests in the outage scenario.
    #[arg(long, default_value_t = 2000, env = "RETRYCHAIN_DEMO_OUTAGE_REQUESTS")]
    pub outage_requests: u64,
    /// Clients in the contention storm.
    #[arg(long, default_value_t = 100, env = "RETRYCHAIN_DEMO_STORM_CLIENTS")]
    pub storm_clients: usize,
    /// The storm's tick: how long the processor takes per charge, in ms.
    #[arg(long, default_value_t = 10, env = "RETRYCHAIN_DEMO_TICK_MS")]
    pub tick_ms: u64,
    /// Draw scenario g's two goodput timelines (edge-only, every-layer) into this SVG.
    #[arg(long, env = "RETRYCHAIN_DEMO_METASTABILITY_SVG")]
    pub metastability_svg: Option<std::path::PathBuf>,
}

/// Everything the demo measured.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// a. A lost reply, retried with a fresh key and with the same key.
    pub lost_reply: LostReply,
    /// b. The same key with another amount.
    pub key_reuse: KeyReuse,
    /// c. Two concurrent requests with one key.
    pub concurrent: Concurrent,
    /// d. Bottom calls per retry mode against a failing processor.
    pub layered: Layered,
    /// e. A total outage with and without the budget.
    pub outage: Outage,
    /// f. The contention storm per backoff policy.
    pub storm: Storm,
    /// g. Load at 0.8× capacity, the processor slowed for 2 s, per retry mode.
    pub metastability: crate::metastable::Metastability,
}

/// a.
#[derive(Debug, Clone, Serialize)]
pub struct LostReply {
    /// The retry used a new key.
    pub fresh_key: Effect,
    /// The retry reused the key.
    pub same_key: Effect,
    /// The retry with the same key got the original charge's id.
    pub same_charge_id: bool,
    /// … marked `idempotent-replayed: true`.
    pub replayed: bool,
}

/// What an account ended with.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Effect {
    /// Charges committed.
    pub executions: i64,
    /// Balance, in cents.
    pub balance_cents: i64,
}

/// b.
#[derive(Debug, Clone, Serialize)]
pub struct KeyReuse {
    /// The code of the second request.
    pub code: String,
    /// Balance and charge count after the first request and after the second.
    pub before: Effect,
    /// …
    pub after: Effect,
}

/// c.
#[derive(Debug, Clone, Serialize)]
pub struct Concurrent {
    /// Charges committed.
    pub executions: i64,
    /// Both got the same charge id.
    pub same_reply: bool,
    /// Wall time for both, in ms.
    pub elapsed_ms: f64,
    /// The processor delay used, in ms.
    pub processor_delay_ms: u32,
}

/// d.
#[derive(Debug, Clone, Serialize)]
pub struct Layered {
    /// `x-retry-mode: every-layer`.
    pub every_layer: ModeCounts,
    /// `x-retry-mode: edge-only`.
    pub edge_only: ModeCounts,
}

/// One request's counts in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeCounts {
    /// Ledger processor calls.
    pub bottom_calls: u64,
    /// Requests received by edge, hop2, hop3, hop4, ledger.
    pub received: Vec<u64>,
    /// The code the client saw.
    pub code: String,
}

/// e.
#[derive(Debug, Clone, Serialize)]
pub struct Outage {
    /// Requests sent per configuration.
    pub requests: u64,
    /// Up to 4 attempts, no budget.
    pub no_budget: Load,
    /// Up to 4 attempts, the default budget.
    pub budget: Load,
}

/// Bottom calls per first attempt.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Load {
    /// First attempts (requests the edge received).
    pub first: u64,
    /// Bottom calls.
    pub bottom_calls: u64,
    /// bottom_calls / first.
    pub load: f64,
}

/// f.
#[derive(Debug, Clone, Serialize)]
pub struct Storm {
    /// Clients started together.
    pub clients: usize,
    /// The processor's time per charge, in ms; it serves one at a time.
    pub tick_ms: u64,
    /// Per policy.
    pub none: StormRun,
    /// …
    pub exponential: StormRun,
    /// …
    pub full: StormRun,
    /// …
    pub equal: StormRun,
    /// …
    pub decorrelated: StormRun,
}

/// One storm run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StormRun {
    /// Bottom calls (processor calls, refused ones included).
    pub bottom_calls: u64,
    /// Clients whose charge went through.
    pub succeeded: usize,
    /// Time until the last client finished, in ms.
    pub elapsed_ms: f64,
}

/// The chain the demo talks to.
struct Target {
    /// Its addresses.
    addrs: ChainAddrs,
    /// Its caller.
    chain: ChainClient,
    /// A tag that keeps this run's accounts and keys apart from earlier runs'.
    run: String,
}

const LEDGER: usize = 4;
const T: Duration = Duration::from_secs(30);

/// Runs every scenario and returns the report.
pub async fn run(args: &DemoArgs) -> anyhow::Result<DemoReport> {
    let external = args
        .edge
        .as_ref()
        .map(|_| {
            [
                (&args.edge, &args.edge_admin),
                (&args.hop2, &args.hop2_admin),
                (&args.hop3, &args.hop3_admin),
                (&args.hop4, &args.hop4_admin),
                (&args.ledger, &args.ledger_admin),
            ]
            .map(|(url, admin)| {
                ServiceAddr::external(url.as_deref().unwrap_or_default(), admin.as_deref())
            })
        })
        .map(ChainAddrs::from_array);
    let spec = ChainSpec {
        database_url: args.database_url.clone(),
        base_port: args.base_port,
        ..ChainSpec::default()
    };
    with_chain(external, spec, |urls| async move {
        let target = Target::connect(urls).await?;
        target
            .chain
            .clear_faults(LEDGER)
            .await
            .context("the ledger must allow fault injection (--fault-injection)")?;
        let report = scenarios(&target, args).await;
        let _ = target.chain.clear_faults(LEDGER).await;
        report
    })
    .await
}

async fn scenarios(target: &Target, args: &DemoArgs) -> anyhow::Result<DemoReport> {
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
struct DemoEdge {
    /// The service.
    service: InProcessService,
    /// Its caller (the chain below it is the target's).
    client: ChainClient,
}

impl DemoEdge {
    /// An edge named `name` in front of `hop2`, with `configure` applied to its defaults.
    async fn start(
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

    fn payments(&self) -> PaymentsClient<Channel> {
        self.client.edge()
    }

    fn channel(&self) -> Channel {
        self.client.channel(0)
    }

    async fn stats(&self) -> anyhow::Result<Stats> {
        Ok(self.client.stats(0).await?)
    }

    async fn reset(&self) -> anyhow::Result<()> {
        Ok(self.client.reset_stats().await?)
    }

    async fn stop(self) {
        let _ = self.service.stop().await;
    }
}

/// A Charge under the demo's 30 s deadline.
fn charge(
    account: &str,
    amount: i64,
    key: &str,
    mode: Option<RetryMode>,
) -> Request<ChargeRequest> {
    charge_request(account, amount, Some(key), T, mode)
}

fn replayed(response: &Response<ChargeReply>) -> bool {
    response
        .metadata()
        .get(metadata::IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true")
}

fn code_name(code: Code) -> String {
    resilience::wire::code_name(code).to_owned()
}

impl Target {
    async fn connect(addrs: ChainAddrs) -> anyhow::Result<Self> {
        let chain = ChainClient::connect(&addrs).await?;
        let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        Ok(Self { addrs, chain, run })
    }

    fn edge(&self) -> PaymentsClient<Channel> {
        self.chain.edge()
    }

    async fn faults(&self, faults: Faults) -> anyhow::Result<()> {
        self.chain.set_faults(LEDGER, faults).await?;
        Ok(())
    }

    async fn stats(&self, i: usize) -> anyhow::Result<Stats> {
        Ok(self.chain.stats(i).await?)
    }

    fn name(&self, what: &str) -> String {
        format!("demo-{}-{what}", self.run)
    }

    async fn effect(&self, account: &str) -> anyhow::Result<Effect> {
        let (balance_cents, executions) = self.chain.account(account).await?.unwrap_or((0, 0));
        Ok(Effect {
            executions,
            balance_cents,
        })
    }

    /// A charge whose reply is lost; returns nothing (the client saw an error).
    async fn lose_a_reply(&self, account: &str, key: &str) -> anyhow::Result<()> {
        self.chain.lose_replies_at(LEDGER, 1.0).await?;
        let lost = self.edge().charge(charge(account, 500, key, None)).await;
        self.chain.clear_faults(LEDGER).await?;
        anyhow::ensure!(lost.is_err(), "the reply should have been lost");
        Ok(())
    }

    async fn lost_reply(&self) -> anyhow::Result<LostReply> {
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

    async fn key_reuse(&self) -> anyhow::Result<KeyReuse> {
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

    async fn concurrent(&self) -> anyhow::Result<Concurrent> {
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

    async fn layered(&self, edge: &DemoEdge) -> anyhow::Result<Layered> {
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

    async fn outage(
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

    async fn storm(&self, edge: &DemoEdge, clients: usize, tick_ms: u64) -> anyhow::Result<Storm> {
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

fn progress(len: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg:<24} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_owned());
    bar
}

/// Prints the report with the design notes' figures beside the measured ones.
pub fn print_report(r: &DemoReport) {
    let a = &r.lost_reply;
    println!("a. A charge of 500 whose reply is lost, then retried");
    println!(
        "   with a fresh key:  {} executions, balance {}        (design notes: 2 executions, balance 1000)",
        a.fresh_key.executions, a.fresh_key.balance_cents
    );
    println!(
        "   with the same key: {} execution,  balance {}, same charge_id: {}, replayed: {}   (design notes: 1 execution, balance 500, the original reply)",
        a.same_key.executions, a.same_key.balance_cents, a.same_charge_id, a.replayed
    );
    let b = &r.key_reuse;
    println!("b. The same key again with amount 900");
    println!(
        "   {} ; balance {} -> {}, charges {} -> {}   (design notes: refused (422), state unchanged)",
        b.code,
        b.before.balance_cents,
        b.after.balance_cents,
        b.before.executions,
        b.after.executions
    );
    let c = &r.concurrent;
    println!(
        "c. Two concurrent charges with one key, {} ms processor",
        c.processor_delay_ms
    );
    println!(
        "   {} execution, same reply: {}, {:.0} ms   (design notes: 1 execution, same reply, about 0.25 s)",
        c.executions, c.same_reply, c.elapsed_ms
    );
    let d = &r.layered;
    println!("d. One request against a failing processor");
    for (mode, counts, notes) in [
        ("every-layer:", &d.every_layer, "243; 1, 3, 9, 27, 81"),
        ("edge-only:", &d.edge_only, "3"),
    ] {
        let received = format!("{:?}", counts.received);
        println!(
            "   {mode:<12} {:>4} bottom calls, received {received:<18} (design notes: {notes})",
            counts.bottom_calls
        );
    }
    let e = &r.outage;
    println!(
        "e. Total outage: {} requests, up to 4 attempts each",
        e.requests
    );
    for (budget, load, notes) in [
        ("no budget:", e.no_budget, "4.00x"),
        ("default budget:", e.budget, "1.10x"),
    ] {
        println!(
            "   {budget:<15} {:>6} bottom calls = {:.2}x   (design notes: {notes})",
            load.bottom_calls, load.load
        );
    }
    let f = &r.storm;
    println!(
        "f. Contention storm: {} clients, processor serves one charge at a time ({} ms each), every client retries until it succeeds",
        f.clients, f.tick_ms
    );
    println!(
        "   {:<13} {:>12} {:>10} {:>10}   design notes (calls)",
        "backoff", "bottom calls", "time ms", "succeeded"
    );
    for (name, run, notes) in [
        ("none", f.none, 5050),
        ("exponential", f.exponential, 5050),
        ("full", f.full, 643),
        ("equal", f.equal, 657),
        ("decorrelated", f.decorrelated, 576),
    ] {
        println!(
            "   {:<13} {:>12} {:>10.0} {:>10}   {}",
            name, run.bottom_calls, run.elapsed_ms, run.succeeded, notes
        );
    }
    let g = &r.metastability;
    println!(
        "g. Load at {:.0} charges/s (0.8x the {:.0}/s measured), {} for {:.0} s",
        g.offered_rps,
        g.capacity_rps,
        g.trigger,
        g.trigger_s.1 - g.trigger_s.0
    );
    for (t, notes) in [
        (&g.edge_only, "back within 2 s"),
        (&g.every_layer, "stays down, or recovers far later"),
    ] {
        let recovered = t
            .recovered_after_s
            .map_or("not within the run".to_owned(), |s| {
                format!("{s:.2} s after the trigger")
            });
        println!(
            "   {:<12} goodput {:.0}/s before, {:.0}/s at the end; back to 95%: {recovered}; {} bottom calls   (design notes: {notes})",
            t.mode, t.goodput_before_rps, t.goodput_end_rps, t.bottom_calls
        );
    }
}
