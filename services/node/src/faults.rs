//! Fault injection on a service's downstream call, steered by `Control.SetFaults`.
//!
//! For the four forwarding services the faults are a tower layer, [`FaultLayer`], put on
//! the downstream client only when the service runs with `--fault-injection`: the
//! production call path has no fault code in it. The ledger's processor is simulated, and
//! the faults are its behaviour.
//!
//! The faults model what retries exist for: a call that fails before reaching downstream
//! (`fail_rate`, `fail_code`, `pushback_ms`), a slow downstream (`delay_ms`), and the case
//! idempotency keys exist for — downstream succeeded but the reply was lost
//! (`drop_reply_rate`).

use std::{
    pin::Pin,
    sync::{Arc, RwLock},
    task::{Context, Poll},
    time::Duration,
};

use rand::RngExt;
use resilience::wire;
use retrychain_proto::v1::Faults;
use tonic::{Code, Status};

/// The faults in force, parsed: what every downstream call reads, cheap to copy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    /// Probability that a call fails before reaching downstream.
    pub fail_rate: f64,
    /// The code of those failures.
    pub fail_code: Code,
    /// With RESOURCE_EXHAUSTED: the pushback to send, in ms (0: none).
    pub pushback_ms: u32,
    /// With RESOURCE_EXHAUSTED: send a negative pushback (do not retry).
    pub pushback_never: bool,
    /// Added to each downstream call, in ms.
    pub delay_ms: u32,
    /// Probability that a successful reply is lost.
    pub drop_reply_rate: f64,
    /// Ledger: processor calls served at once (0: no limit).
    pub processor_capacity: u32,
    /// Ledger: probability that the processor charges and its answer is lost.
    pub processor_lost_answer_rate: f64,
    /// Ledger: the hold between the processor's answer and phase 2, in ms.
    pub finish_delay_ms: u32,
}

impl Default for FaultPlan {
    fn default() -> Self {
        Self {
            fail_rate: 0.0,
            fail_code: Code::Unavailable,
            pushback_ms: 0,
            pushback_never: false,
            delay_ms: 0,
            drop_reply_rate: 0.0,
            processor_capacity: 0,
            processor_lost_answer_rate: 0.0,
            finish_delay_ms: 0,
        }
    }
}

/// The faults in force on one service, shared by its handlers.
#[derive(Debug, Default)]
pub struct FaultSwitch {
    /// The current faults, validated and parsed. Read on every call, written by SetFaults.
    plan: RwLock<FaultPlan>,
}

impl FaultSwitch {
    /// The faults now in force.
    pub fn current(&self) -> FaultPlan {
        *self
            .plan
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Validates and installs new faults; INVALID_ARGUMENT leaves the old ones in force.
    pub fn set(&self, faults: Faults) -> Result<Faults, Status> {
        for (name, rate) in [
            ("fail_rate", faults.fail_rate),
            ("drop_reply_rate", faults.drop_reply_rate),
            (
                "processor_lost_answer_rate",
                faults.processor_lost_answer_rate,
            ),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(Status::invalid_argument(format!(
                    "{name} must be between 0 and 1, got {rate}"
                )));
            }
        }
        let code = parse_code(&faults.fail_code)?;
        let plan = FaultPlan {
            fail_rate: faults.fail_rate,
            fail_code: code,
            pushback_ms: faults.pushback_ms,
            pushback_never: faults.pushback_never,
            delay_ms: faults.delay_ms,
            drop_reply_rate: faults.drop_reply_rate,
            processor_capacity: faults.processor_capacity,
            processor_lost_answer_rate: faults.processor_lost_answer_rate,
            finish_delay_ms: faults.finish_delay_ms,
        };
        *self
            .plan
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = plan;
        Ok(Faults {
            fail_code: wire::code_name(code).to_owned(),
            ..faults
        })
    }

    /// The injected failure for this call, if the dice say it fails before reaching
    /// downstream.
    pub fn injected_failure(&self, service: &str) -> Option<Status> {
        let plan = self.current();
        if plan.fail_rate <= 0.0 || !rand::rng().random_bool(plan.fail_rate.min(1.0)) {
            return None;
        }
        Some(failure(
            plan.fail_code,
            format!("injected fault at {service}: downstream call failed"),
            &plan,
        ))
    }

    /// Extra latency to add to each downstream call.
    pub fn delay(&self) -> Duration {
        Duration::from_millis(u64::from(self.current().delay_ms))
    }

    /// Whether this successful reply is to be lost on its way back.
    pub fn drop_reply(&self) -> bool {
        let rate = self.current().drop_reply_rate;
        rate > 0.0 && rand::rng().random_bool(rate.min(1.0))
    }
}

