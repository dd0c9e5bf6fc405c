//! The one way to build a Charge call, for the experiments, the benchmarks and the tests.

use std::time::Duration;

use retrychain_domain::{
    RetryMode,
    metadata::{IDEMPOTENCY_KEY, RETRY_MODE},
};
use retrychain_proto::v1::ChargeRequest;
use tonic::{Request, metadata::MetadataValue};

/// A Charge of `amount_cents` to `account` as retrychain's callers send it: with a
/// timeout of `deadline`, the idempotency key when one is given (a retry reuses it;
/// without one the edge makes one), and `x-retry-mode` when a mode is given (honoured by
/// services started with `--allow-retry-mode-override`).
///
/// A key that cannot be metadata (not visible ASCII) is not sent, as if none were given:
/// the services could not have read it either.
pub fn charge_request(
    account: &str,
    amount_cents: i64,
    key: Option<&str>,
    deadline: Duration,
    mode: Option<RetryMode>,
) -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        account_id: account.to_owned(),
        amount_cents,
    });
    request.set_timeout(deadline);
    if let Some(Ok(key)) = key.map(MetadataValue::try_from) {
        request.metadata_mut().insert(IDEMPOTENCY_KEY, key);
    }
    if let Some(mode) = mode {
        request
            .metadata_mut()
            .insert(RETRY_MODE, MetadataValue::from_static(mode.as_str()));
    }
    request
}
