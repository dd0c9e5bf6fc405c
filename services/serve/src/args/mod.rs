//! The flags of `edge`, `relay` and `ledger`. Every flag can also be set through the
//! environment variable named in `--help`, which is how docker-compose configures the
//! services; the binary and the in-process chains of the harness parse the same flags.
//!
//! [`ServiceArgs`] are every service's, [`HopArgs`] the edge's and the relays', and
//! [`LedgerArgs`] the ledger's; [`ServiceCommand::to_args`] writes any of them back as a
//! child process's command line.

use clap::{CommandFactory, Parser, Subcommand};

mod hop;
mod ledger;
mod service;
mod value;

pub use hop::{CallersArg, HopArgs, REPLICATED_PER_TRY_TIMEOUT_MS};
pub use ledger::{InFlightArg, LedgerArgs, StandbyCopyArg};
pub use service::{LogFormatArg, ServiceArgs};

/// One service's command line, `edge|relay|ledger <flags>`: what the harness parses to
/// start a service in process from the same argv it would give a child process.
#[derive(Debug, Parser)]
#[command(name = "retrychain", no_binary_name = true)]
pub struct ServiceCli {
    /// The service to run.
    #[command(subcommand)]
    pub command: ServiceCommand,
}

/// The three kinds of service; the binary's `edge`, `relay` and `ledger` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ServiceCommand {
    /// Run the edge: the service clients call (default port 50051).
    Edge(HopArgs),
    /// Run a relay (hop2, hop3 or hop4): forwards each call downstream.
    Relay(HopArgs),
    /// Run the ledger: charges accounts through the processor, keys in Postgres.
    Ledger(LedgerArgs),
}

impl ServiceCommand {
    /// The flags every service takes.
    pub fn service(&self) -> &ServiceArgs {
        match self {
            ServiceCommand::Edge(args) | ServiceCommand::Relay(args) => &args.service,
            ServiceCommand::Ledger(args) => &args.service,
        }
    }

    /// The service's name: `--name`, or its role's default (edge, hop2, ledger).
    pub fn name(&self) -> String {
        let default = match self {
            ServiceCommand::Edge(_) => "edge",
            ServiceCommand::Relay(_) => "hop2",
            ServiceCommand::Ledger(_) => "ledger",
        };
        self.service()
            .name
            .clone()
            .unwrap_or_else(|| default.to_owned())
    }
}

/// The flags of one service as a command line: the way a service's typed settings cross a
/// process boundary, and only there (`retrychain-harness` starts in-process services from
/// the typed values). Every field is written, so the command reads the same whatever the
/// child's environment says — but the ledger's database URL, which may hold a password and
/// a command line is readable by every local user: the child gets it as `DATABASE_URL`.
///
/// Nothing here names a flag. The settings are serialized (serde) into their fields'
/// values, and clap's own description of the command says which flag each field is and
/// whether it takes a value: a flag added to the structs is on the command line with no
/// change here (a field of a type without a command-line form fails the round-trip test).
impl ServiceCommand {
    /// `edge|relay|ledger` and every flag but the database URL, as `retrychain` parses
    /// them back.
    pub fn to_args(&self) -> Vec<String> {
        let (role, fields) = match self {
            ServiceCommand::Edge(hop) => ("edge", serde_json::to_value(hop)),
            ServiceCommand::Relay(hop) => ("relay", serde_json::to_value(hop)),
            ServiceCommand::Ledger(ledger) => ("ledger", serde_json::to_value(ledger)),
        };
        // Strings, numbers and booleans only: nothing in them can fail to serialize.
        let Ok(serde_json::Value::Object(fields)) = fields else {
            unreachable!("a service's flags serialize to an object")
        };
        let cli = ServiceCli::command();
        let command = cli
            .find_subcommand(role)
            .unwrap_or_else(|| unreachable!("{role} is a subcommand"));
        let mut args = vec![role.to_owned()];
        for arg in command.get_arguments() {
            let (Some(long), Some(value)) = (arg.get_long(), fields.get(arg.get_id().as_str()))
            else {
                continue; // --help, and the database URL
            };
            let flag = format!("--{long}");
            match value {
                serde_json::Value::Null => {}
                serde_json::Value::Bool(on) if !arg.get_action().takes_values() => {
                    if *on {
                        args.push(flag);
                    }
                }
                serde_json::Value::Bool(on) => args.extend([flag, on.to_string()]),
                serde_json::Value::Number(number) => args.extend([flag, number.to_string()]),
                serde_json::Value::String(text) => args.extend([flag, text.clone()]),
                other => unreachable!("{flag} has no command-line form: {other}"),
            }
        }
        args
    }

