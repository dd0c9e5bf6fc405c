//! The admission tests: the estimate, the limit, fair shares and the layer.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio::time::Instant;
use tonic::Code;

use super::*;
use crate::wire;

/// Feeds `windows` windows of 8 answers each, 10 ms apart, at `latency`, each admitted
/// with `in_flight` calls in flight; the estimate after, in seconds.
fn run(d: &mut Drain, now: &mut Instant, windows: u32, latency: Duration, in_flight: usize) -> f64 {
    for _ in 0..windows {
        *now += Duration::from_millis(10);
        for _ in 0..8 {
            d.answered(*now, latency, in_flight, Outcome::Served);
        }
    }
    d.per_call().expect("measured")
}

/// [`run`], the answers failures below.
fn fail(
    d: &mut Drain,
    now: &mut Instant,
    windows: u32,
    latency: Duration,
    in_flight: usize,
) -> f64 {
    for _ in 0..windows {
        *now += Duration::from_millis(10);
        for _ in 0..8 {
            d.answered(*now, latency, in_flight, Outcome::Failed);
        }
    }
    d.per_call().expect("measured")
}

#[test]
fn a_stall_whose_calls_all_fail_is_believed_at_once() {
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    run(&mut d, &mut now, 30, Duration::from_micros(3200), 32);
    // Every call fails after its 5 s, 32 in flight: nothing else says how fast it drains.
    let per_call = fail(&mut d, &mut now, 1, Duration::from_secs(5), 32);
    assert!((per_call - 5.0 / 32.0).abs() < 1e-9, "{per_call}");
}

#[test]
fn an_outages_failures_are_forgotten_once_calls_are_served_again() {
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    run(&mut d, &mut now, 30, Duration::from_micros(3200), 32);
    // Every layer retrying a processor that is down: 7 s to fail, 8 in flight.
    let outage = fail(&mut d, &mut now, 20, Duration::from_secs(7), 8);
    assert!((outage - 7.0 / 8.0).abs() < 1e-9, "{outage}");
    // The first window served after it is believed whole, not an EWMA's step toward it
    // (a fifth of the way a window: about 72 windows to come within 0.1% of it).
    let per_call = run(&mut d, &mut now, 1, Duration::from_micros(3200), 32);
    assert!((per_call - 100e-6).abs() < 1e-9, "{per_call}");
    // A faster figure after served calls is still believed gradually.
    let per_call = run(&mut d, &mut now, 1, Duration::from_micros(1600), 32);
    assert!((per_call - 90e-6).abs() < 1e-9, "{per_call}");
}

#[test]
fn failures_beside_as_many_served_calls_do_not_move_the_estimate() {
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    run(&mut d, &mut now, 30, Duration::from_micros(3200), 32);
    for _ in 0..30 {
        now += Duration::from_millis(10);
        for _ in 0..4 {
            d.answered(now, Duration::from_micros(3200), 32, Outcome::Served);
            d.answered(now, Duration::from_secs(2), 32, Outcome::Failed);
        }
    }
    let per_call = d.per_call().expect("measured");
    assert!((per_call - 100e-6).abs() < 1e-9, "{per_call}");
}

#[test]
fn a_window_of_mostly_timeouts_is_measured_on_all_its_answers() {
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    run(&mut d, &mut now, 30, Duration::from_micros(3200), 32);
    // A slowdown: one call in eight still served, the others queued until their 5 s.
    now += Duration::from_millis(10);
    d.answered(now, Duration::from_micros(3200), 32, Outcome::Served);
    for _ in 0..7 {
        d.answered(now, Duration::from_secs(5), 32, Outcome::Failed);
    }
    let per_call = d.per_call().expect("measured");
    let expected = (3.2e-3 + 7.0 * 5.0) / (8.0 * 32.0);
    assert!((per_call - expected).abs() < 1e-9, "{per_call}");
    assert!(d.of_failures());
}

#[test]
fn a_drop_beside_served_calls_raises_the_estimate() {
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    run(&mut d, &mut now, 30, Duration::from_micros(3200), 32);
    now += Duration::from_millis(10);
    for _ in 0..7 {
        d.answered(now, Duration::from_micros(3200), 32, Outcome::Served);
    }
    // Refused below: twice a budget of 1.25 s.
    d.answered(now, Duration::from_millis(2500), 32, Outcome::Dropped);
    let per_call = d.per_call().expect("measured");
    let expected = (7.0 * 3.2e-3 + 2.5) / (8.0 * 32.0);
    assert!((per_call - expected).abs() < 1e-9, "{per_call}");
}

