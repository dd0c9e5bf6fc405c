//! The faults a chain is put through, by name: a `Faults` message for `Control.SetFaults`
//! on any service (a hop's faults apply to its downstream calls, the ledger's to its
//! processor). Fields not named are no fault; combine with struct update syntax:
//! `Faults { pushback_ms: 200, ..failing_with(Code::ResourceExhausted) }`.

use retrychain_proto::v1::Faults;
use tonic::Code;

/// Every call fails, UNAVAILABLE: an outage.
pub fn failing() -> Faults {
    Faults {
        fail_rate: 1.0,
        ..Faults::default()
    }
}

/// Every call fails with `code`.
pub fn failing_with(code: Code) -> Faults {
    Faults {
        fail_code: resilience::wire::code_name(code).to_owned(),
        ..failing()
    }
}

/// Every call takes `ms` longer (the ledger's inside its transaction).
pub fn delayed(ms: u32) -> Faults {
    Faults {
        delay_ms: ms,
        ..Faults::default()
    }
}

/// The work is done but `rate` of the replies are lost on the way back, replaced by
/// UNAVAILABLE: the failure a retry must not turn into a second charge.
pub fn losing_replies(rate: f64) -> Faults {
    Faults {
        drop_reply_rate: rate,
        ..Faults::default()
    }
}
