//! docker-compose.yml: valid, and wired as docs/docker-compose.md says, checked with
//! `docker-compose config` (no engine needed). `scripts/compose-test` runs the core profile
//! for real; the observability profile's images cannot be had here, so it is checked only.

use std::process::Command;

/// `docker-compose config` with `env` (and a database password unless `env` names one).
fn config(env: &[(&str, &str)]) -> String {
    let output = run_config(env);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn run_config(env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new("docker-compose");
    command.args([
        "-f",
        concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"),
        "config",
    ]);
    command.env("POSTGRES_PASSWORD", "test-password");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().expect(
        "docker-compose is needed to validate the compose file (apt-get install docker-compose)",
    )
}

/// The lines of `service`'s section in resolved compose output (up to the next key at the
/// same indentation).
fn section(resolved: &str, service: &str) -> String {
    let header = format!("  {service}:");
    let mut lines = resolved.lines().skip_while(|l| *l != header);
    assert!(lines.next().is_some(), "{service} missing");
    lines
        // Blank lines occur inside a multi-line string (an entrypoint script).
        .take_while(|l| l.is_empty() || l.starts_with("   ") || l.starts_with("  -"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Only the edge faces the network: the other services' ports are published on the host's
/// loopback only, Postgres not at all, and the database password has no default.
#[test]
fn only_the_edge_is_published_beyond_loopback() {
    let resolved = config(&[]);
    for line in resolved.lines().map(str::trim) {
        let Some(mapping) = line.strip_prefix("- ") else {
            continue;
        };
        let published = mapping.split('/').next().unwrap_or_default();
        let parts: Vec<&str> = published.split(':').collect();
        if parts.len() == 2 && parts.iter().all(|p| p.parse::<u16>().is_ok()) {
            assert_eq!(
                parts[0], "50051",
                "only the edge's port is published on every interface: {line}"
            );
        }
    }
    assert!(
        !section(&resolved, "postgres").contains("ports:"),
        "Postgres is not published:\n{}",
        section(&resolved, "postgres")
    );
    for port in [50052, 50053, 50054, 50055] {
        assert!(
            resolved.contains(&format!("127.0.0.1:{port}:{port}")),
            "{port} on loopback"
        );
    }
    // No password given: the file is still valid, and none is written in it — the
    // `secrets` service draws one per deployment, which Postgres and the ledger read.
    let without = config(&[("POSTGRES_PASSWORD", "")]);
    assert!(
        section(&without, "secrets").contains("/dev/urandom"),
        "{}",
        section(&without, "secrets")
    );
    for service in ["postgres", "ledger"] {
        let section = section(&without, service);
        assert!(
            section.contains("POSTGRES_PASSWORD:-$$(cat /secrets/pgpassword)"),
            "{service} reads the drawn password:\n{section}"
        );
        assert!(section.contains("POSTGRES_PASSWORD: ''"), "{section}");
    }
    assert!(
        !without.contains("test-password"),
        "no password in the resolved file"
    );
}

#[test]
fn compose_file_is_valid_and_wires_the_chain() {
    let resolved = config(&[]);
    for (service, port) in [
        ("edge", 50051),
        ("hop2", 50052),
        ("hop3", 50053),
        ("hop4", 50054),
        ("ledger", 50055),
    ] {
        assert!(
            resolved.contains(&format!("  {service}:")),
            "{service} missing"
        );
        assert!(
            resolved.contains(&format!("published: {port}"))
                || resolved.contains(&format!("{port}:{port}")),
            "{service} port {port}"
        );
        assert!(
            section(&resolved, service).contains(&format!("https://127.0.0.1:{port}")),
            "{service} health check, over TLS"
        );
        let admin = port + 1000;
        assert!(
            resolved.contains(&format!("RETRYCHAIN_ADMIN_LISTEN: 0.0.0.0:{admin}")),
            "{service} admin listener"
        );
        assert!(
            resolved.contains(&format!("127.0.0.1:{admin}:{admin}"))
                || resolved.contains(&format!("host_ip: 127.0.0.1\n        mode: ingress\n        protocol: tcp\n        published: {admin}")),
            "{service} admin port published on loopback only:\n{resolved}"
        );
    }
    for downstream in [
        "dns:///hop2:50052",
        "dns:///hop3:50053",
        "dns:///hop4:50054",
        "dns:///ledger:50055",
    ] {
        assert!(resolved.contains(downstream), "{downstream}");
    }
    assert!(resolved.contains("condition: service_healthy"));
    assert!(resolved.contains("RETRYCHAIN_RETRY_MODE: edge-only"));
    let override_on = resolved
        .matches("RETRYCHAIN_ALLOW_RETRY_MODE_OVERRIDE: 'true'")
        .count()
        + resolved
            .matches("RETRYCHAIN_ALLOW_RETRY_MODE_OVERRIDE: \"true\"")
            .count();
    assert_eq!(override_on, 5, "the override is a demo setting on all five");
}

/// TLS by default: every service reads its own certificate from a volume of its own that
/// no other service mounts (so no tier can present another's identity), the certificates
/// come from the one-shot `certs` service, the ledger checks Postgres's certificate and
/// name, Postgres refuses TCP without TLS, and the edge checks callers' tokens.
#[test]
fn every_service_has_tls_from_a_volume_of_its_own() {
    let resolved = config(&[]);
    let mut mounted_by: std::collections::HashMap<String, Vec<String>> = Default::default();
    for service in [
        "certs", "postgres", "edge", "hop2", "hop3", "hop4", "ledger",
    ] {
        let section = section(&resolved, service);
        for line in section.lines().map(str::trim) {
            // `- tls-edge:/etc/…:ro` (docker-compose 1.x), or `source: tls-edge` in the
            // long form `docker compose` (v2) prints.
            let volume = match line.strip_prefix("- ") {
                Some(mount) => mount.split(':').next(),
                None => line.strip_prefix("source: "),
            };
            if let Some(volume) = volume.filter(|v| v.starts_with("tls-")) {
                mounted_by
                    .entry(volume.to_owned())
                    .or_default()
                    .push(service.to_owned());
            }
        }
    }
    for (service, volume) in [
        ("edge", "tls-edge"),
        ("hop2", "tls-hop2"),
        ("hop3", "tls-hop3"),
        ("hop4", "tls-hop4"),
        ("ledger", "tls-ledger"),
    ] {
        let section = section(&resolved, service);
        assert!(
            section.contains("RETRYCHAIN_TLS_DIR: /etc/retrychain/tls"),
            "{service}:\n{section}"
        );
        let short = section.contains(&format!("{volume}:/etc/retrychain/tls:ro"));
        let long = section.contains(&format!("source: {volume}"))
            && section.contains("target: /etc/retrychain/tls")
            && section.contains("read_only: true");
        assert!(
            short || long,
            "{service} mounts {volume} read-only:\n{section}"
        );
        assert_eq!(
            mounted_by.get(volume).map(Vec::as_slice),
            Some(&["certs".to_owned(), service.to_owned()][..]),
            "{volume} is {service}'s alone (and the certs service's, which writes it)"
        );
    }
    for volume in ["tls-ca", "tls-callers"] {
        assert_eq!(
            mounted_by.get(volume).map(Vec::as_slice),
            Some(&["certs".to_owned()][..]),
            "{volume}: the signing keys stay with the certs service"
        );
    }
    let certs = section(&resolved, "certs");
    assert!(certs.contains("retrychain certs --dir /tls"), "{certs}");
    let ledger = section(&resolved, "ledger");
    assert!(
        ledger.contains("sslmode=verify-full&sslrootcert=/etc/retrychain/tls/ca.crt"),
        "{ledger}"
    );
    let postgres = section(&resolved, "postgres");
    for setting in [
        "hostssl all all all scram-sha-256",
        "-c ssl=on",
        "hba_file=",
    ] {
        assert!(
            postgres.contains(setting),
            "Postgres: {setting}:\n{postgres}"
        );
    }
    assert!(
        !postgres.contains("host all"),
        "no plaintext TCP entry:\n{postgres}"
    );
    assert!(
        section(&resolved, "edge").contains("RETRYCHAIN_JWKS: /etc/retrychain/tls/jwks.json"),
        "the edge checks callers' tokens"
    );
}

/// A tier can be scaled: with its *_PORT variables empty, its replicas publish on free
/// loopback ports instead of clashing on one, and the tier above finds them all by name.
#[test]
fn a_scaled_tier_publishes_on_free_loopback_ports() {
    let resolved = config(&[
        ("HOP3_PORT", ""),
        ("HOP3_ADMIN_PORT", ""),
        ("LEDGER_PORT", ""),
        ("LEDGER_ADMIN_PORT", ""),
    ]);
    for port in [50053, 51053, 50055, 51055] {
        assert!(
            resolved.contains(&format!("127.0.0.1::{port}")),
            "{port} on a free loopback port:\n{resolved}"
        );
    }
    for port in [50052, 51052, 50054, 51054] {
        assert!(
            resolved.contains(&format!("127.0.0.1:{port}:{port}")),
            "{port} fixed"
        );
    }
    assert!(section(&resolved, "hop2").contains("RETRYCHAIN_DOWNSTREAM: dns:///hop3:50053"));
}

#[test]
fn the_retry_mode_comes_from_the_shell() {
    let resolved = config(&[("RETRY_MODE", "every-layer")]);
    assert_eq!(
        resolved
            .matches("RETRYCHAIN_RETRY_MODE: every-layer")
            .count(),
        5,
        "{resolved}"
    );
}

#[test]
fn the_observability_profile_is_valid_and_scrapes_the_five_admin_ports() {
    let output = Command::new("docker-compose")
        .args(["--profile", "observability", "config"])
        .env("POSTGRES_PASSWORD", "test-password")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("docker-compose is installed");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let resolved = String::from_utf8(output.stdout).unwrap();
    for service in ["jaeger:", "prometheus:", "grafana:"] {
        assert!(resolved.contains(service), "{service} in the profile");
    }
    assert!(resolved.contains("COLLECTOR_OTLP_ENABLED"));
    let prometheus = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/prometheus/prometheus.yml"
    ))
    .unwrap();
    for (name, port) in [
        ("edge", 51051),
        ("hop2", 51052),
        ("hop3", 51053),
        ("hop4", 51054),
        ("ledger", 51055),
    ] {
        assert!(
            prometheus.contains(&format!("names: [{name}], type: A, port: {port}")),
            "Prometheus finds every replica of {name} by DNS"
        );
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/grafana/dashboards/retrychain.json"
        ))
        .unwrap(),
    )
    .expect("the dashboard is JSON");
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 4));
}

