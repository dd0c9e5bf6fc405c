//! A throwaway highly-available Postgres: a pg_auto_failover formation (a monitor and two
//! nodes, synchronous replication) on local ports, from Debian's
//! `postgresql-15-auto-failover` (`pg_autoctl`), run as an unprivileged user when we are
//! root — for the failover tests and `retrychain up --postgres ha`.
//!
//! The monitor decides failovers from its health checks, and the timings are tuned here
//! for a fast failover ([`MONITOR_SETTINGS`], [`NETWORK_PARTITION_TIMEOUT`]): a check every
//! second and a node unhealthy after 2 s without answering (defaults 5 s and 20 s); a
//! primary cut off from both the monitor and its standby demotes itself after 4 s
//! (default 20 s: not shorter here, since a primary whose standby is down has only the
//! monitor to keep it up, and a loaded machine can stall that long), and the monitor
//! promotes the standby 6 s after it asked an unreachable primary to step down (default
//! 30 s). The order of the last two is what prevents two
//! primaries, whatever the scale. The price of the short scale on a real network: a slow
//! link or a long pause (a GC-like stall, a VM migration) fails over, or demotes a primary,
//! that would have come back — production keeps the defaults or tunes them to its network.
//!
//! Like [`TempCluster`](crate::TempCluster), the formation is removed with its files when
//! the value is dropped, and also if this process dies: a guardian shell waits for our end
//! of a pipe to close, then stops every `pg_autoctl` and server and removes the directory.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

mod process;

use process::{guardian, postmaster_of, shell_quoted, signal, signal_group};

use crate::{
    error::Error,
    host::{find_bindir, find_in_path, free_port, read_to_string, unprivileged_user},
};

/// How a node of the formation stands, as the monitor sees it (one object of `pg_autoctl
/// show state --json`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct NodeState {
    /// node1 or node2.
    #[serde(rename = "nodename")]
    pub name: String,
    /// Its port on 127.0.0.1.
    #[serde(rename = "nodeport")]
    pub port: u16,
    /// The state it reported (`primary`, `secondary`, `wait_primary`, `catchingup`, …).
    #[serde(rename = "current_group_state")]
    pub reported: String,
    /// The state the monitor assigned it.
    #[serde(rename = "assigned_group_state")]
    pub assigned: String,
}

/// A monitor and two Postgres nodes under pg_auto_failover; see the module docs.
#[derive(Debug)]
pub struct HaFormation {
    /// Holds every data directory, the configuration and the logs.
    dir: PathBuf,
    /// The unprivileged user everything runs as, when we are root.
    run_as: Option<(u32, u32)>,
    /// `PATH` for `pg_autoctl`: the server binaries first.
    path: String,
    /// The monitor's port.
    monitor_port: u16,
    /// The nodes' ports, node1 first.
    ports: [u16; 2],
    /// The `pg_autoctl run` of the monitor and of each node, while they run.
    keepers: Vec<(String, Option<Child>)>,
    /// With TLS: the authority's certificate, as the formation's copy (`sslrootcert`).
    tls_ca: Option<PathBuf>,
    /// Our end of the guardian's pipe; closing it starts the clean-up.
    guardian_pipe: Option<ChildStdin>,
    /// The guardian.
    guardian: Child,
}

/// The monitor's health checks and its wait for an unreachable primary to step down, for a
/// fast failover (milliseconds; see the module docs).
pub const MONITOR_SETTINGS: [(&str, &str); 6] = [
    ("pgautofailover.health_check_period", "1000"),
    ("pgautofailover.health_check_timeout", "1000"),
    ("pgautofailover.health_check_max_retries", "1"),
    ("pgautofailover.health_check_retry_delay", "500"),
    ("pgautofailover.node_considered_unhealthy_timeout", "2000"),
    // Longer than a cut-off primary takes to demote itself (NETWORK_PARTITION_TIMEOUT,
    // counted from when it lost contact, before the monitor even noticed): else, for a
    // moment, two primaries.
    ("pgautofailover.primary_demote_timeout", "6000"),
];

