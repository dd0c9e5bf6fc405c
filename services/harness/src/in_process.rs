//! A retrychain service in the caller's tokio runtime: the same flags and the same start-up
//! as the binary's (`retrychain-serve`), on a listener of its own, without a process — for
//! tests where no crash or signal is the point, and the demo's extra edges.

use std::time::Duration;

use anyhow::Context;
use retrychain_serve::ServiceCommand;
use tokio::{sync::oneshot, task::JoinHandle};

use crate::addr::ServiceAddr;

/// A service serving in this process. Dropping it stops it accepting connections; the open
/// ones are closed gracefully in the background (not a crash: for that, use a
/// [`ChildService`](crate::ChildService) and SIGKILL it). [`InProcessService::stop`] waits
/// for the drain.
#[derive(Debug)]
pub struct InProcessService {
    /// Its name.
    pub name: String,
    /// Its addresses.
    pub addr: ServiceAddr,
    /// Completes the shutdown future the service serves under.
    stop: Option<oneshot::Sender<()>>,
    /// The serving task.
    task: JoinHandle<anyhow::Result<()>>,
}

impl InProcessService {
    /// Starts the service `command` describes — the typed settings a child process would
    /// parse from its flags — in this runtime. Returns once both ports are bound (calls made
    /// from then on queue until the server accepts them).
    pub async fn start(name: &str, command: ServiceCommand) -> anyhow::Result<Self> {
        let (stop, stopped) = oneshot::channel::<()>();
        let started = retrychain_serve::start(command, async move {
            let _ = stopped.await;
        })
        .await
        .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            addr: ServiceAddr::from(&started.addrs),
            stop: Some(stop),
            task: tokio::spawn(started.serve()),
        })
    }

    /// Stops as SIGTERM stops a process: no new calls, in-flight ones drained (the
    /// server's grace period caps the wait).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let grace = retrychain_node::DRAIN_GRACE + Duration::from_secs(1);
        match tokio::time::timeout(grace, &mut self.task).await {
            Ok(served) => served.context("the serving task")?,
            Err(_) => anyhow::bail!("{} did not stop within {grace:?}", self.name),
        }
    }
}

impl Drop for InProcessService {
    fn drop(&mut self) {
        self.task.abort();
    }
}