#[test]
fn a_saturated_server_is_measured_by_its_drain_rate() {
    // One call per 100 µs, whatever the queue: latency = calls in flight × 0.1 ms.
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    for in_flight in [10, 100, 1000, 40] {
        let latency = Duration::from_micros(100 * in_flight as u64);
        let per_call = run(&mut d, &mut now, 30, latency, in_flight);
        assert!((per_call - 100e-6).abs() < 1e-6, "{per_call}");
        assert_eq!(d.per_call(), Some(per_call));
    }
}

#[test]
fn an_unsaturated_server_predicts_its_own_latency() {
    // 2 ms whatever the load, 4 in flight: 0.5 ms a call in flight, so a fifth call is
    // predicted 2.5 ms — its latency and a little, not the queue of a busy server.
    let mut now = Instant::now();
    let mut d = Drain::new(AdmissionSettings::default(), now);
    let per_call = run(&mut d, &mut now, 50, Duration::from_millis(2), 4);
    assert!((per_call * 5.0 - 2.5e-3).abs() < 1e-5, "{per_call}");
}

/// As if `per_call` had been measured with calls up to the ceiling in flight.
fn measured(limit: &ConcurrencyLimit, per_call: Duration) {
    limit
        .per_call_ns
        .store(per_call.as_nanos() as u64, Ordering::Relaxed);
    limit.measured_at.store(4096, Ordering::Relaxed);
}

/// A door whose estimate, 1 ms a call in flight, was measured with 20 calls in flight: it
/// is trusted to 40, though 4,000 would fit a 5 s deadline's budget.
fn door_measured_at_20() -> Arc<ConcurrencyLimit> {
    let door = AdmissionSettings {
        door: true,
        ..AdmissionSettings::default()
    };
    let limit = Arc::new(ConcurrencyLimit::new(door));
    measured(&limit, Duration::from_millis(1));
    limit.measured_at.store(20, Ordering::Relaxed);
    limit
}

#[test]
fn a_burst_far_past_what_was_measured_is_admitted_as_it_is_measured() {
    let limit = door_measured_at_20();
    let mut held: Vec<Admitted> = (0..40)
        .map(|_| {
            limit
                .try_admit(first(5000))
                .expect("within twice the measure")
        })
        .collect();
    let refused = limit.try_admit(first(5000)).expect_err("past it");
    assert!(
        refused.message().contains("measured"),
        "{}",
        refused.message()
    );
    assert_eq!(
        wire::pushback(&refused),
        wire::Pushback::RetryAfter(Duration::from_millis(20)),
        "come back when those measured have drained"
    );
    // The answers of calls admitted with 40 in flight move the bound to 80.
    limit.measured_at.store(40, Ordering::Relaxed);
    held.extend((40..80).map(|_| limit.try_admit(first(5000)).expect("measured further")));
    assert!(limit.try_admit(first(5000)).is_err());
    drop(held);
}

fn first(time_ms: u64) -> Ask {
    Ask::first(Some(Duration::from_millis(time_ms)))
}

#[test]
fn everything_that_fits_its_deadline_is_admitted_however_deep_the_queue() {
    // 1,000 calls a second and a 5 s deadline: 1,500 at once wait 1.5 s each. Queueing,
    // not overload: every one is admitted (a latency target would have refused most).
    let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
    measured(&limit, Duration::from_millis(1));
    let held: Vec<Admitted> = (0..1500)
        .map(|_| limit.try_admit(first(5000)).expect("fits its deadline"))
        .collect();
    assert_eq!(limit.in_flight(), 1500);
    assert_eq!(limit.shed(), (0, 0));
    drop(held);
    assert_eq!(limit.in_flight(), 0);
}

