//! Starting one service from its flags: the part of each binary that is not library code.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use resilience::RetryBudget;
use retrychain_hop::{Hop, HopRetryConfig, Role};
use retrychain_ledger::{InFlight, KeyStore, Ledger, run_retention};
use retrychain_node::{Node, telemetry};
use tokio::net::TcpListener;
use tonic::transport::Endpoint;

use crate::config::{HopArgs, InFlightArg, LedgerArgs, ServiceArgs};

/// Runs the edge (`edge == true`) or a relay until Ctrl-C or SIGTERM.
pub async fn hop(args: HopArgs, edge: bool) -> anyhow::Result<()> {
    let service = &args.service;
    telemetry::init(service.log_format.into());
    let (default_listen, default_name) = if edge {
        ("0.0.0.0:50051", "edge")
    } else {
        ("0.0.0.0:50052", "hop2")
    };
    let downstream = match (&args.downstream, edge) {
        (Some(url), _) => url.clone(),
        (None, true) => "http://127.0.0.1:50052".to_owned(),
        (None, false) => anyhow::bail!("a relay needs --downstream (or RETRYCHAIN_DOWNSTREAM)"),
    };
    let listener = bind(service, default_listen).await?;
    // Only the edge retries under a budget; elsewhere Stats reports 0 tokens.
    let budget = (edge && !service.no_budget).then(|| {
        Arc::new(RetryBudget::new(
            service.budget_tokens,
            service.budget_refund,
        ))
    });
    let node = node(service, default_name, budget.clone());
    // Connect lazily: services may start in any order, and a downstream that is not up
    // yet is an UNAVAILABLE attempt like any other.
    let channel = Endpoint::from_shared(downstream.clone())
        .with_context(|| format!("downstream URL {downstream:?}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    let role = if edge {
        Role::Edge {
            allow_retry_mode_override: args.allow_retry_mode_override,
        }
    } else {
        Role::Relay
    };
    let policy = service.every_layer_policy();
    let hop = Hop::new(
        Arc::clone(&node),
        role,
        HopRetryConfig {
            mode: service.retry_mode.into(),
            max_attempts: policy.max_attempts,
            backoff: policy.backoff,
            budget,
            margin: policy.margin,
            min_attempt: policy.min_attempt,
        },
        channel,
    );
    tracing::info!(%downstream, mode = %hop_mode(service), "forwarding");
    retrychain_node::serve(listener, node, hop, service.reserve(), shutdown_signal()).await?;
    Ok(())
}

/// Runs the ledger until Ctrl-C or SIGTERM.
pub async fn ledger(args: LedgerArgs) -> anyhow::Result<()> {
    let service = &args.service;
    telemetry::init(service.log_format.into());
    let listener = bind(service, "0.0.0.0:50055").await?;
    let store = KeyStore::connect(&args.database_url, args.db_pool_size).await?;
    let node = node(service, "ledger", None);
    let in_flight = match args.in_flight {
        InFlightArg::Wait => InFlight::Wait,
        InFlightArg::Reject => InFlight::Reject,
    };
    let ledger = Ledger::new(
        Arc::clone(&node),
        store.clone(),
        service.retry_mode.into(),
        service.every_layer_policy(),
        in_flight,
    );
    // Purge a few times per retention window, at most once a minute.
    let every = (args.key_retention / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let retention = tokio::spawn(run_retention(store, args.key_retention, every));
    tracing::info!(retention = ?args.key_retention, in_flight = ?args.in_flight, "ledger ready");
    let served =
        retrychain_node::serve(listener, node, ledger, service.reserve(), shutdown_signal()).await;
    retention.abort();
    served?;
    Ok(())
}

fn hop_mode(service: &ServiceArgs) -> &'static str {
    retrychain_node::RetryMode::from(service.retry_mode).as_str()
}

fn node(service: &ServiceArgs, default_name: &str, budget: Option<Arc<RetryBudget>>) -> Arc<Node> {
    Arc::new(Node::new(
        service
            .name
            .clone()
            .unwrap_or_else(|| default_name.to_owned()),
        service.fault_injection,
        Duration::from_millis(service.default_deadline_ms),
        budget,
    ))
}

async fn bind(service: &ServiceArgs, default: &str) -> anyhow::Result<TcpListener> {
    let address: SocketAddr = match service.listen {
        Some(address) => address,
        None => default.parse().context("default listen address")?,
    };
    TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address}"))
}

/// Completes on Ctrl-C or SIGTERM (what `docker stop` and `retrychain up` send).
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
