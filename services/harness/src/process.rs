//! A retrychain service as a child process: for `up`, and for the tests where a crash, a
//! signal or a restart is the point.

use std::{
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use tokio::{
    process::{Child, Command},
    sync::oneshot,
};

use retrychain_node::ReadyAddrs;

use crate::addr::ServiceAddr;

/// Where a child's log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logs {
    /// To our stdout, each line prefixed by the service's name.
    Prefixed,
    /// The service's standard output to ours as it is (its lines name their service
    /// themselves: JSON logs, one object per line, for `jq`); everything else — its
    /// standard error, what the harness says — to our standard error, prefixed.
    Raw,
    /// Kept, for [`ChildService::log`], and printed on our stderr when the service is
    /// dropped while its thread panics, or with `TEST_LOG` set (a failing test shows what
    /// its services said).
    Capture,
    /// Nowhere.
    Discard,
    /// The service's standard output into a pipe nobody reads until the caller takes it
    /// ([`ChildService::take_stdout`]): a log collector that stopped. Its standard error
    /// nowhere.
    Unread,
}

/// How to start a child: its program, command line, environment and log routing; kept to
/// start it again the same way.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The `retrychain` binary; `None`: this process's own executable.
    pub program: Option<PathBuf>,
    /// `retrychain` arguments; `--listen` among them.
    pub args: Vec<String>,
    /// Extra environment.
    pub env: Vec<(String, String)>,
    /// Where its logs go.
    pub logs: Logs,
}

/// A retrychain service running as our child. Dropping it kills the process.
#[derive(Debug)]
pub struct ChildService {
    /// Its name.
    pub name: String,
    /// Its addresses.
    pub addr: ServiceAddr,
    /// The process, while it runs.
    child: Option<Child>,
    /// How it was started.
    launch: Launch,
    /// What it logged, with [`Logs::Capture`] (across restarts).
    log: Arc<Mutex<String>>,
    /// Its standard output, unread, with [`Logs::Unread`], until taken.
    stdout: Option<std::fs::File>,
}

impl ChildService {
    /// Starts `retrychain <args>` as `launch` says and waits for its ready line on stderr,
    /// which names both addresses (so port 0 works).
    pub async fn start(name: &str, launch: Launch) -> anyhow::Result<Self> {
        let log = Arc::default();
        let (child, addr, stdout) = spawn(name, &launch, &log).await?;
        Ok(Self {
            name: name.to_owned(),
            addr,
            child: Some(child),
            launch,
            log,
            stdout,
        })
    }

    /// Its standard output, never read so far ([`Logs::Unread`]; `None` otherwise, or once
    /// taken). Dropping it closes the pipe: the service's next write fails.
    pub fn take_stdout(&mut self) -> Option<std::fs::File> {
        self.stdout.take()
    }

