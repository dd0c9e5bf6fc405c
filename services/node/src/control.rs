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
        self.node.counters.reset();
        // A measurement that starts from zeroed counters starts from a full budget too.
        if let Some(budget) = &self.node.budget {
            budget.refill();
        }
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
