//! [`TempCluster`]: one throwaway Postgres server; see the crate docs.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    error::Error,
    host::{find_bindir, free_port, read_to_string, unprivileged_user},
};

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
    /// TLS: the server speaks TLS 1.3 with this certificate and accepts TCP connections
    /// only over TLS (`hostssl` in pg_hba.conf); its URLs ask for `sslmode=verify-full`.
    pub tls: Option<ServerTls>,
}

/// The server's TLS material (PEM files; copied into the cluster's directory with the
/// ownership and mode Postgres demands of a key).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate; it must name 127.0.0.1 (the URLs' host) for verify-full.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The authority a client checks the certificate against (`sslrootcert`).
    pub ca: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            fsync: false,
            max_connections: 400,
            port: None,
            tls: None,
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
    /// The guardian shell: stops the server before removing `dir`.
    guardian: Child,
    /// Where `initdb`, `postgres` and `pg_ctl` are.
    bindir: PathBuf,
    /// The unprivileged user the server runs as, when we are root.
    run_as: Option<(u32, u32)>,
    /// The server's options (socket, port, settings), for `pg_ctl start`.
    server_options: Vec<String>,
    /// Our end of the guardian's pipe; closing it starts the clean-up.
    guardian_pipe: Option<ChildStdin>,
    /// With TLS: the authority clients check the server against.
    tls_ca: Option<PathBuf>,
}

const SUPERUSER: &str = "postgres";

/// The server options that turn TLS on with `tls`'s certificate and key, copied into `dir`
/// (owned by the server's user, the key readable by it alone, as Postgres demands), and a
/// pg_hba.conf that lets TCP clients in only over TLS (the socket stays for local tools).
fn server_tls(
    tls: &ServerTls,
    dir: &Path,
    data: &Path,
    run_as: Option<(u32, u32)>,
) -> Result<Vec<String>, Error> {
    use std::os::unix::fs::PermissionsExt;
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    fs::copy(&tls.cert, &cert)?;
    fs::copy(&tls.key, &key)?;
    fs::set_permissions(&key, fs::Permissions::from_mode(0o600))?;
    let hba = data.join("pg_hba.conf");
    fs::write(
        &hba,
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
    )?;
    if let Some((uid, gid)) = run_as {
        for path in [&cert, &key, &hba] {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
        }
    }
    Ok(vec![
        "-c".into(),
        "ssl=on".into(),
        "-c".into(),
        format!("ssl_cert_file={}", cert.display()),
        "-c".into(),
        format!("ssl_key_file={}", key.display()),
        "-c".into(),
        "ssl_min_protocol_version=TLSv1.3".into(),
    ])
}

/// `initdb` into `data`: trust authentication for the superuser, UTF-8, C locale, no sync
/// (a throwaway cluster).
fn initdb(bindir: &Path, run_as: Option<(u32, u32)>, dir: &Path, data: &Path) -> Result<(), Error> {
    let mut initdb = command(&bindir.join("initdb"), run_as, dir);
    initdb
        .arg("-D")
        .arg(data)
        .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C"])
        .arg("--no-sync");
    let output = initdb.output().map_err(|source| Error::Spawn {
        program: "initdb".into(),
        source,
    })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(Error::Initdb(
            String::from_utf8_lossy(&output.stderr).into(),
        ))
    }
}

impl TempCluster {
    /// Starts a cluster with default options.
    pub fn start() -> Result<Self, Error> {
        Self::start_with(&Options::default())
    }