/// The Dockerfile's dependency layer names every crate of the workspace: its manifest is
/// copied in and an empty source stands in for its code. CI builds the compose image from
/// the binary it has already built (`scripts/compose-test --binary`), so the Dockerfile's
/// build stage is not run there; what rots first in it — a crate added to the workspace
/// and not to this list, which breaks `docker compose build` with "failed to load
/// manifest" — is checked here instead, as is the runtime stage compose-test reuses.
#[test]
fn the_dockerfile_builds_every_crate_of_the_workspace() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dockerfile = std::fs::read_to_string(format!("{root}/Dockerfile")).unwrap();
    let manifest = std::fs::read_to_string(format!("{root}/Cargo.toml")).unwrap();
    let members: Vec<&str> = manifest
        .split("members = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("a members list")
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty() && *m != ".")
        .collect();
    assert!(members.len() >= 10, "members read: {members:?}");
    // Each loop that writes empty sources: the directory it writes under, and its names.
    let stubs: Vec<(String, Vec<&str>)> = dockerfile
        .lines()
        .filter_map(|l| {
            let l = l.trim_start_matches(" && ");
            let names = l
                .strip_prefix("RUN for crate in ")
                .or_else(|| l.strip_prefix("for example in "))?;
            let names = names.split(';').next().unwrap_or_default();
            let dir = if l.starts_with("RUN") {
                "services"
            } else {
                "examples"
            };
            Some((dir.to_owned(), names.split_whitespace().collect()))
        })
        .collect();
    assert_eq!(
        stubs.len(),
        2,
        "the loops that write the empty sources: {stubs:?}"
    );
    for member in &members {
        assert!(
            dockerfile.lines().any(|l| l.starts_with("COPY ")
                && l.contains(&format!(" {member}/Cargo.toml "))
                && l.ends_with(&format!(" {member}/"))),
            "the Dockerfile does not copy {member}/Cargo.toml into its dependency layer"
        );
        let (dir, name) = member.split_once('/').expect("members sit in a folder");
        assert!(
            stubs
                .iter()
                .any(|(d, names)| d == dir && names.contains(&name)),
            "the Dockerfile writes no empty source for {member}: {stubs:?}"
        );
    }
    // The root package's own source (services/cli) is stubbed as well.
    assert!(stubs[0].1.contains(&"cli"), "{stubs:?}");
    // The runtime stage compose-test takes word for word, with its one COPY of the binary.
    let runtime = dockerfile
        .split("\nFROM debian:bookworm-slim")
        .nth(1)
        .expect("a runtime stage FROM debian:bookworm-slim");
    assert!(
        runtime.contains("\nCOPY --from=build /retrychain /usr/local/bin/retrychain\n"),
        "{runtime}"
    );
}