#[test]
fn a_call_that_cannot_fit_its_deadline_is_refused_at_once_retries_first() {
    let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
    // 10 ms a call in flight, 1 s each: 100 fit, retries until 75.
    measured(&limit, Duration::from_millis(10));
    let mut held: Vec<Admitted> = (0..75)
        .map(|_| limit.try_admit(first(1000)).expect("fits"))
        .collect();
    let retry = Ask {
        priority: Priority::Retry,
        ..first(1000)
    };
    let refused = limit
        .try_admit(retry)
        .expect_err("a retry is refused first");
    assert!(
        refused.message().contains("retries"),
        "{}",
        refused.message()
    );
    held.extend((75..100).map(|_| limit.try_admit(first(1000)).expect("first attempts fit")));
    let refused = limit
        .try_admit(first(1000))
        .expect_err("the 101st would take 1.01 s");
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(
        refused.message().contains("overloaded"),
        "{}",
        refused.message()
    );
    assert!(wire::is_overloaded(
        &refused.metadata().clone().into_headers()
    ));
    assert_eq!(
        wire::pushback(&refused),
        wire::Pushback::RetryAfter(Duration::from_millis(10)),
        "come back when about that much more has drained"
    );
    // A call with a longer deadline still fits.
    held.push(limit.try_admit(first(2000)).expect("2 s leave room"));
    assert_eq!(limit.shed(), (1, 1));
    assert_eq!(limit.limit(), 200, "the last call's 2 s at 10 ms a call");
}

#[test]
fn a_latency_objective_bounds_the_queue_whatever_the_deadline() {
    let settings = AdmissionSettings {
        latency_objective: Some(Duration::from_millis(100)),
        ..AdmissionSettings::default()
    };
    let limit = Arc::new(ConcurrencyLimit::new(settings));
    measured(&limit, Duration::from_millis(1));
    let held: Vec<Admitted> = (0..100)
        .map(|_| {
            limit
                .try_admit(first(60_000))
                .expect("within the objective")
        })
        .collect();
    assert!(limit.try_admit(first(60_000)).is_err());
    drop(held);
}

#[test]
fn the_min_and_max_bound_it_whatever_is_measured() {
    let settings = AdmissionSettings {
        min_limit: 20,
        max_limit: 50,
        ..AdmissionSettings::default()
    };
    let limit = Arc::new(ConcurrencyLimit::new(settings));
    measured(&limit, Duration::from_secs(1));
    // 20 always go in, even predicted far past their deadline ...
    let mut held: Vec<Admitted> = (0..20)
        .map(|_| limit.try_admit(first(10)).expect("under the floor"))
        .collect();
    assert!(limit.try_admit(first(10)).is_err());
    // ... and never more than 50, however long the deadline.
    measured(&limit, Duration::from_nanos(1));
    held.extend((20..50).map(|_| limit.try_admit(first(10)).expect("fits")));
    let refused = limit.try_admit(first(60_000)).expect_err("the ceiling");
    assert!(
        refused.message().contains("most at once"),
        "{}",
        refused.message()
    );
}

#[test]
fn a_caller_under_its_share_is_never_refused_because_another_holds_more() {
    let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::default()));
    // 10 ms a call in flight and 1 s: 100 calls fit.
    measured(&limit, Duration::from_millis(10));
    let (greedy, light) = (CallerKey::of("greedy"), CallerKey::of("light"));
    let ask = |caller| Ask {
        caller: Some(caller),
        ..first(1000)
    };
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..600 {
        match limit.try_admit(ask(greedy)) {
            Ok(admitted) => held.push(admitted),
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable);
                assert!(matches!(
                    wire::pushback(&status),
                    wire::Pushback::RetryAfter(_)
                ));
                refused += 1;
            }
        }
    }
    assert_eq!(held.len(), 100, "the greedy caller fills what fits");
    assert_eq!(refused, 500);
    // Full, yet the light caller's calls, one at a time, all go in.
    for _ in 0..1000 {
        let call = limit.try_admit(ask(light)).expect("under its share");
        drop(call);
    }
    // While it holds one, the greedy caller (at 100, over its share of 50) is refused.
    let one = limit.try_admit(ask(light)).expect("under its share");
    assert!(limit.try_admit(ask(greedy)).is_err());
    assert_eq!(limit.held_by(light), 1);
    drop(one);
    drop(held);
    assert_eq!(limit.held_by(greedy), 0);
    assert_eq!(limit.in_flight(), 0);
}

