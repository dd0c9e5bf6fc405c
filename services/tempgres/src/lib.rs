//! A throwaway PostgreSQL cluster, started from the `initdb` and `postgres` binaries on PATH,
//! for the end-to-end tests and for `retrychain up` when no `DATABASE_URL` is given.
//!
//! Postgres refuses to run as root, and CI runs as root; so when this process is root the
//! cluster's files are handed to an unprivileged user (`postgres` if it exists, else
//! `nobody`) and both binaries run as that user.
//!
//! Clean-up does not depend on destructors running. Beside the server runs a small guardian
//! shell that waits on a pipe from this process; when the pipe closes — on
//! [`TempCluster::stop`], on drop, or because this process died — the guardian shuts the
//! server down and removes its directory. A test binary that keeps one cluster in a static
//! therefore leaves nothing behind.

use std::{
    fs,
    io::Read,
    net::TcpListener,
    os::unix::{fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

/// Why the cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A binary was missing or could not be run.
    #[error(
        "could not run {program}: {source} (the PostgreSQL server binaries initdb and postgres must be on PATH; on Debian: apt-get install postgresql)"
    )]
    Spawn {
        /// The binary.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// initdb ran and failed.
    #[error("initdb failed: {0}")]
    Initdb(String),
    /// The server did not become ready.
    #[error("postgres did not start within {timeout:?}; its log says:\n{log}")]
    NotReady {
        /// How long we waited.
        timeout: Duration,
        /// The server's log.
        log: String,
    },
    /// Preparing the directory failed.
    #[error("preparing the cluster directory: {0}")]
    Io(#[from] std::io::Error),
}

/// Settings for a throwaway cluster.
#[derive(Debug, Clone)]
pub struct Options {
    /// Whether the server syncs to disk; off makes tests faster and loses nothing that
    /// matters for a throwaway cluster, on keeps benchmark figures honest.
    pub fsync: bool,
    /// The server's `max_connections`.
    pub max_connections: u32,
    /// TCP port on 127.0.0.1; `None` picks a free one.
    pub port: Option<u16>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            fsync: false,
            max_connections: 400,
            port: None,
        }
    }
}

/// A running throwaway cluster; see the crate docs for how it is cleaned up.
#[derive(Debug)]
pub struct TempCluster {
    /// Holds data, socket and log; removed by the guardian.
    dir: PathBuf,
    /// Where the server listens on 127.0.0.1.
    port: u16,
    /// The guardian shell: parent of the server, which it stops before removing `dir`.
    guardian: Child,
    /// Our end of the guardian's pipe; closing it starts the clean-up.
    guardian_pipe: Option<ChildStdin>,
}

const SUPERUSER: &str = "postgres";

impl TempCluster {
    /// Starts a cluster with default options.
    pub fn start() -> Result<Self, Error> {
        Self::start_with(&Options::default())
    }

    /// Starts a cluster: initdb into a new temporary directory, then the server.
    pub fn start_with(options: &Options) -> Result<Self, Error> {
        let run_as = unprivileged_user()?;
        let dir = tempfile::Builder::new()
            .prefix("retrychain-pg-")
            .tempdir()?
            .keep();
        let data = dir.join("data");
        let socket = dir.join("socket");
        fs::create_dir(&data)?;
        fs::create_dir(&socket)?;
        if let Some((uid, gid)) = run_as {
            for path in [&dir, &data, &socket] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
            }
        }

        let mut initdb = command("initdb", run_as, &dir);
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C"])
            .arg("--no-sync");
        let output = initdb.output().map_err(|source| Error::Spawn {
            program: "initdb".into(),
            source,
        })?;
        if !output.status.success() {
            let _ = fs::remove_dir_all(&dir);
            return Err(Error::Initdb(
                String::from_utf8_lossy(&output.stderr).into(),
            ));
        }

        let port = match options.port {
            Some(port) => port,
            None => free_port()?,
        };
        let log_path = dir.join("postgres.log");
        let log = fs::File::create(&log_path)?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&log_path, Some(uid), Some(gid))?;
        }
        let mut guardian = command("sh", run_as, &dir);
        guardian
            .arg("-c")
            .arg(GUARDIAN)
            .arg("guardian")
            .arg(&dir)
            .arg("postgres")
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(&socket)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args([
                "-c",
                &format!("max_connections={}", options.max_connections),
            ])
            .args([
                "-c",
                &format!("fsync={}", if options.fsync { "on" } else { "off" }),
            ])
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut guardian = guardian.spawn().map_err(|source| Error::Spawn {
            program: "sh".into(),
            source,
        })?;
        let guardian_pipe = guardian.stdin.take();
        let mut cluster = TempCluster {
            dir,
            port,
            guardian,
            guardian_pipe,
        };
        cluster.wait_ready(Duration::from_secs(60))?;
        tracing::info!(port, dir = %cluster.dir.display(), "throwaway postgres ready");
        Ok(cluster)
    }

    /// The URL of database `database` as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the cluster.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the server and removes its files, waiting until both are done.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // Closing the pipe is the one signal the guardian acts on.
        drop(self.guardian_pipe.take());
        let _ = self.guardian.wait();
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let start = Instant::now();
        let log_path = self.dir.join("postgres.log");
        loop {
            let log = read_to_string(&log_path);
            if log.contains("ready to accept connections") {
                return Ok(());
            }
            let failed = log.contains("FATAL") || matches!(self.guardian.try_wait(), Ok(Some(_)));
            if failed || start.elapsed() > timeout {
                self.shutdown();
                return Err(Error::NotReady { timeout, log });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        if self.guardian_pipe.is_some() {
            self.shutdown();
        }
    }
}

/// Starts the server (the arguments after the directory) as its child, waits for its own
/// stdin to close, then fast-shuts the server down (SIGINT), waits for it, and removes the
/// directory. Ignores Ctrl-C so that a terminal's SIGINT to the whole process group does not
/// skip the clean-up (the server handles that SIGINT itself).
const GUARDIAN: &str = r#"
trap '' INT
dir="$1"; shift
"$@" &
pid=$!
cat >/dev/null
kill -INT "$pid" 2>/dev/null
wait "$pid"
rm -rf "$dir"
"#;

fn command(program: &str, run_as: Option<(u32, u32)>, dir: &Path) -> Command {
    let mut command = Command::new(program);
    command.current_dir(dir);
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid).env("HOME", dir);
    }
    command
}

/// `None` when this process may run Postgres itself; the uid and gid to run it as when we
/// are root.
fn unprivileged_user() -> Result<Option<(u32, u32)>, Error> {
    if fs::metadata("/proc/self")?.uid() != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd")?;
    for wanted in ["postgres", "nobody"] {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() > 3
                && fields[0] == wanted
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Ok(Some((uid, gid)));
            }
        }
    }
    Err(Error::Io(std::io::Error::other(
        "running as root and neither a postgres nor a nobody user exists to run PostgreSQL as",
    )))
}

fn free_port() -> Result<u16, Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn read_to_string(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_serves_and_cleans_up() {
        let cluster = TempCluster::start().expect("start postgres");
        let dir = cluster.dir().to_owned();
        assert!(
            cluster
                .url("postgres")
                .starts_with("postgres://postgres@127.0.0.1:")
        );
        std::net::TcpStream::connect(("127.0.0.1", cluster.port())).expect("server listens");
        cluster.stop();
        assert!(!dir.exists(), "the guardian removed {}", dir.display());
    }
}
