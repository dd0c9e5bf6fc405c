//! The `Control` service every node serves: counters out, faults in.

use std::sync::Arc;

use retrychain_proto::v1::{
    Faults, GetStatsRequest, ResetStatsRequest, Stats, control_server::Control,
};
use tonic::{Request, Response, Status};

use crate::Node;

/// Serves `retrychain.v1.Control` over one node's state.
#[derive(Debug, Clone)]
pub struct ControlService {
    /// The node observed and steered.
    node: Arc<Node>,
}

impl ControlService {
    /// A Control service for `node`.
    pub fn new(node: Arc<Node>) -> Self {
        Self { node }
    }
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn get_stats(&self, _: Request<GetStatsRequest>) -> Result<Response<Stats>, Status> {
        Ok(Response::new(self.node.stats()))
    }

    async fn reset_stats(&self, _: Request<ResetStatsRequest>) -> Result<Response<Stats>, Status> {
        // Counters only. The retry budget is protection, not a statistic: if resetting the
        // counters refilled it, anyone who can call Control could switch the budget off
        // during an outage by calling ResetStats in a loop.
        self.node.reset_stats();
        Ok(Response::new(self.node.stats()))
    }

    async fn set_faults(&self, request: Request<Faults>) -> Result<Response<Faults>, Status> {
        if !self.node.fault_injection {
            return Err(Status::permission_denied(format!(
                "{} was started without --fault-injection; SetFaults is refused",
                self.node.name
            )));
        }
        let faults = self.node.faults.set(request.into_inner())?;
        tracing::warn!(service = %self.node.name, ?faults, "faults changed");
        Ok(Response::new(faults))
    }
}