#[test]
fn retries_are_refused_before_first_attempts_under_a_fixed_limit() {
    let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings::fixed(8)));
    let retry = Ask {
        priority: Priority::Retry,
        ..Ask::first(None)
    };
    let mut held = Vec::new();
    // 6 = 75% of 8: retries fit until then.
    for _ in 0..6 {
        held.push(limit.try_admit(retry).expect("room for retries"));
    }
    let refused = limit.try_admit(retry).expect_err("retries shed first");
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(matches!(
        wire::pushback(&refused),
        wire::Pushback::RetryAfter(_)
    ));
    held.push(
        limit
            .try_admit(Ask::first(None))
            .expect("first attempts fit"),
    );
    held.push(
        limit
            .try_admit(Ask::first(None))
            .expect("first attempts fit"),
    );
    assert!(limit.try_admit(Ask::first(None)).is_err());
    assert_eq!(limit.shed(), (1, 1));
    drop(held);
    assert_eq!(limit.in_flight(), 0);
}

#[test]
fn settings_out_of_order_are_refused() {
    let bad = AdmissionSettings {
        min_limit: 50,
        initial_limit: 10,
        ..AdmissionSettings::default()
    };
    assert!(bad.validated().is_err());
    assert!(AdmissionSettings::default().validated().is_ok());
    for bad in [
        AdmissionSettings {
            retry_share: 0.0,
            ..AdmissionSettings::default()
        },
        AdmissionSettings {
            headroom: 1.5,
            ..AdmissionSettings::default()
        },
        AdmissionSettings {
            latency_objective: Some(Duration::ZERO),
            ..AdmissionSettings::default()
        },
        AdmissionSettings {
            headroom: 0.8,
            wait_share: 0.25,
            ..AdmissionSettings::default()
        },
        AdmissionSettings {
            wait_share: -0.1,
            ..AdmissionSettings::default()
        },
    ] {
        assert!(bad.validated().is_err(), "{bad:?}");
    }
}

/// The edge's settings: a quarter of a call's time below, another quarter to wait.
fn door_that_queues() -> Arc<ConcurrencyLimit> {
    let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings {
        headroom: 0.25,
        wait_share: 0.25,
        door: true,
        ..AdmissionSettings::default()
    }));
    // 10 ms a call in flight: a 1 s call's budget (250 ms) fits 25.
    measured(&limit, Duration::from_millis(10));
    limit
}

/// The 25 calls `door_that_queues` fits in a 1 s call's budget, made with `ask`.
fn fill(limit: &Arc<ConcurrencyLimit>, ask: Ask) -> Vec<Admitted> {
    (0..25)
        .map(|_| limit.try_admit(ask).expect("fits"))
        .collect()
}

/// `ask`, told to wait at the door, waiting in line (its task polled once).
async fn in_line(
    limit: &Arc<ConcurrencyLimit>,
    ask: Ask,
) -> tokio::task::JoinHandle<Result<Admitted, Box<tonic::Status>>> {
    assert!(matches!(limit.enter(ask), Entry::Wait), "told to wait");
    let waiting = tokio::spawn(Arc::clone(limit).wait_for_place(ask));
    tokio::task::yield_now().await;
    waiting
}

