//! How a flag's value is written on a child's command line, for serde: the one place a
//! typed value becomes text again.

use std::time::Duration;

use clap::ValueEnum;
use serde::Serializer;

/// A value's name on the command line (`edge-only`, `full`), for serde.
pub(super) fn as_value_name<S: Serializer>(
    value: &impl ValueEnum,
    to: S,
) -> Result<S::Ok, S::Error> {
    match value.to_possible_value() {
        Some(name) => to.serialize_str(name.get_name()),
        None => to.serialize_none(),
    }
}

/// [`as_value_name`] of a value that may be absent.
pub(super) fn as_optional_value_name<S: Serializer>(
    value: &Option<impl ValueEnum>,
    to: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => as_value_name(value, to),
        None => to.serialize_none(),
    }
}

/// A duration as the command line takes it (`24h`, `90s`), for serde.
pub(super) fn as_humantime<S: Serializer>(value: &Duration, to: S) -> Result<S::Ok, S::Error> {
    to.collect_str(&humantime::format_duration(*value))
}
