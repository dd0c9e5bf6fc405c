//! What the demo measured, scenario by scenario, and how it is printed.

use serde::Serialize;

/// Everything the demo measured.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// a. A lost reply, retried with a fresh key and with the same key.
    pub lost_reply: LostReply,
    /// b. The same key with another amount.
    pub key_reuse: KeyReuse,
    /// c. Two concurrent requests with one key.
    pub concurrent: Concurrent,
    /// d. Bottom calls per retry mode against a failing processor.
    pub layered: Layered,
    /// e. A total outage with and without the budget.
    pub outage: Outage,
    /// f. The contention storm per backoff policy.
    pub storm: Storm,
    /// g. Load at 0.8× capacity, the processor slowed for 2 s, per retry mode.
    pub metastability: crate::metastable::Metastability,
}

/// a.
#[derive(Debug, Clone, Serialize)]
pub struct LostReply {
    /// The retry used a new key.
    pub fresh_key: Effect,
    /// The retry reused the key.
    pub same_key: Effect,
    /// The retry with the same key got the original charge's id.
    pub same_charge_id: bool,
    /// … marked `idempotent-replayed: true`.
    pub replayed: bool,
}

/// What an account ended with.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Effect {
    /// Charges committed.
    pub executions: i64,
    /// Balance, in cents.
    pub balance_cents: i64,
}

/// b.
#[derive(Debug, Clone, Serialize)]
pub struct KeyReuse {
    /// The code of the second request.
    pub code: String,
    /// Balance and charge count after the first request and after the second.
    pub before: Effect,
    /// …
    pub after: Effect,
}

/// c.
#[derive(Debug, Clone, Serialize)]
pub struct Concurrent {
    /// Charges committed.
    pub executions: i64,
    /// Both got the same charge id.
    pub same_reply: bool,
    /// Wall time for both, in ms.
    pub elapsed_ms: f64,
    /// The processor delay used, in ms.
    pub processor_delay_ms: u32,
}

/// d.
#[derive(Debug, Clone, Serialize)]
pub struct Layered {
    /// `x-retry-mode: every-layer`.
    pub every_layer: ModeCounts,
    /// `x-retry-mode: edge-only`.
    pub edge_only: ModeCounts,
}

/// One request's counts in one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeCounts {
    /// Ledger processor calls.
    pub bottom_calls: u64,
    /// Requests received by edge, hop2, hop3, hop4, ledger.
    pub received: Vec<u64>,
    /// The code the client saw.
    pub code: String,
}

/// e.
#[derive(Debug, Clone, Serialize)]
pub struct Outage {
    /// Requests sent per configuration.
    pub requests: u64,
    /// Up to 4 attempts, no budget.
    pub no_budget: Load,
    /// Up to 4 attempts, the default budget.
    pub budget: Load,
}

/// Bottom calls per first attempt.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Load {
    /// First attempts (requests the edge received).
    pub first: u64,
    /// Bottom calls.
    pub bottom_calls: u64,
    /// bottom_calls / first.
    pub load: f64,
}

/// f.
#[derive(Debug, Clone, Serialize)]
pub struct Storm {
    /// Clients started together.
    pub clients: usize,
    /// The processor's time per charge, in ms; it serves one at a time.
    pub tick_ms: u64,
    /// Per policy.
    pub none: StormRun,
    /// …
    pub exponential: StormRun,
    /// …
    pub full: StormRun,
    /// …
    pub equal: StormRun,
    /// …
    pub decorrelated: StormRun,
}

/// One storm run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StormRun {
    /// Bottom calls (processor calls, refused ones included).
    pub bottom_calls: u64,
    /// Clients whose charge went through.
    pub succeeded: usize,
    /// Time until the last client finished, in ms.
    pub elapsed_ms: f64,
}

/// Prints the report with the design notes' figures beside the measured ones.
pub fn print_report(r: &DemoReport) {
    let a = &r.lost_reply;
    println!("a. A charge of 500 whose reply is lost, then retried");
    println!(
        "   with a fresh key:  {} executions, balance {}        (design notes: 2 executions, balance 1000)",
        a.fresh_key.executions, a.fresh_key.balance_cents
    );
    println!(
        "   with the same key: {} execution,  balance {}, same charge_id: {}, replayed: {}   (design notes: 1 execution, balance 500, the original reply)",
        a.same_key.executions, a.same_key.balance_cents, a.same_charge_id, a.replayed
    );
    let b = &r.key_reuse;
    println!("b. The same key again with amount 900");
    println!(
        "   {} ; balance {} -> {}, charges {} -> {}   (design notes: refused (422), state unchanged)",
        b.code,
        b.before.balance_cents,
        b.after.balance_cents,
        b.before.executions,
        b.after.executions
    );
    let c = &r.concurrent;
    println!(
        "c. Two concurrent charges with one key, {} ms processor",
        c.processor_delay_ms
    );
    println!(
        "   {} execution, same reply: {}, {:.0} ms   (design notes: 1 execution, same reply, about 0.25 s)",
        c.executions, c.same_reply, c.elapsed_ms
    );
    let d = &r.layered;
    println!("d. One request against a failing processor");
    for (mode, counts, notes) in [
        ("every-layer:", &d.every_layer, "243; 1, 3, 9, 27, 81"),
        ("edge-only:", &d.edge_only, "3"),
    ] {
        let received = format!("{:?}", counts.received);
        println!(
            "   {mode:<12} {:>4} bottom calls, received {received:<18} (design notes: {notes})",
            counts.bottom_calls
        );
    }
    let e = &r.outage;
    println!(
        "e. Total outage: {} requests, up to 4 attempts each",
        e.requests
    );
    for (budget, load, notes) in [
        ("no budget:", e.no_budget, "4.00x"),
        ("default budget:", e.budget, "1.10x"),
    ] {
        println!(
            "   {budget:<15} {:>6} bottom calls = {:.2}x   (design notes: {notes})",
            load.bottom_calls, load.load
        );
    }
    let f = &r.storm;
    println!(
        "f. Contention storm: {} clients, processor serves one charge at a time ({} ms each), every client retries until it succeeds",
        f.clients, f.tick_ms
    );
    println!(
        "   {:<13} {:>12} {:>10} {:>10}   design notes (calls)",
        "backoff", "bottom calls", "time ms", "succeeded"
    );
    for (name, run, notes) in [
        ("none", f.none, 5050),
        ("exponential", f.exponential, 5050),
        ("full", f.full, 643),
        ("equal", f.equal, 657),
        ("decorrelated", f.decorrelated, 576),
    ] {
        println!(
            "   {:<13} {:>12} {:>10.0} {:>10}   {}",
            name, run.bottom_calls, run.elapsed_ms, run.succeeded, notes
        );
    }
    let g = &r.metastability;
    println!(
        "g. Load at {:.0} charges/s (0.8x the {:.0}/s measured), {} for {:.0} s",
        g.offered_rps,
        g.capacity_rps,
        g.trigger,
        g.trigger_s.1 - g.trigger_s.0
    );
    for (t, notes) in [
        (&g.edge_only, "back within 2 s"),
        (&g.every_layer, "stays down, or recovers far later"),
    ] {
        let recovered = t
            .recovered_after_s
            .map_or("not within the run".to_owned(), |s| {
                format!("{s:.2} s after the trigger")
            });
        println!(
            "   {:<12} goodput {:.0}/s before, {:.0}/s at the end; back to 95%: {recovered}; {} bottom calls   (design notes: {notes})",
            t.mode, t.goodput_before_rps, t.goodput_end_rps, t.bottom_calls
        );
    }
}