/// A failure with `code`, carrying the faults' pushback when the code is RESOURCE_EXHAUSTED.
pub fn failure(code: Code, message: String, faults: &FaultPlan) -> Status {
    let mut status = Status::new(code, message);
    if code == Code::ResourceExhausted {
        if faults.pushback_never {
            wire::set_pushback(&mut status, -1);
        } else if faults.pushback_ms > 0 {
            wire::set_pushback(&mut status, i64::from(faults.pushback_ms));
        }
    }
    status
}

/// Injects the faults in force on every call through a client; see the module docs.
#[derive(Debug, Clone)]
pub struct FaultLayer {
    /// The faults in force.
    faults: Arc<FaultSwitch>,
    /// Whose name goes in the messages.
    service: Arc<str>,
}

impl FaultLayer {
    /// A layer injecting the faults of `faults`, in the name of `service`.
    pub fn new(faults: Arc<FaultSwitch>, service: &str) -> Self {
        Self {
            faults,
            service: Arc::from(service),
        }
    }
}

impl<S> tower::Layer<S> for FaultLayer {
    type Service = Faulty<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Faulty {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`FaultLayer`] makes: before the call, a failure (`fail_rate`) or a delay
/// (`delay_ms`); after a call that succeeded, maybe a lost reply (`drop_reply_rate`).
#[derive(Debug, Clone)]
pub struct Faulty<S> {
    /// The downstream client.
    inner: S,
    /// Whose faults.
    layer: FaultLayer,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<tonic::body::Body>> for Faulty<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let FaultLayer { faults, service } = self.layer.clone();
        Box::pin(async move {
            if let Some(status) = faults.injected_failure(&service) {
                return Ok(status.into_http());
            }
            let delay = faults.delay();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let response = inner.call(request).await?;
            if faults.current().drop_reply_rate <= 0.0 {
                return Ok(response);
            }
            // Whether downstream succeeded is in the trailers: read the (unary) answer.
            let (parts, body) = response.into_parts();
            let collected = match http_body_util::BodyExt::collect(body).await {
                Ok(collected) => collected,
                Err(status) => return Ok(status.into_http()),
            };
            let trailers = collected.trailers().cloned();
            let succeeded = trailers
                .as_ref()
                .and_then(resilience::wire::status_code)
                .or_else(|| resilience::wire::status_code(&parts.headers))
                == Some(Code::Ok);
            if succeeded && faults.drop_reply() {
                return Ok(lost_reply(&service).into_http());
            }
            let mut frames: Vec<Result<http_body::Frame<bytes::Bytes>, tonic::Status>> =
                vec![Ok(http_body::Frame::data(collected.to_bytes()))];
            if let Some(trailers) = trailers {
                frames.push(Ok(http_body::Frame::trailers(trailers)));
            }
            let body = tonic::body::Body::new(http_body_util::StreamBody::new(
                futures::stream::iter(frames),
            ));
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

/// The reply a lost response is replaced by.
pub fn lost_reply(service: &str) -> Status {
    Status::unavailable(format!(
        "injected fault at {service}: the reply was lost after downstream succeeded"
    ))
}

/// A gRPC code from its name (`UNAVAILABLE`, case-insensitive); empty means UNAVAILABLE.
pub fn parse_code(name: &str) -> Result<Code, Status> {
    if name.is_empty() {
        return Ok(Code::Unavailable);
    }
    wire::code_by_name(name)
        .filter(|code| *code != Code::Ok)
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "fail_code {name:?} is not a gRPC code name other than OK (e.g. UNAVAILABLE)"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_and_normalises() {
        let switch = FaultSwitch::default();
        let set = switch
            .set(Faults {
                fail_rate: 1.0,
                fail_code: "resource_exhausted".into(),
                pushback_ms: 200,
                ..Faults::default()
            })
            .expect("valid");
        assert_eq!(set.fail_code, "RESOURCE_EXHAUSTED");
        let status = switch.injected_failure("hop2").expect("always fails");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            resilience::wire::pushback(&status),
            resilience::wire::Pushback::RetryAfter(Duration::from_millis(200))
        );

        for bad in [
            Faults {
                fail_rate: 1.5,
                ..Faults::default()
            },
            Faults {
                drop_reply_rate: -0.1,
                ..Faults::default()
            },
            Faults {
                fail_code: "SOMETIMES".into(),
                ..Faults::default()
            },
            Faults {
                fail_code: "OK".into(),
                ..Faults::default()
            },
        ] {
            assert_eq!(
                switch.set(bad).expect_err("invalid").code(),
                Code::InvalidArgument
            );
        }
        assert_eq!(
            switch.current().fail_code,
            Code::ResourceExhausted,
            "unchanged"
        );
    }

    #[test]
    fn empty_code_means_unavailable_and_zero_rate_never_fails() {
        let switch = FaultSwitch::default();
        assert!(switch.injected_failure("x").is_none());
        assert!(!switch.drop_reply());
        switch
            .set(Faults {
                fail_rate: 1.0,
                ..Faults::default()
            })
            .expect("valid");
        assert_eq!(
            switch.injected_failure("x").expect("fails").code(),
            Code::Unavailable
        );
    }
}