/// Seconds after which a node's keeper that reaches neither the monitor nor its standby
/// demotes its primary (`timeout.network_partition_timeout`; see the module docs).
pub const NETWORK_PARTITION_TIMEOUT: &str = "4";

const SUPERUSER: &str = "postgres";

/// pg_autoctl's TLS flags: the certificate, key and authority for every server it creates
/// and `verify-full` in the connection strings it writes; or none at all.
fn ssl_args(tls: Option<&crate::ServerTls>) -> Vec<String> {
    match tls {
        Some(tls) => vec![
            "--ssl-mode".into(),
            "verify-full".into(),
            "--ssl-ca-file".into(),
            tls.ca.display().to_string(),
            "--server-cert".into(),
            tls.cert.display().to_string(),
            "--server-key".into(),
            tls.key.display().to_string(),
        ],
        None => vec!["--no-ssl".into()],
    }
}

/// Makes every TCP line of `pgdata`'s pg_hba.conf `hostssl`: initdb's own lines are
/// `host` (pg_autoctl's are `hostssl` already), which would let a client in without TLS.
/// Done before the server starts (the monitor's is reloaded anyway when it is tuned).
fn tls_only_hba(pgdata: &Path) -> Result<(), Error> {
    let path = pgdata.join("pg_hba.conf");
    let hba = fs::read_to_string(&path)?;
    let rewritten: String = hba
        .lines()
        .map(|line| match line.strip_prefix("host") {
            Some(rest) if rest.starts_with([' ', '\t']) => format!("hostssl{rest}\n"),
            _ => format!("{line}\n"),
        })
        .collect();
    fs::write(&path, rewritten)?;
    Ok(())
}

/// `tls`'s files copied into `<dir>/tls/`, owned by the formation's user, the key readable
/// by it alone (as Postgres demands of a key): every server of the formation uses them.
fn copy_tls(
    tls: &crate::ServerTls,
    dir: &Path,
    run_as: Option<(u32, u32)>,
) -> Result<crate::ServerTls, Error> {
    use std::os::unix::fs::PermissionsExt;
    let into = dir.join("tls");
    fs::create_dir_all(&into)?;
    let copied = crate::ServerTls {
        cert: into.join("server.crt"),
        key: into.join("server.key"),
        ca: into.join("ca.crt"),
    };
    fs::copy(&tls.cert, &copied.cert)?;
    fs::copy(&tls.key, &copied.key)?;
    fs::copy(&tls.ca, &copied.ca)?;
    fs::set_permissions(&copied.key, fs::Permissions::from_mode(0o600))?;
    if let Some((uid, gid)) = run_as {
        for path in [&into, &copied.cert, &copied.key, &copied.ca] {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
        }
    }
    Ok(copied)
}

impl HaFormation {
    /// Creates and starts the formation: the monitor, then node1 (the first primary), then
    /// node2 (its synchronous standby); returns once node1 is `primary` and node2
    /// `secondary`.
    pub fn start() -> Result<Self, Error> {
        Self::start_with(None)
    }