    /// The public address, `http://host:port`.
    pub fn url(&self) -> &str {
        &self.addr.url
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Everything it logged so far ([`Logs::Capture`]; empty otherwise).
    pub fn log(&self) -> String {
        self.log.lock().map(|log| log.clone()).unwrap_or_default()
    }

    /// Starts the service again, the same way and on the same ports; a process still
    /// running is killed first (SIGKILL, as [`ChildService::crash`]).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.crash().await;
        let mut launch = self.launch.clone();
        for (flag, value) in [
            ("--listen", self.addr.host_port()),
            ("--admin-listen", self.addr.admin_host_port()),
        ] {
            match launch.args.iter().position(|a| a == flag) {
                Some(i) if i + 1 < launch.args.len() => launch.args[i + 1] = value.to_owned(),
                _ => launch.args.extend([flag.to_owned(), value.to_owned()]),
            }
        }
        let (child, mut addr, stdout) = spawn(&self.name, &launch, &self.log).await?;
        if self.addr.url.starts_with("https://") {
            // A service over TLS stays reached by https:// (its ready line names only
            // addresses).
            addr.url = addr.url.replacen("http://", "https://", 1);
            addr.admin_url = addr.admin_url.replacen("http://", "https://", 1);
        }
        self.child = Some(child);
        self.addr = addr;
        self.stdout = stdout;
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, `KILL`, …) to the process.
    pub async fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid().context("the service is not running")?;
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .await
            .context("running kill")?;
        anyhow::ensure!(status.success(), "kill -{signal} {pid}: {status}");
        Ok(())
    }

    /// SIGKILL: no shutdown, no clean-up — a crash. Waits until the process is gone.
    pub async fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`; its exit status.
    pub async fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let _ = self.signal("TERM").await;
        let mut child = self.child.take()?;
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                eprintln!("{} did not stop on SIGTERM; killing it", self.name);
                let _ = child.kill().await;
                None
            }
        }
    }

    /// Completes when the process exits: its exit status, as text; at once, "not running",
    /// when there is no process (it was crashed, stopped, or did not restart).
    pub async fn exited(&mut self) -> String {
        match &mut self.child {
            Some(child) => match child.wait().await {
                Ok(status) => status.to_string(),
                Err(error) => error.to_string(),
            },
            None => "not running".to_owned(),
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within ten seconds.
    pub async fn stop(mut self) {
        self.terminate(Duration::from_secs(10)).await;
    }
}

impl Drop for ChildService {
    fn drop(&mut self) {
        // The child was spawned with kill_on_drop: dropping it kills the process.
        if self.launch.logs == Logs::Capture
            && (std::thread::panicking() || std::env::var_os("TEST_LOG").is_some())
        {
            eprintln!("----- {} log -----\n{}", self.name, self.log());
        }
    }
}

async fn spawn(
    name: &str,
    launch: &Launch,
    log: &Arc<Mutex<String>>,
) -> anyhow::Result<(Child, ServiceAddr, Option<std::fs::File>)> {
    let program = match &launch.program {
        Some(program) => program.clone(),
        None => std::env::current_exe().context("locating this binary")?,
    };
    let mut command = Command::new(program);
    command
        .args(&launch.args)
        .env("RETRYCHAIN_LOG_FORMAT", "text")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (key, value) in &launch.env {
        command.env(key, value);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let (tx, rx) = oneshot::channel();
    let follow = |listening: Option<_>| Follow {
        name: name.to_owned(),
        logs: launch.logs,
        log: Arc::clone(log),
        // The ready line comes on standard error, which is followed with a sender.
        standard_error: listening.is_some(),
        listening,
    };
    // Each stream is read on a thread of its own, not a task: a child must never stall on
    // a full pipe because the runtime that would read it is busy or blocked (a test
    // waiting on grpcurl, say).
    let mut unread = None;
    if let Some(out) = child.stdout.take() {
        let out = std::fs::File::from(out.into_owned_fd()?);
        if launch.logs == Logs::Unread {
            unread = Some(out);
        } else {
            let follow = follow(None);
            std::thread::spawn(move || follow.run(out));
        }
    }
    if let Some(err) = child.stderr.take() {
        let err = std::fs::File::from(err.into_owned_fd()?);
        let follow = follow(Some(tx));
        std::thread::spawn(move || follow.run(err));
    }
    let ready = match tokio::time::timeout(Duration::from_secs(60), rx).await {
        Ok(Ok(ready)) => ready,
        failed => {
            let _ = child.kill().await;
            let why = match failed {
                Err(_) => "did not start listening within 60 s",
                _ => "exited before listening",
            };
            let said = log.lock().map(|l| l.clone()).unwrap_or_default();
            anyhow::bail!(
                "{name} {why}{}",
                if said.is_empty() {
                    String::new()
                } else {
                    format!("; it said:\n{said}")
                }
            );
        }
    };
    announce(
        launch.logs,
        name,
        &format!(
            "started, pid {}, on {} (admin {})",
            child.id().unwrap_or_default(),
            ready.public,
            ready.admin
        ),
    );
    Ok((child, ServiceAddr::from(&ready), unread))
}

/// Reads one of a child's output streams line by line: hands the ready line to whoever
/// waits for it, and routes the rest.
struct Follow {
    name: String,
    logs: Logs,
    log: Arc<Mutex<String>>,
    /// Whether this is the child's standard error (else its standard output).
    standard_error: bool,
    listening: Option<oneshot::Sender<ReadyAddrs>>,
}

impl Follow {
    fn run(mut self, stream: impl Read) {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if let Some(ready) = ReadyAddrs::parse(&line)
                && let Some(tx) = self.listening.take()
            {
                let _ = tx.send(ready);
                continue;
            }
            match self.logs {
                Logs::Prefixed => say(&self.name, &line),
                Logs::Raw if self.standard_error => complain(&self.name, &line),
                Logs::Raw => {
                    use std::io::Write;
                    let _ = writeln!(std::io::stdout().lock(), "{line}");
                }
                Logs::Capture => {
                    if let Ok(mut log) = self.log.lock() {
                        log.push_str(&line);
                        log.push('\n');
                    }
                }
                Logs::Discard | Logs::Unread => {}
            }
        }
    }
}

/// One line on stdout, prefixed by who says it. A closed stdout (`up | head`) is not
/// worth a panic in a log-forwarding task: the line is dropped.
pub(crate) fn say(who: &str, line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{who:>6} | {line}");
}

/// One line on stderr, prefixed by who says it (dropped if stderr is closed).
fn complain(who: &str, line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{who:>6} | {line}");
}

/// What the harness itself says about a chain with `logs`: beside the services' lines
/// when they are prefixed, on stderr when stdout is theirs alone, nowhere otherwise.
pub(crate) fn announce(logs: Logs, who: &str, line: &str) {
    match logs {
        Logs::Prefixed => say(who, line),
        Logs::Raw => complain(who, line),
        Logs::Capture | Logs::Discard | Logs::Unread => {}
    }
}