    /// Starts a cluster: initdb into a new temporary directory, then the server.
    pub fn start_with(options: &Options) -> Result<Self, Error> {
        let bindir = find_bindir()?;
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

        if let Err(error) = initdb(&bindir, run_as, &dir, &data) {
            let _ = fs::remove_dir_all(&dir);
            return Err(error);
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
        let mut server_options: Vec<String> = vec![
            "-k".into(),
            socket.display().to_string(),
            "-p".into(),
            port.to_string(),
            "-c".into(),
            "listen_addresses=127.0.0.1".into(),
            "-c".into(),
            format!("max_connections={}", options.max_connections),
            "-c".into(),
            format!("fsync={}", if options.fsync { "on" } else { "off" }),
        ];
        if let Some(tls) = &options.tls {
            server_options.extend(server_tls(tls, &dir, &data, run_as)?);
        }
        let mut guardian = command(Path::new("sh"), run_as, &dir);
        guardian
            .arg("-c")
            .arg(GUARDIAN)
            .arg("guardian")
            .arg(&dir)
            .arg(bindir.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(&server_options)
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
            bindir,
            run_as,
            server_options,
            guardian_pipe,
            tls_ca: options.tls.as_ref().map(|tls| tls.ca.clone()),
        };
        cluster.wait_ready(Duration::from_secs(60))?;
        tracing::info!(port, dir = %cluster.dir.display(), "throwaway postgres ready");
        Ok(cluster)
    }

    /// The URL of database `database` as the superuser (over TLS, checking the server's
    /// certificate and name, when the cluster has TLS).
    pub fn url(&self, database: &str) -> String {
        if let Some(ca) = &self.tls_ca {
            return format!(
                "postgres://{SUPERUSER}@127.0.0.1:{}/{database}?sslmode=verify-full&sslrootcert={}",
                self.port,
                ca.display()
            );
        }
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

    /// The server's processes: the postmaster first, then its children (backends,
    /// background workers) — what a test freezes to stall the whole server, as a stalled
    /// VM or a stopped container would.
    pub fn server_pids(&self) -> Result<Vec<u32>, Error> {
        let pidfile = fs::read_to_string(self.dir.join("data").join("postmaster.pid"))?;
        let postmaster: u32 = pidfile
            .lines()
            .next()
            .and_then(|line| line.trim().parse().ok())
            .ok_or_else(|| Error::Io(std::io::Error::other("postmaster.pid names no pid")))?;
        with_children(postmaster)
    }

    /// Stops the server and removes its files, waiting until both are done.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// `pg_ctl restart -m fast`: every session is ended (clients see `57P01
    /// admin_shutdown` or a closed connection), then the server comes back on the same
    /// port with the same data.
    pub fn restart_server(&self) -> Result<(), Error> {
        let log = self.dir.join("postgres.log");
        self.pg_ctl("restart", &["-m", "fast", "-l", &log.display().to_string()])
    }

    /// `pg_ctl stop -m fast`: the server is down (connections refused) until
    /// [`TempCluster::start_server`].
    pub fn stop_server(&self) -> Result<(), Error> {
        self.pg_ctl("stop", &["-m", "fast"])
    }

    /// Starts a server stopped by [`TempCluster::stop_server`], waiting until it accepts
    /// connections.
    pub fn start_server(&self) -> Result<(), Error> {
        let log = self.dir.join("postgres.log");
        // pg_ctl hands -o to a shell: quote each option.
        let options = self
            .server_options
            .iter()
            .map(|o| format!("'{}'", o.replace('\'', r"'\''")))
            .collect::<Vec<_>>()
            .join(" ");
        self.pg_ctl("start", &["-l", &log.display().to_string(), "-o", &options])
    }

    fn pg_ctl(&self, action: &'static str, extra: &[&str]) -> Result<(), Error> {
        // Its output goes to a file, not a pipe: a server it starts would inherit a pipe
        // and hold it open for as long as it runs.
        let out_path = self.dir.join("pg_ctl.out");
        let out = fs::File::create(&out_path)?;
        let status = command(&self.bindir.join("pg_ctl"), self.run_as, &self.dir)
            .args([action, "-w", "-t", "60", "-D"])
            .arg(self.dir.join("data"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .status()
            .map_err(|source| Error::Spawn {
                program: "pg_ctl".into(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::PgCtl {
                action,
                output: read_to_string(&out_path),
            })
        }
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
/// stdin to close, then fast-shuts down whichever server runs on the data directory now
/// (SIGINT to the pid in `postmaster.pid`: after a `pg_ctl restart` it is no longer our
/// child), waits for it, and removes the directory. Ignores Ctrl-C so that a terminal's
/// SIGINT to the whole process group does not skip the clean-up (the server handles that
/// SIGINT itself).
const GUARDIAN: &str = r#"
trap '' INT
dir="$1"; shift
"$@" &
cat >/dev/null
pid=$(head -n 1 "$dir/data/postmaster.pid" 2>/dev/null)
if [ -n "$pid" ]; then
  kill -INT "$pid" 2>/dev/null
  kill -CONT "$pid" 2>/dev/null
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
fi
wait
rm -rf "$dir"
"#;

fn command(program: &Path, run_as: Option<(u32, u32)>, dir: &Path) -> Command {
    let mut command = Command::new(program);
    command.current_dir(dir);
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid).env("HOME", dir);
    }
    command
}

/// `postmaster` and its children (backends, background workers), postmaster first: a
/// server's processes, to freeze it whole.
pub(crate) fn with_children(postmaster: u32) -> Result<Vec<u32>, Error> {
    let mut pids = vec![postmaster];
    for entry in fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // /proc/<pid>/stat: "pid (comm) state ppid …"; comm may hold spaces.
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|ppid| ppid.parse::<u32>().ok());
        if parent == Some(postmaster) {
            pids.push(pid);
        }
    }
    Ok(pids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_restarts_stops_and_starts_on_its_port() {
        let cluster = TempCluster::start().expect("start postgres");
        let connects = || std::net::TcpStream::connect(("127.0.0.1", cluster.port())).is_ok();
        cluster.restart_server().expect("restart");
        assert!(connects());
        cluster.stop_server().expect("stop");
        assert!(!connects(), "down");
        cluster.start_server().expect("start");
        assert!(connects(), "up again");
        let dir = cluster.dir().to_owned();
        cluster.stop();
        assert!(
            !dir.exists(),
            "the guardian stopped the restarted server and cleaned up"
        );
    }

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