    /// [`HaFormation::start`], over TLS with `tls` when given: every server of the
    /// formation (monitor and nodes) serves TLS with that certificate, pg_autoctl's own
    /// connections (node to monitor, standby to primary) check it with `sslmode=verify-full`
    /// against `tls.ca`, and so do [`HaFormation::uri`] and [`HaFormation::node_url`]. The
    /// certificate must name 127.0.0.1, where everything listens.
    pub fn start_with(tls: Option<&crate::ServerTls>) -> Result<Self, Error> {
        // pg_autoctl finds pg_controldata and the other tools beside pg_ctl: the real
        // directory, not a directory of symlinks to some of them.
        let pg_ctl = fs::canonicalize(find_bindir()?.join("pg_ctl"))?;
        let bindir = pg_ctl.parent().unwrap_or(Path::new("/"));
        let path = format!(
            "{}:{}",
            bindir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // Where the formation's commands run: Debian puts pg_autoctl beside pg_ctl.
        find_in_path(std::ffi::OsStr::new(&path), "pg_autoctl").ok_or(Error::NoAutoFailover)?;
        let run_as = unprivileged_user()?;
        let dir = tempfile::Builder::new()
            .prefix("retrychain-ha-")
            .tempdir()?
            .keep();
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let (guardian, guardian_pipe) = guardian(&dir, run_as, &path)?;
        let tls = tls.map(|tls| copy_tls(tls, &dir, run_as)).transpose()?;
        let mut formation = HaFormation {
            monitor_port: free_port()?,
            // Each node's port is picked just before the node is created, so that little
            // time passes in which another process could take it.
            ports: [0, 0],
            dir,
            run_as,
            path,
            keepers: Vec::new(),
            tls_ca: tls.as_ref().map(|tls| tls.ca.clone()),
            guardian_pipe: Some(guardian_pipe),
            guardian,
        };
        formation.create_monitor(tls.as_ref())?;
        for i in 0..2 {
            formation.create_node(i, tls.as_ref())?;
        }
        formation.wait_until(Duration::from_secs(120), |nodes| {
            nodes.iter().any(|n| n.reported == "primary")
                && nodes.iter().any(|n| n.reported == "secondary")
        })?;
        Ok(formation)
    }

    /// The URL the ledger uses: both nodes, libpq's multi-host form (what `pg_autoctl show
    /// uri` prints, with the superuser).
    pub fn uri(&self) -> String {
        format!(
            "postgres://{SUPERUSER}@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write{}",
            self.ports[0],
            self.ports[1],
            self.tls_params("&")
        )
    }

    /// The URL of node `i` alone (0 or 1), to look at one server.
    pub fn node_url(&self, i: usize) -> String {
        format!(
            "postgres://{SUPERUSER}@127.0.0.1:{}/postgres{}",
            self.ports[i],
            self.tls_params("?")
        )
    }

    /// With TLS, the URL parameters that check the server (after `lead`, `?` or `&`).
    fn tls_params(&self, lead: &str) -> String {
        match &self.tls_ca {
            Some(ca) => format!("{lead}sslmode=verify-full&sslrootcert={}", ca.display()),
            None => String::new(),
        }
    }

    /// The nodes' ports, node1 first.
    pub fn ports(&self) -> [u16; 2] {
        self.ports
    }

    /// The directory holding the formation (its logs: `monitor.log`, `node1.log`, …).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The nodes as the monitor sees them now.
    pub fn state(&self) -> Result<Vec<NodeState>, Error> {
        let output = self
            .pg_autoctl(&["show", "state", "--pgdata"])
            .arg(self.dir.join("monitor"))
            .arg("--json")
            .output()?;
        Ok(parse_state(&String::from_utf8_lossy(&output.stdout)))
    }

    /// The node (0 or 1) that is the primary — `primary`, or `wait_primary` (a primary
    /// whose standby is gone) — as it reports and as the monitor assigned, if one is: a
    /// dead primary still "reports" its last state, but the monitor has assigned it
    /// another.
    pub fn primary(&self) -> Result<Option<usize>, Error> {
        Ok(self
            .state()?
            .iter()
            .find(|n| {
                n.reported == n.assigned
                    && matches!(n.reported.as_str(), "primary" | "wait_primary")
            })
            .and_then(|n| self.ports.iter().position(|p| *p == n.port)))
    }

    /// Waits until `ready` holds for the nodes' states, or `timeout`.
    pub fn wait_until(
        &self,
        timeout: Duration,
        ready: impl Fn(&[NodeState]) -> bool,
    ) -> Result<Vec<NodeState>, Error> {
        let start = Instant::now();
        loop {
            let state = self.state()?;
            if ready(&state) {
                return Ok(state);
            }
            if start.elapsed() > timeout {
                return Err(Error::NotReady {
                    timeout,
                    log: format!(
                        "the formation did not reach the state waited for: {state:?}\n{}",
                        read_to_string(&self.dir.join("monitor.log"))
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills node `i` outright, as a host that dies: SIGKILL to its `pg_autoctl` keeper
    /// with the keeper's helpers (their process group), and to its Postgres server and
    /// every backend — no shutdown, no clean-up, nothing left to restart the server. The
    /// server is killed by its own pid as well: it may have been started before the
    /// keeper (by `pg_autoctl create`) and so sit outside the keeper's group.
    pub fn kill_node(&mut self, i: usize) -> Result<(), Error> {
        let name = format!("node{}", i + 1);
        let postmaster = postmaster_of(&self.dir.join(&name));
        if let Some(pid) = postmaster {
            // Stopped first, so that it starts no process while its children are killed;
            // they go first, while it is still their parent and they can be found by it.
            signal(pid, "STOP");
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &pid.to_string()])
                .status();
        }
        if let Some((_, slot)) = self.keepers.iter_mut().find(|(n, _)| *n == name)
            && let Some(mut keeper) = slot.take()
        {
            signal_group(keeper.id(), "KILL");
            let _ = keeper.wait();
            // Its group is gone: the guardian must not signal that id, which may be reused.
            let _ = fs::remove_file(self.dir.join(format!("{name}.pgid")));
        }
        if let Some(pid) = postmaster {
            signal(pid, "KILL");
        }
        Ok(())
    }

    /// Starts node `i` again (`pg_autoctl run`): it rejoins the formation, as a standby if
    /// the other node was promoted meanwhile.
    pub fn restart_node(&mut self, i: usize) -> Result<(), Error> {
        let name = format!("node{}", i + 1);
        let keeper = self.run(&name)?;
        match self.keepers.iter_mut().find(|(n, _)| *n == name) {
            Some((_, slot)) => *slot = Some(keeper),
            None => self.keepers.push((name, Some(keeper))),
        }
        Ok(())
    }

    /// The processes of node `i`'s Postgres server (0 or 1), postmaster first — to freeze
    /// it whole, as a stalled host would be; empty when it is not running.
    pub fn server_pids(&self, i: usize) -> Result<Vec<u32>, Error> {
        match postmaster_of(&self.dir.join(format!("node{}", i + 1))) {
            Some(pid) => crate::cluster::with_children(pid),
            None => Ok(Vec::new()),
        }
    }

    /// The monitor's last `count` events, oldest first, as `pg_autoctl show events`
    /// prints them: every state it assigned each node, the LSN the node reported, and
    /// why — the story of a failover, kept by a run that must explain one afterwards
    /// (the formation's directory goes with it).
    pub fn events(&self, count: usize) -> Result<String, Error> {
        let output = self
            .pg_autoctl(&["show", "events", "--count", &count.to_string(), "--pgdata"])
            .arg(self.dir.join("monitor"))
            .output()?;
        if !output.status.success() {
            return Err(Error::Io(std::io::Error::other(format!(
                "pg_autoctl show events: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ))));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// `pg_autoctl perform switchover`: the primary hands over to the standby, in order.
    pub fn switchover(&self) -> Result<(), Error> {
        self.perform("switchover")
    }

    /// `pg_autoctl perform failover`: the standby is promoted now.
    pub fn failover(&self) -> Result<(), Error> {
        self.perform("failover")
    }

    fn perform(&self, what: &'static str) -> Result<(), Error> {
        let output = self
            .pg_autoctl(&["perform", what, "--pgdata"])
            .arg(self.dir.join("monitor"))
            .output()?;
        if output.status.success() {
            Ok(())
        } else {
            Err(Error::PgCtl {
                action: what,
                output: String::from_utf8_lossy(&output.stderr).into(),
            })
        }
    }

    fn create_monitor(&mut self, tls: Option<&crate::ServerTls>) -> Result<(), Error> {
        let pgdata = self.dir.join("monitor");
        self.created(
            "monitor",
            self.pg_autoctl(&["create", "monitor", "--pgdata"])
                .arg(&pgdata)
                .args(["--pgport", &self.monitor_port.to_string()])
                .args(["--hostname", "127.0.0.1", "--auth", "trust"])
                .args(ssl_args(tls)),
        )?;
        if tls.is_some() {
            tls_only_hba(&pgdata)?;
        }
        // `create monitor` has no --listen, and its server would listen on every address
        // (listen_addresses '*', kept in pg_autoctl's own configuration, which `run` starts
        // Postgres with): nothing a playground starts may listen beyond the loopback.
        self.created(
            "monitor",
            self.pg_autoctl(&["config", "set", "--pgdata"])
                .arg(&pgdata)
                .args(["postgresql.listen_addresses", "127.0.0.1"]),
        )?;
        let keeper = self.run("monitor")?;
        self.keepers.push(("monitor".into(), Some(keeper)));
        // The monitor's server answers once `run` has started it; then tune its checks.
        let start = Instant::now();
        loop {
            let mut psql = self.psql(self.monitor_port, "pg_auto_failover");
            // One `-c` each: ALTER SYSTEM cannot run inside the transaction block that
            // one multi-statement string would be.
            for (setting, value) in MONITOR_SETTINGS {
                psql.args(["-c", &format!("ALTER SYSTEM SET {setting} TO {value}")]);
            }
            psql.args(["-c", "SELECT pg_reload_conf()"]);
            if psql.output()?.status.success() {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(Error::NotReady {
                    timeout: Duration::from_secs(60),
                    log: read_to_string(&self.dir.join("monitor.log")),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn create_node(&mut self, i: usize, tls: Option<&crate::ServerTls>) -> Result<(), Error> {
        let name = format!("node{}", i + 1);
        self.ports[i] = free_port()?;
        let monitor = format!(
            "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?{}",
            self.monitor_port,
            match tls {
                Some(tls) => format!("sslmode=verify-full&sslrootcert={}", tls.ca.display()),
                None => "sslmode=disable".to_owned(),
            }
        );
        self.created(
            &name,
            self.pg_autoctl(&["create", "postgres", "--pgdata"])
                .arg(self.dir.join(&name))
                .args(["--pgport", &self.ports[i].to_string()])
                .args(["--hostname", "127.0.0.1", "--listen", "127.0.0.1"])
                .args(["--auth", "trust"])
                .args(ssl_args(tls))
                .args(["--name", &name, "--monitor", &monitor])
                .args(["--pg-hba-lan", "--dbname", "postgres"]),
        )?;
        if tls.is_some() {
            // node2's copy of node1's data directory already has it; done again anyway.
            tls_only_hba(&self.dir.join(&name))?;
        }
        self.created(
            &name,
            self.pg_autoctl(&["config", "set", "--pgdata"])
                .arg(self.dir.join(&name))
                .args([
                    "timeout.network_partition_timeout",
                    NETWORK_PARTITION_TIMEOUT,
                ]),
        )?;
        let keeper = self.run(&name)?;
        self.keepers.push((name, Some(keeper)));
        Ok(())
    }

    /// Runs a `pg_autoctl create …` (or `config set …`) to completion, its output in
    /// `<name>.log`.
    fn created(&self, name: &str, command: &mut Command) -> Result<(), Error> {
        let log = self.log(name)?;
        let status = command
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .map_err(|source| Error::Spawn {
                program: "pg_autoctl".into(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Initdb(format!(
                "pg_autoctl for {name} failed: {}",
                read_to_string(&self.dir.join(format!("{name}.log")))
            )))
        }
    }

    /// `pg_autoctl run` for `name`, in the background and in a process group of its own
    /// (the keeper, its helpers and the server it starts: one group to kill, its id in
    /// `<name>.pgid` for the guardian), its output appended to its log.
    fn run(&self, name: &str) -> Result<Child, Error> {
        let log = self.log(name)?;
        let keeper = self
            .pg_autoctl(&["run", "--pgdata"])
            .arg(self.dir.join(name))
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .map_err(|source| Error::Spawn {
                program: "pg_autoctl".into(),
                source,
            })?;
        fs::write(
            self.dir.join(format!("{name}.pgid")),
            keeper.id().to_string(),
        )?;
        Ok(keeper)
    }

    fn log(&self, name: &str) -> Result<fs::File, Error> {
        let path = self.dir.join(format!("{name}.log"));
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
        }
        Ok(file)
    }

    /// `pg_autoctl <args>` as the formation's user, its configuration kept in the
    /// formation's directory (XDG paths), not in the user's home.
    fn pg_autoctl(&self, args: &[&str]) -> Command {
        let mut command = self.as_user("pg_autoctl");
        command.args(args);
        command
    }

    fn psql(&self, port: u16, database: &str) -> Command {
        let mut command = self.as_user("psql");
        command.args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            SUPERUSER,
            "-d",
            database,
            "-Atq",
        ]);
        command
    }

    fn as_user(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command
            .current_dir(&self.dir)
            .env("PATH", &self.path)
            .envs(self.config_env())
            .stdin(Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            command.uid(uid).gid(gid);
        }
        command
    }

    /// Where `pg_autoctl` keeps its configuration and state: in the formation's
    /// directory, removed with it, not in the user's home.
    fn config_env(&self) -> [(&'static str, String); 4] {
        let under = |name: &str| self.dir.join(name).display().to_string();
        [
            ("HOME", self.dir.display().to_string()),
            ("XDG_CONFIG_HOME", under("config")),
            ("XDG_DATA_HOME", under("share")),
            ("XDG_RUNTIME_DIR", under("run")),
        ]
    }

    /// A shell command that runs `pg_autoctl <args> --pgdata <the monitor>` as the
    /// formation runs it — its user, its configuration — for a person at a terminal to
    /// watch the formation (`show state --watch`) or fail it over (`perform failover`).
    pub fn command_line(&self, args: &[&str]) -> String {
        let mut words: Vec<String> = Vec::new();
        if let Some((uid, gid)) = self.run_as {
            words.extend([
                "setpriv".into(),
                format!("--reuid={uid}"),
                format!("--regid={gid}"),
                "--clear-groups".into(),
            ]);
        }
        words.push("env".into());
        for (name, value) in self.config_env() {
            words.push(format!("{name}={}", shell_quoted(&value)));
        }
        words.push("pg_autoctl".into());
        words.extend(args.iter().map(|arg| shell_quoted(arg)));
        words.push("--pgdata".into());
        words.push(shell_quoted(
            &self.dir.join("monitor").display().to_string(),
        ));
        words.join(" ")
    }
}

impl Drop for HaFormation {
    fn drop(&mut self) {
        // Closing the pipe starts the guardian's clean-up; then reap what it killed.
        drop(self.guardian_pipe.take());
        let _ = self.guardian.wait();
        for (_, keeper) in &mut self.keepers {
            if let Some(mut keeper) = keeper.take() {
                let _ = keeper.kill();
                let _ = keeper.wait();
            }
        }
    }
}

/// The nodes of `pg_autoctl show state --json`; empty when the monitor did not answer
/// (the caller waits and asks again).
fn parse_state(json: &str) -> Vec<NodeState> {
    serde_json::from_str(json).unwrap_or_default()
}

#[cfg(test)]
mod tests;