    /// A role's command with every flag at its default (as `--help` shows them), the
    /// ledger's database at `database_url`: what a chain's typed settings start from.
    pub fn defaults(role: &str, database_url: &str) -> Result<Self, clap::Error> {
        let mut argv = vec![role.to_owned()];
        if role == "ledger" {
            argv.extend(["--database-url".to_owned(), database_url.to_owned()]);
        }
        ServiceCli::try_parse_from(argv).map(|cli| cli.command)
    }

    /// The flags every service takes, to change them.
    pub fn service_mut(&mut self) -> &mut ServiceArgs {
        match self {
            ServiceCommand::Edge(args) | ServiceCommand::Relay(args) => &mut args.service,
            ServiceCommand::Ledger(args) => &mut args.service,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use resilience::BackoffKind;
    use retrychain_domain::RetryMode;

    use super::*;

    /// Every field set away from its default survives the trip to argv and back.
    #[test]
    fn a_command_reads_back_as_it_was_written() {
        let mut ledger = ServiceCommand::defaults("ledger", "postgres://x@h/db").expect("parses");
        let ServiceCommand::Ledger(args) = &mut ledger else {
            unreachable!()
        };
        args.in_flight = InFlightArg::Reject;
        args.key_retention = Duration::from_secs(5400);
        args.db_pool_size = 7;
        args.db_acquire_timeout_ms = 99;
        args.db_connect_timeout_ms = 999;
        args.db_round_trip_timeout_ms = 1234;
        args.standby_copy = StandbyCopyArg::Required;
        args.caller_signer = Some("spiffe://retrychain/edge".into());
        let s = &mut args.service;
        s.listen = Some("127.0.0.1:1".parse().expect("addr"));
        s.admin_listen = Some("127.0.0.1:2".parse().expect("addr"));
        s.name = Some("ledger-b".into());
        s.retry_mode = RetryMode::EveryLayer;
        s.max_attempts = 4;
        s.backoff = BackoffKind::Decorrelated;
        s.backoff_base_ms = 3;
        s.backoff_cap_ms = 30;
        s.budget_tokens = 2.5;
        s.budget_refund = 0.25;
        s.no_budget = true;
        s.adaptive_throttling = true;
        s.adaptive_throttling_k = 1.5;
        s.adaptive_throttling_window_ms = 4000;
        s.default_deadline_ms = 1500;
        s.max_deadline_ms = 9000;
        s.deadline_margin_ms = 7;
        s.min_attempt_ms = 11;
        s.fault_injection = true;
        s.service_config = Some("/tmp/c.json".into());
        s.allow_retry_mode_override = true;
        s.log_format = LogFormatArg::Json;
        s.max_connections = 10;
        s.max_connections_per_peer = 3;
        s.max_in_flight = 12;
        s.min_concurrency = 5;
        s.initial_concurrency = 6;
        s.tls_dir = Some("/tmp/tls".into());
        s.tls_cert = Some("/tmp/tls/a.crt".into());
        s.tls_key = Some("/tmp/tls/a.key".into());
        s.tls_ca = Some("/tmp/tls/ca.pem".into());
        s.tls_accept = Some("spiffe://retrychain/hop4".into());
        s.latency_objective_ms = Some(250);
        let mut argv = ledger.to_args();
        assert!(!argv.iter().any(|a| a.contains("postgres://")), "{argv:?}");
        argv.extend(["--database-url".to_owned(), "postgres://x@h/db".to_owned()]);
        let back = ServiceCli::try_parse_from(argv)
            .expect("reads back")
            .command;
        assert_eq!(format!("{back:?}"), format!("{ledger:?}"));

        let mut edge = ServiceCommand::defaults("edge", "").expect("parses");
        if let ServiceCommand::Edge(args) = &mut edge {
            args.downstream = Some("http://127.0.0.1:3".into());
            args.per_try_timeout_ms = Some(250);
            args.eject_after_failures = 3;
            args.ejection_base_ms = 1000;
            args.ejection_max_ms = 9000;
            args.max_ejection_percent = 50;
            args.failure_percentage_threshold = 60;
            args.failure_percentage_minimum_hosts = 2;
            args.failure_percentage_request_volume = 20;
            args.ejection_interval_ms = 3000;
            args.jwks = Some("/tmp/jwks.json".into());
            args.jwt_issuer = Some("https://issuer.example".into());
            args.jwt_audience = Some("retrychain".into());
            args.callers = Some(CallersArg::Anyone);
            args.caller_max_in_flight = 17;
            args.door_wait_share = 0.25;
            args.tls_downstream_identity = Some("spiffe://retrychain/hop2".into());
        }
        let back = ServiceCli::try_parse_from(edge.to_args())
            .expect("reads back")
            .command;
        assert_eq!(format!("{back:?}"), format!("{edge:?}"));
    }

    /// Every flag of every role is a field `to_args` writes: a flag whose field serde
    /// skipped or renamed would silently fall off the command lines of child processes.
    #[test]
    fn every_flag_is_written_for_a_child() {
        for role in ["edge", "relay", "ledger"] {
            let command = ServiceCommand::defaults(role, "postgres://x@h/db").expect("parses");
            let fields = match &command {
                ServiceCommand::Edge(hop) | ServiceCommand::Relay(hop) => serde_json::to_value(hop),
                ServiceCommand::Ledger(ledger) => serde_json::to_value(ledger),
            }
            .expect("serializes");
            let cli = ServiceCli::command();
            let arguments = cli.find_subcommand(role).expect("a role").get_arguments();
            for arg in arguments {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "database_url") {
                    continue;
                }
                assert!(
                    fields.get(id).is_some(),
                    "{role}: --{} is not written for a child",
                    arg.get_long().unwrap_or(id)
                );
            }
        }
    }

    /// The edge's wait at the door: a share of a call's time from 0 to what the headroom
    /// leaves; anything else is refused with the range, and only the edge's admission
    /// lets calls wait.
    #[test]
    fn a_door_wait_share_is_a_share_the_headroom_leaves_and_only_the_edge_s() {
        for bad in ["0.6", "-0.1", "half", "NaN"] {
            let flag = format!("--door-wait-share={bad}");
            let error = ServiceCli::try_parse_from(["edge", flag.as_str()])
                .expect_err("refused")
                .to_string();
            assert!(
                (error.contains("--door-wait-share") && error.contains("from 0 to 0.5"))
                    || error.contains("not a number"),
                "{bad}: {error}"
            );
        }
        let edge = ServiceCli::try_parse_from(["edge", "--door-wait-share", "0.5"])
            .expect("the most it may be")
            .command;
        let ServiceCommand::Edge(args) = &edge else {
            unreachable!("an edge")
        };
        let door = args
            .service
            .admission(Some(args.door_wait_share))
            .expect("valid");
        assert_eq!((door.wait_share, door.door), (0.5, true));
        let relay = args.service.admission(None).expect("valid");
        assert_eq!((relay.wait_share, relay.door), (0.0, false));
    }
}
