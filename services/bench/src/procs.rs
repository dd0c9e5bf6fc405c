//! The processes a benchmark starts and measures: killed when dropped, on ports chosen
//! free, waited for until they listen.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

/// Which `retrychain` binary a benchmark starts (`#[command(flatten)]` into its command
/// line): `--retrychain`, else the one built beside the benchmark, so that a comparison of
/// two builds runs each under the same load generator.
#[derive(Debug, clap::Args)]
pub struct RetrychainBinary {
    /// The retrychain binary (default: next to this one).
    #[arg(long)]
    retrychain: Option<PathBuf>,
}

impl RetrychainBinary {
    /// The binary's path.
    pub fn path(&self) -> std::io::Result<PathBuf> {
        match &self.retrychain {
            Some(path) => Ok(path.clone()),
            None => Ok(std::env::current_exe()?.with_file_name("retrychain")),
        }
    }
}

/// A child process, killed (and reaped) when dropped: a benchmark that fails midway
/// leaves nothing running.
#[derive(Debug)]
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `command` with its output discarded: a measured process writing to a pipe
/// nobody reads would stall, and one writing to a terminal would cost what a deployed
/// service's log collector does not.
pub fn spawn_quiet(command: &mut Command) -> anyhow::Result<Proc> {
    Ok(Proc(
        command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    ))
}

/// `N` distinct free ports: bound all at once (so no two are the same, as ports bound and
/// released one after the other can be), then released for the processes to take.
pub fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

/// Waits until something accepts connections on the loopback's `port` (10 s at most).
pub async fn wait_listening(port: u16) -> anyhow::Result<()> {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("nothing listens on {port}")
}
