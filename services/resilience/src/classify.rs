//! Which failures are worth retrying, and which errors prove a call never reached its
//! server.

use tonic::{Code, Status};

/// Whether a code may succeed if the same request is sent again.
///
/// UNAVAILABLE and ABORTED are transient by definition; RESOURCE_EXHAUSTED is overload, worth
/// retrying only after the server's pushback; DEADLINE_EXCEEDED of one attempt is retryable
/// only while the overall deadline still has room, which the retry loops check separately.
/// Everything else fails the same way again and would only add load.
pub fn is_retryable(code: Code) -> bool {
    RETRYABLE.contains(&code)
}

/// The codes [`is_retryable`] accepts, as a retry policy's `retryableStatusCodes`.
pub const RETRYABLE: [Code; 4] = [
    Code::Unavailable,
    Code::ResourceExhausted,
    Code::Aborted,
    Code::DeadlineExceeded,
];

/// Gives a failure the client made itself from a broken connection the code it stands for.
///
/// tonic reports a connection that died mid-call (the server crashed, a reset) as UNKNOWN
/// "transport error", carrying the underlying error as its source; a status that came over
/// the wire never has a source. Such a failure is UNAVAILABLE — the transient case retries
/// exist for. Whether the call took effect is unknown, which is what idempotency keys are for.
pub fn transport_failure_as_unavailable(status: Status) -> Status {
    use std::error::Error as _;
    if status.code() == Code::Unknown && status.source().is_some() {
        Status::with_metadata(
            Code::Unavailable,
            format!("connection to downstream failed: {}", status.message()),
            status.metadata().clone(),
        )
    } else {
        status
    }
}

/// Whether a call's error proves that the request never reached the server's application,
/// so that sending it again cannot do anything twice (gRFC A6's transparent retry):
///
/// - the connection could not be made (`tonic::ConnectError`);
/// - the request was still queued in the client when its connection closed (hyper's
///   `Canceled`, which tonic would report as CANCELLED, the caller's code), or the
///   connection would not open its stream ([`NeverSent`], the balancer's own connections);
/// - the server's GOAWAY named a last stream below this one, or it refused the stream
///   (RST_STREAM REFUSED_STREAM): both promise the stream was not processed (RFC 9113
///   §8.7).
///
/// A connection reset or closed after the request was written is not among them: the
/// server may have acted on it.
pub fn never_processed(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<tonic::ConnectError>() || error.is::<NeverSent>() {
            return true;
        }
        if let Some(error) = error.downcast_ref::<hyper::Error>()
            && error.is_canceled()
        {
            return true;
        }
        if let Some(error) = error.downcast_ref::<h2::Error>()
            && error.is_remote()
            && (error.is_go_away() || error.reason() == Some(h2::Reason::REFUSED_STREAM))
        {
            return true;
        }
        next = error.source();
    }
    false
}

/// A request its connection would not open a stream for: the connection had ended, or
/// was ending (a GOAWAY received). Nothing of the request was written.
#[derive(Debug, thiserror::Error)]
#[error("the connection would not take the request: {0}")]
pub struct NeverSent(#[source] pub Box<dyn std::error::Error + Send + Sync>);

/// Whether a call's error is the client channel's own timer enforcing the timeout
/// it sent (tonic reports it as CANCELLED): the attempt's deadline passed.
pub fn is_local_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<tonic::TimeoutExpired>() {
            return true;
        }
        next = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_codes_are_exactly_the_contracts() {
        let retryable = [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::DeadlineExceeded,
        ];
        for code in [
            Code::Ok,
            Code::Cancelled,
            Code::Unknown,
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::FailedPrecondition,
            Code::OutOfRange,
            Code::Unimplemented,
            Code::Internal,
            Code::DataLoss,
            Code::Unauthenticated,
        ] {
            assert!(!is_retryable(code), "{code:?}");
        }
        for code in retryable {
            assert!(is_retryable(code), "{code:?}");
        }
    }

    #[test]
    fn a_local_transport_failure_is_unavailable_but_a_servers_unknown_is_not() {
        let local = Status::from_error(Box::new(std::io::Error::other("connection reset")));
        assert_eq!(local.code(), Code::Unknown);
        assert_eq!(
            transport_failure_as_unavailable(local).code(),
            Code::Unavailable
        );
        let remote = Status::unknown("the server said unknown");
        assert_eq!(
            transport_failure_as_unavailable(remote).code(),
            Code::Unknown
        );
    }
}
