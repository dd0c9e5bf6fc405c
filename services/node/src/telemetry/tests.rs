//! Tests of [`super`]: `telemetry`.

use super::*;

#[test]
fn span_fields_are_written_once_and_added_after_a_space() {
    use tracing_subscriber::fmt::{FormatFields, FormattedFields};
    let fields = tracing::field::FieldSet::new(
        &["service", "otel.kind", "key"],
        tracing::callsite::Identifier(&CALLSITE),
    );
    let mut iter = fields.iter();
    let (service, otel, key) = (
        iter.next().expect("field"),
        iter.next().expect("field"),
        iter.next().expect("field"),
    );
    let values: [(&tracing::field::Field, Option<&dyn tracing::Value>); 3] = [
        (&service, Some(&"hop2")),
        (&otel, Some(&"server")),
        (&key, None),
    ];
    let values = fields.value_set(&values);
    let mut written = FormattedFields::<WithoutOtelFields>::new(String::new());
    WithoutOtelFields
        .format_fields(written.as_writer(), tracing::span::Record::new(&values))
        .expect("formatted");
    assert_eq!(written.fields, "service=\"hop2\"");
    let key_value: [(&tracing::field::Field, Option<&dyn tracing::Value>); 1] =
        [(&key, Some(&"k-1"))];
    let key_values = fields.value_set(&key_value);
    let record = tracing::span::Record::new(&key_values);
    WithoutOtelFields
        .add_fields(&mut written, &record)
        .expect("added");
    assert_eq!(written.fields, "service=\"hop2\" key=\"k-1\"");
}

#[test]
fn a_text_field_is_written_as_debug_writes_it_whatever_it_holds() {
    // The plain path must match `Debug` byte for byte, and anything else must take it: a
    // quote, a backslash, a line break or an escape in a key cannot end the value or the line.
    let fields = tracing::field::FieldSet::new(&["key"], tracing::callsite::Identifier(&CALLSITE));
    let key = fields.iter().next().expect("field");
    for value in [
        "order-7",
        "",
        "a b~c:d/e.f_g",
        "say \"hi\"",
        "back\\slash",
        "line\nbreak",
        "tab\there",
        "\u{1b}[31mred",
        "caf\u{e9}",
        "\u{202e}reversed",
        "nul\0",
        "del\u{7f}",
    ] {
        let values: [(&tracing::field::Field, Option<&dyn tracing::Value>); 1] =
            [(&key, Some(&value))];
        let values = fields.value_set(&values);
        let mut written = String::new();
        write_fields(&mut written, tracing::span::Record::new(&values)).expect("written");
        assert_eq!(written, format!("key={value:?}"), "{value:?}");
    }
}

#[test]
fn numbers_are_written_as_display_writes_them() {
    let fields = tracing::field::FieldSet::new(
        &["attempt", "offset"],
        tracing::callsite::Identifier(&CALLSITE),
    );
    let mut iter = fields.iter();
    let (attempt, offset) = (iter.next().expect("field"), iter.next().expect("field"));
    for (a, o) in [
        (0u64, 0i64),
        (7, -7),
        (u64::MAX, i64::MIN),
        (1_000_000, i64::MAX),
    ] {
        let values: [(&tracing::field::Field, Option<&dyn tracing::Value>); 2] =
            [(&attempt, Some(&a)), (&offset, Some(&o))];
        let values = fields.value_set(&values);
        let mut written = String::new();
        write_fields(&mut written, tracing::span::Record::new(&values)).expect("written");
        assert_eq!(written, format!("attempt={a} offset={o}"));
    }
}

#[test]
fn only_directives_on_targets_and_levels_skip_the_env_filter() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    let targets = |text: &str| text.parse::<Targets>().expect("targets");
    assert_eq!(by_target("info"), Some(targets("info")));
    assert_eq!(by_target("info,"), Some(targets("info")));
    assert_eq!(
        by_target(" warn , retrychain_ledger=debug "),
        Some(
            Targets::new()
                .with_default(LevelFilter::WARN)
                .with_target("retrychain_ledger", LevelFilter::DEBUG)
        )
    );
    assert_eq!(by_target("off"), Some(targets("off")));
    assert_eq!(
        by_target("my-crate::module=TRACE,h2=3"),
        Some(targets("my-crate::module=trace,h2=info"))
    );
    // What says more than a target and a level is an EnvFilter's to read.
    for directives in [
        "[rpc]=debug",
        "info,[rpc]=debug",
        "retrychain_node[rpc]=debug",
        "[{key}]=debug",
        "[rpc{key=order-7}]=debug",
        "*=debug",
        "=debug",
        "h2=loud",
        "h2=",
        "a=b=c",
        ",",
    ] {
        assert_eq!(by_target(directives), None, "{directives}");
    }
}

struct TestCallsite;
static CALLSITE: TestCallsite = TestCallsite;
impl tracing::callsite::Callsite for TestCallsite {
    fn set_interest(&self, _: tracing::subscriber::Interest) {}
    fn metadata(&self) -> &tracing::Metadata<'_> {
        unimplemented!("not registered")
    }
}

#[test]
fn samplers_read_as_the_specification_says() {
    let on = Sampler::parse("", None);
    assert!(on.decide("4bf92f3577b34da6a3ce929d0e0e4736", None));
    assert!(
        !on.decide("4bf92f3577b34da6a3ce929d0e0e4736", Some(false)),
        "parent-based"
    );
    assert!(
        !Sampler::parse("always_off", None).decide("4bf92f3577b34da6a3ce929d0e0e4736", Some(true))
    );
    assert!(
        Sampler::parse("always_on", None).decide("4bf92f3577b34da6a3ce929d0e0e4736", Some(false))
    );
    assert_eq!(
        Sampler::parse("traceidratio", Some("2")).root,
        Root::Ratio(1.0)
    );
    assert_eq!(
        Sampler::parse("traceidratio", Some("x")).root,
        Root::Ratio(1.0)
    );
    assert_eq!(Sampler::parse("nonsense", None), on);
}

#[test]
fn the_ratio_is_the_sdks_arithmetic_on_the_trace_id() {
    let ratio = Sampler::parse("traceidratio", Some("0.25"));
    // Low 64 bits 0x...: (low >> 1) against 0.25 * 2^63 = 2^61.
    let under = format!("{:016x}{:016x}", u64::MAX, (1u64 << 62) - 2);
    let over = format!("{:016x}{:016x}", 0, 1u64 << 62);
    assert!(ratio.decide(&under, None));
    assert!(!ratio.decide(&over, None));
    // Not parent-based: the caller's flag does not count.
    assert!(ratio.decide(&under, Some(false)));
    assert!(!ratio.decide(&over, Some(true)));
    // Over many random ids, about the ratio.
    let sampled = (0..10_000u32)
        .filter(|_| {
            let id: u128 = rand::random();
            ratio.decide(&format!("{id:032x}"), None)
        })
        .count();
    assert!((2_200..2_800).contains(&sampled), "{sampled} of 10000");
    let parent = Sampler::parse("parentbased_traceidratio", Some("0.25"));
    assert!(parent.decide(&over, Some(true)));
    assert!(!parent.decide(&under, Some(false)));
    assert!(parent.decide(&under, None));
}
