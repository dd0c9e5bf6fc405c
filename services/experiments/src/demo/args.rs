//! The flags of `demo`.

use clap::Args;

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