fn entered(limit: &Arc<ConcurrencyLimit>, ask: Ask) -> &'static str {
    match limit.enter(ask) {
        Entry::Admitted(admitted) => {
            std::mem::forget(admitted);
            "admitted"
        }
        Entry::Refused(_) => "refused",
        Entry::Wait => "wait",
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_that_fits_once_the_queue_drains_waits_at_the_door_and_goes_in_first_come() {
    let limit = door_that_queues();
    let mut held = fill(&limit, first(1000));
    // The 26th would take 260 ms of its 250: not refused, it waits.
    let a = in_line(&limit, first(1000)).await;
    let b = tokio::spawn(Arc::clone(&limit).wait_for_place(first(1000)));
    tokio::task::yield_now().await;
    // A newcomer whose own prediction would fit once a place is free goes behind them.
    assert!(!a.is_finished() && !b.is_finished());
    held.pop();
    assert!(
        matches!(limit.enter(first(1000)), Entry::Wait),
        "behind those waiting"
    );
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    assert!(a.is_finished(), "the longest waiting goes first");
    assert!(!b.is_finished());
    held.push(a.await.unwrap().expect("admitted"));
    held.pop();
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    held.push(b.await.unwrap().expect("admitted next"));
    assert_eq!(limit.in_flight(), 25);
    assert_eq!(limit.shed(), (0, 0), "nothing refused");
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_call_behind_more_than_it_may_wait_for_is_refused_at_once() {
    let limit = door_that_queues();
    let held = fill(&limit, first(1000));
    // A call waiting w goes in once those ahead have drained to a quarter of 1 s − w, so
    // it may be behind what drains in 250 ms + ¾ × 250 ms = 437 ms: 43 calls, 25 in
    // flight, itself and 17 before it waiting.
    let waiting: Vec<_> = (0..18)
        .map(|_| {
            assert_eq!(entered(&limit, first(1000)), "wait");
            tokio::spawn(Arc::clone(&limit).wait_for_place(first(1000)))
        })
        .collect();
    tokio::task::yield_now().await;
    let refused = match limit.enter(first(1000)) {
        Entry::Refused(status) => status,
        other => panic!("the 19th to wait: {other:?}"),
    };
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(
        refused.message().contains("more than the 437 ms it may"),
        "{}",
        refused.message()
    );
    assert!(wire::is_overloaded(
        &refused.metadata().clone().into_headers()
    ));
    // Retries never wait: they go first or not at all.
    let retry = Ask {
        priority: Priority::Retry,
        ..first(1000)
    };
    assert_eq!(entered(&limit, retry), "refused");
    assert_eq!(limit.shed(), (1, 1));
    for waiter in waiting {
        waiter.abort();
    }
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_line_that_did_not_move_while_its_calls_waited_is_refused_not_forced_in() {
    let limit = door_that_queues();
    let held = fill(&limit, first(1000));
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            assert_eq!(entered(&limit, first(1000)), "wait");
            tokio::spawn(Arc::clone(&limit).wait_for_place(first(1000)))
        })
        .collect();
    // Nothing answered in the 250 ms they may wait (the chain below stalled): forced in,
    // they would add to a queue that is not being served; each is refused, saying why.
    tokio::time::advance(Duration::from_millis(251)).await;
    for waiter in waiting {
        let refused = waiter.await.unwrap().expect_err("refused after its wait");
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(
            refused
                .message()
                .contains("no call was answered while this one waited"),
            "{}",
            refused.message()
        );
        assert!(
            refused.message().contains("after waiting 25"),
            "{}",
            refused.message()
        );
        assert!(wire::is_overloaded(
            &refused.metadata().clone().into_headers()
        ));
    }
    assert_eq!(limit.in_flight(), 25);
    assert_eq!(limit.shed(), (3, 0));
    drop(held);
    assert_eq!(
        entered(&limit, first(1000)),
        "admitted",
        "the line is empty"
    );
}

#[tokio::test(start_paused = true)]
async fn calls_that_fail_below_do_not_move_the_line_a_call_whose_wait_is_over_is_judged_by() {
    for fail in [true, false] {
        // The edge's door, with no floor of calls always admitted.
        let limit = Arc::new(ConcurrencyLimit::new(AdmissionSettings {
            min_limit: 1,
            headroom: 0.25,
            wait_share: 0.25,
            door: true,
            ..AdmissionSettings::default()
        }));
        measured(&limit, Duration::from_millis(10));
        let mut held = fill(&limit, first(1000));
        let waiter = in_line(&limit, first(1000)).await;
        // The chain slowed to 100 ms a call: with 5 in flight the waiter (600 ms) still
        // does not fit the quarter of its time.
        measured(&limit, Duration::from_millis(100));
        for _ in 0..20 {
            let call = held.pop().expect("held");
            if fail {
                call.failed()
            } else {
                call.answered()
            }
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished(), "6 × 100 ms do not fit 250 ms");
        tokio::time::advance(Duration::from_millis(251)).await;
        let entered = waiter.await.unwrap();
        if fail {
            // 20 failures below in its wait are a stall, not a line that moved.
            let refused = entered.expect_err("refused after its wait");
            assert!(
                refused
                    .message()
                    .contains("no call was answered while this one waited"),
                "{}",
                refused.message()
            );
        } else {
            // 20 served: about 75 ms behind the 5 in flight, within half its 749 ms left.
            held.push(entered.expect("the line moved"));
        }
        drop(held);
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_whose_wait_is_over_goes_in_if_the_pace_the_line_moved_at_serves_it_in_time() {
    let limit = door_that_queues();
    let held = fill(&limit, first(1000));
    // Waited 250 ms of 1 s: 750 ms left, half of it (375 ms) for its time behind the 25 in
    // flight. 25 answered while it waited: 10 ms each, 260 ms — in, although the estimate
    // would not have let it in.
    let admitted = limit
        .admit_after_waiting(first(1000), Duration::from_millis(250), 25)
        .expect("the line moves fast enough");
    assert_eq!(limit.in_flight(), 26);
    // 13 answered: 19 ms each, 500 ms — refused, with when to come back.
    let refused = limit
        .admit_after_waiting(first(1000), Duration::from_millis(250), 13)
        .expect_err("too slow a pace");
    assert!(
        refused
            .message()
            .contains("13 calls answered while this one waited; at that pace, behind the 26 calls in flight it would take about 519 ms, more than the 375 ms it may"),
        "{}",
        refused.message()
    );
    assert_eq!(
        wire::pushback(&refused),
        wire::Pushback::RetryAfter(Duration::from_millis(144))
    );
    assert_eq!(limit.in_flight(), 26, "a refusal holds no place");
    drop((held, admitted));
}

#[tokio::test(start_paused = true)]
async fn a_caller_under_its_share_does_not_wait_behind_another_callers_queue() {
    let limit = door_that_queues();
    let heavy = CallerKey(1);
    let light = CallerKey(2);
    let ask = |caller| Ask {
        caller: Some(caller),
        ..first(1000)
    };
    let held = fill(&limit, ask(heavy));
    let waiter = in_line(&limit, ask(heavy)).await;
    assert_eq!(
        entered(&limit, ask(light)),
        "admitted",
        "under its share of the 25 that fit"
    );
    waiter.abort();
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_caller_with_calls_waiting_does_not_go_past_them_as_its_calls_are_answered() {
    let limit = door_that_queues();
    let caller = CallerKey(7);
    let ask = Ask {
        caller: Some(caller),
        ..first(1000)
    };
    let mut held = fill(&limit, ask);
    let waiter = in_line(&limit, ask).await;
    assert_eq!(
        limit.held_by(caller),
        26,
        "its calls in flight and the one waiting"
    );
    // One of its calls answered: the place is the waiting call's, not the next one it
    // sends (which, counting only its calls in flight, would be under its share).
    held.pop();
    assert_eq!(entered(&limit, ask), "wait", "behind its own waiting call");
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    held.push(waiter.await.unwrap().expect("the waiting call goes in"));
    assert_eq!(limit.held_by(caller), 25);
    drop(held);
    assert_eq!(limit.held_by(caller), 0);
}

#[tokio::test(start_paused = true)]
async fn a_call_past_what_was_measured_is_refused_at_once_not_let_wait() {
    let limit = door_that_queues();
    limit.measured_at.store(20, Ordering::Relaxed);
    let held: Vec<Admitted> = (0..40)
        .map(|_| {
            limit
                .try_admit(first(5000))
                .expect("within twice the measure")
        })
        .collect();
    // Let wait on an estimate measured 20 deep, its wait would rest on a figure the deep
    // queue may belie: refused at once instead.
    match limit.enter(first(5000)) {
        Entry::Refused(status) => assert!(
            status.message().contains("measured"),
            "{}",
            status.message()
        ),
        other => panic!("{other:?}"),
    }
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn the_first_in_line_woken_before_it_fits_keeps_its_place() {
    let limit = door_that_queues();
    let mut held = fill(&limit, first(1000));
    let a = in_line(&limit, first(1000)).await;
    let b = in_line(&limit, first(1000)).await;
    // The drain slowed: 12.5 ms a call, so 20 fit. One place given back wakes `a`, which
    // still does not fit with 24 in flight.
    measured(&limit, Duration::from_micros(12_500));
    held.pop();
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    assert!(!a.is_finished() && !b.is_finished());
    // Places come free until one fits (19 in flight): the first in line gets it, then the
    // next.
    for _ in 0..5 {
        held.pop();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
    }
    assert!(a.is_finished(), "the first in line goes first");
    assert!(!b.is_finished(), "20 in flight: the next does not fit yet");
    held.push(a.await.unwrap().expect("admitted"));
    held.remove(0);
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    held.push(b.await.unwrap().expect("then the next"));
    assert_eq!(limit.shed(), (0, 0));
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_call_that_waited_is_judged_by_the_time_it_has_left() {
    let limit = door_that_queues();
    let mut held = fill(&limit, first(1000));
    let waiter = in_line(&limit, first(1000)).await;
    // 200 ms later it has 800 left: a quarter is 200 ms, 20 calls at 10 ms, so a place
    // that would have let a fresh call in (25 in flight) is not enough.
    tokio::time::advance(Duration::from_millis(200)).await;
    held.pop();
    tokio::task::yield_now().await;
    tokio::task::yield_now().await;
    assert!(
        !waiter.is_finished(),
        "24 in flight: 250 ms, more than its 200"
    );
    for _ in 0..5 {
        held.pop();
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
    }
    held.push(waiter.await.unwrap().expect("in once 19 are in flight"));
    assert_eq!(limit.in_flight(), 20);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_line_passed_by_callers_under_their_share_is_predicted_to_move_at_the_share_it_gets() {
    let limit = door_that_queues();
    let heavy = Ask {
        caller: Some(CallerKey(1)),
        ..first(1000)
    };
    let mut held = fill(&limit, heavy);
    let mut waiters = Vec::new();
    for _ in 0..5 {
        waiters.push(in_line(&limit, heavy).await);
    }
    assert_eq!(limit.line_share(), 1.0, "no place given yet");
    // Behind 25 in flight and 5 waiting at 10 ms a call: 310 ms of the 437 it may.
    assert_eq!(entered(&limit, heavy), "wait");
    // Every place that comes free goes to a caller under its share, past the line.
    for light in 0..64 {
        drop(held.remove(0));
        let ask = Ask {
            caller: Some(CallerKey(100 + light)),
            ..first(1000)
        };
        match limit.enter(ask) {
            Entry::Admitted(admitted) => held.push(admitted),
            other => panic!("a caller under its share goes in: {other:?}"),
        }
        tokio::task::yield_now().await;
    }
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "the line did not move"
    );
    let share = limit.line_share();
    assert!(share < 0.15, "the line got none of 64 places: {share}");
    // Behind 5 waiting in a line that moves at that share, the same call is now refused at
    // once, saying why, rather than let wait for a turn that would not come in time.
    let refused = match limit.enter(heavy) {
        Entry::Refused(status) => status,
        other => panic!("refused at once: {other:?}"),
    };
    assert_eq!(refused.code(), Code::Unavailable);
    assert!(
        refused.message().contains(
            "behind the 25 calls in flight and 5 calls waiting at the door, which gets 13%"
        ),
        "{}",
        refused.message()
    );
    assert!(wire::is_overloaded(
        &refused.metadata().clone().into_headers()
    ));
    // With no line, the first to wait is behind the calls in flight alone, whatever the
    // share, so that a line can always form and measure its share again (a call told
    // apart from no caller, so that no share lets it in).
    for waiter in waiters {
        waiter.abort();
        let _ = waiter.await;
    }
    tokio::task::yield_now().await;
    assert_eq!(entered(&limit, first(1000)), "wait");
    drop(held);
}

/// The edge's settings, without a wait at the door.
fn edge_door() -> Arc<ConcurrencyLimit> {
    Arc::new(ConcurrencyLimit::new(AdmissionSettings {
        headroom: 0.25,
        door: true,
        ..AdmissionSettings::default()
    }))
}

/// An every-layer outage on `limit`: `n` charges with 30 s to go, every layer retrying a
/// processor that is down for 7 s before each fails.
async fn every_layer_outage(limit: &Arc<ConcurrencyLimit>, n: usize) {
    let outage: Vec<Admitted> = (0..n)
        .map(|_| limit.try_admit(first(30_000)).expect("room"))
        .collect();
    tokio::time::advance(Duration::from_secs(7)).await;
    outage.into_iter().for_each(Admitted::failed);
}

/// `n` charges with 5 s to go, each admitted (`why`: why it must be).
fn charges(limit: &Arc<ConcurrencyLimit>, n: usize, why: &str) -> Vec<Admitted> {
    (0..n)
        .map(|_| limit.try_admit(first(5000)).expect(why))
        .collect()
}

/// `rounds` of `depth` charges at once, served 8 every 10 ms (a window each time).
async fn serve(limit: &Arc<ConcurrencyLimit>, depth: usize, rounds: usize) {
    for _ in 0..rounds {
        let mut served = charges(limit, depth, "room").into_iter();
        while served.len() > 0 {
            tokio::time::advance(Duration::from_millis(10)).await;
            served.by_ref().take(8).for_each(Admitted::answered);
        }
    }
}

/// `limit`'s estimate of the seconds a call in flight adds.
fn per_call(limit: &ConcurrencyLimit) -> Duration {
    Duration::from_nanos(limit.per_call_ns.load(Ordering::Relaxed))
}

#[tokio::test(start_paused = true)]
async fn under_load_through_an_outage_the_first_calls_served_after_it_end_its_refusals() {
    let limit = edge_door();
    // A call that outlasts the outage keeps the edge from going idle.
    let long = limit.try_admit(first(30_000)).expect("room");
    every_layer_outage(&limit, 8).await;
    // Nothing else was answered: 7 s × 8 over 2 + 3 + … + 9 in flight is the estimate.
    assert_eq!(per_call(&limit).as_millis(), 1272);
    // So a 5 s charge's 1.25 s fits none past the 16 always admitted.
    let served = charges(&limit, 15, "the least limit");
    limit
        .try_admit(first(5000))
        .expect_err("the outage's figure refuses it");
    // The chain is back: 8 are served in 20 ms, then 7 more in 40 ms as the long call
    // fails (two windows).
    let mut served = served.into_iter();
    tokio::time::advance(Duration::from_millis(20)).await;
    served.by_ref().take(8).for_each(Admitted::answered);
    tokio::time::advance(Duration::from_millis(20)).await;
    long.failed();
    served.for_each(Admitted::answered);
    // Measured with 16 in flight, 32 go in at once (twice what was measured).
    let back = charges(&limit, 32, "the chain serves again");
    assert_eq!(limit.in_flight(), 32);
    drop(back);
}

#[tokio::test(start_paused = true)]
async fn once_an_outages_calls_are_all_answered_its_failures_refuse_nothing() {
    let limit = edge_door();
    // Served: 16 in flight, 10 and 20 ms each.
    serve(&limit, 16, 4).await;
    assert!(per_call(&limit) < Duration::from_millis(10));
    every_layer_outage(&limit, 8).await;
    // The outage over, nothing in flight: the figure served before it is back (not the
    // outage's 1.5 s a call), and a burst of 32 goes in at once.
    assert!(per_call(&limit) < Duration::from_millis(10));
    drop(charges(&limit, 32, "the chain serves again"));
}

#[tokio::test(start_paused = true)]
async fn after_an_outage_the_depth_served_before_it_is_proven_again() {
    let limit = edge_door();
    // Served: 64 in flight, 10 to 80 ms each.
    serve(&limit, 64, 2).await;
    assert_eq!(limit.measured_at.load(Ordering::Relaxed), 64);
    every_layer_outage(&limit, 8).await;
    // Idle after it: the figure served before, trusted to twice the least limit, not to
    // twice the 64 it was measured at — the outage may not be over.
    let held = charges(&limit, 32, "within twice 16");
    let refused = limit.try_admit(first(5000)).expect_err("past it");
    assert!(
        refused.message().contains("measured draining at most 16"),
        "{}",
        refused.message()
    );
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn an_outage_with_nothing_served_before_it_leaves_the_start_s_limit() {
    let limit = edge_door();
    every_layer_outage(&limit, 8).await;
    // Nothing was served before it: as at a start, the initial limit, for every caller.
    assert_eq!(limit.per_call_ns.load(Ordering::Relaxed), 0);
    assert_eq!(limit.limit(), AdmissionSettings::default().initial_limit);
    let held = charges(&limit, 256, "the initial limit");
    limit.try_admit(first(5000)).expect_err("past it");
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn the_failures_left_in_a_window_at_idle_do_not_make_a_figure_again() {
    let limit = edge_door();
    // 15 charges fail together: the first 8 close a window (a figure of failures), the
    // other 7 are left in the next one, and the edge is idle.
    every_layer_outage(&limit, 15).await;
    assert_eq!(limit.per_call_ns.load(Ordering::Relaxed), 0, "forgotten");
    // The chain is back: the first call served, 20 ms on, is the eighth answer of a window
    // over 10 ms old — with the 7 failures left in it, a figure of 7 s failures again
    // (another call still in flight, so the edge is not idle again).
    let mut two = charges(&limit, 2, "the initial limit");
    tokio::time::advance(Duration::from_millis(20)).await;
    two.pop().expect("two").answered();
    assert_eq!(
        limit.per_call_ns.load(Ordering::Relaxed),
        0,
        "nothing measured yet"
    );
    drop((two, charges(&limit, 32, "the initial limit")));
}
