//! A chain's caller, named by intent: charge, read an account, set faults, read and reset
//! counters — over the same Payments and Control APIs any client uses.

use retrychain_proto::v1::{
    ChargeReply, ChargeRequest, Faults, GetAccountRequest, GetStatsRequest, ResetStatsRequest,
    Stats, control_client::ControlClient, payments_client::PaymentsClient,
};
use tonic::{Code, Request, Response, Status, transport::Channel};

use crate::{
    addr::{ChainAddrs, ServiceAddr, connect},
    faults,
};

/// The position of the ledger in a chain (the edge is 0).
pub const LEDGER: usize = 4;

/// Channels to a chain's five services, public and admin.
#[derive(Debug, Clone)]
pub struct ChainClient {
    /// Payments, edge first.
    payments: Vec<Channel>,
    /// Control, edge first.
    control: Vec<Channel>,
}

impl ChainClient {
    /// Connects to all ten ports.
    pub async fn connect(addrs: &ChainAddrs) -> anyhow::Result<Self> {
        let mut payments = Vec::new();
        let mut control = Vec::new();
        for addr in addrs.all() {
            payments.push(connect(&addr.url).await?);
            control.push(connect(&addr.admin_url).await?);
        }
        Ok(Self { payments, control })
    }

    /// Connects to all ten ports of a chain over TLS, as the operator (each server
    /// required to be its tier): the tests' client of a chain started with `tls`.
    pub async fn connect_tls(addrs: &ChainAddrs, tls: &crate::ChainTls) -> anyhow::Result<Self> {
        let mut payments = Vec::new();
        let mut control = Vec::new();
        for (addr, name) in addrs.all().into_iter().zip(crate::NAMES) {
            payments.push(tls.connect(&addr.url, name).await?);
            control.push(tls.connect(&addr.admin_url, name).await?);
        }
        Ok(Self { payments, control })
    }

    /// Connects to one service, which this client then treats as service 0 (its edge):
    /// an edge started apart from a chain, pointed at the chain's hop2.
    pub async fn connect_one(addr: &ServiceAddr) -> anyhow::Result<Self> {
        Ok(Self {
            payments: vec![connect(&addr.url).await?],
            control: vec![connect(&addr.admin_url).await?],
        })
    }

    /// Payments on service `i` (0 the edge … 4 the ledger).
    pub fn payments(&self, i: usize) -> PaymentsClient<Channel> {
        PaymentsClient::new(self.payments[i].clone())
    }

    /// The channel to service `i`'s public port, for a caller that puts its own layers
    /// over it (a client that retries, say).
    pub fn channel(&self, i: usize) -> Channel {
        self.payments[i].clone()
    }

    /// Payments on the edge, where clients call.
    pub fn edge(&self) -> PaymentsClient<Channel> {
        self.payments(0)
    }

    /// Control on service `i`'s admin port.
    pub fn control(&self, i: usize) -> ControlClient<Channel> {
        ControlClient::new(self.control[i].clone())
    }

    /// Sends `request` to the edge.
    pub async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        self.edge().charge(request).await
    }

    /// The balance and charge count of `account`, read through the edge; `None` for an
    /// account never charged.
    pub async fn account(&self, account: &str) -> Result<Option<(i64, i64)>, Status> {
        let request = GetAccountRequest {
            account_id: account.to_owned(),
        };
        match self.edge().get_account(request).await {
            Ok(reply) => Ok(Some((
                reply.get_ref().balance_cents,
                reply.get_ref().charges,
            ))),
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(status),
        }
    }

    /// Replaces service `i`'s faults (all of them: a field left out is no fault); the
    /// faults now in force.
    pub async fn set_faults(&self, i: usize, faults: Faults) -> Result<Faults, Status> {
        Ok(self.control(i).set_faults(faults).await?.into_inner())
    }

    /// Clears service `i`'s faults.
    pub async fn clear_faults(&self, i: usize) -> Result<Faults, Status> {
        self.set_faults(i, Faults::default()).await
    }

    /// Makes the ledger's processor fail every call, UNAVAILABLE: the outage that retries
    /// multiply.
    pub async fn fail_processor(&self) -> Result<Faults, Status> {
        self.set_faults(LEDGER, faults::failing()).await
    }

    /// Makes service `i` lose `rate` of its replies after doing the work.
    pub async fn lose_replies_at(&self, i: usize, rate: f64) -> Result<Faults, Status> {
        self.set_faults(i, faults::losing_replies(rate)).await
    }

    /// Service `i`'s counters.
    pub async fn stats(&self, i: usize) -> Result<Stats, Status> {
        Ok(self
            .control(i)
            .get_stats(GetStatsRequest {})
            .await?
            .into_inner())
    }

    /// Every service's counters, edge first.
    pub async fn all_stats(&self) -> Result<Vec<Stats>, Status> {
        let mut all = Vec::new();
        for i in 0..self.control.len() {
            all.push(self.stats(i).await?);
        }
        Ok(all)
    }

    /// Zeroes every service's counters.
    pub async fn reset_stats(&self) -> Result<(), Status> {
        self.reset_stats_of(0..self.control.len()).await
    }

    /// Zeroes the counters of the services at `positions` (0 the edge … 4 the ledger),
    /// leaving the others' (and their `/metrics`) as they are.
    pub async fn reset_stats_of(
        &self,
        positions: impl IntoIterator<Item = usize>,
    ) -> Result<(), Status> {
        for i in positions {
            self.control(i).reset_stats(ResetStatsRequest {}).await?;
        }
        Ok(())
    }
}
