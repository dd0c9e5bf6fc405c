//! Tests of [`super`]: `balance`.

use super::*;

#[test]
fn reads_urls_and_dns_targets() {
    assert_eq!(
        Downstream::parse("http://a:1, http://b:2/"),
        Ok(Downstream::Urls(vec![
            "http://a:1".into(),
            "http://b:2".into()
        ]))
    );
    assert_eq!(
        Downstream::parse("dns:///hop3:50053"),
        Ok(Downstream::Dns {
            host: "hop3".into(),
            port: 50053
        })
    );
    assert_eq!(
        Downstream::parse("dns:hop3:50053"),
        Ok(Downstream::Dns {
            host: "hop3".into(),
            port: 50053
        })
    );
    for bad in [
        "",
        "dns:///hop3",
        "dns:///hop3:0",
        "dns://8.8.8.8/hop3:1",
        "hop3:50053",
        "ftp://a:1",
    ] {
        assert!(Downstream::parse(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn the_estimate_takes_peaks_at_once_and_forgets_them_slowly() {
    let start = Instant::now();
    let mut load = Load::new();
    load.observe(Duration::from_millis(100), start);
    assert_eq!(load.rtt_ns, 100e6);
    load.observe(Duration::from_millis(1), start + Duration::from_millis(10));
    assert!(
        load.rtt_ns > 99e6,
        "10 ms later a fast answer barely moves it"
    );
    load.observe(Duration::from_millis(1), start + Duration::from_secs(60));
    assert!(
        load.rtt_ns < 2e6,
        "a minute later it has forgotten the peak"
    );
}

#[tokio::test]
async fn a_call_that_tried_some_replicas_goes_to_another_while_one_is_left() {
    let urls: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let balancer = Balancer::with_urls(
        Downstream::Urls(urls.clone()),
        &urls,
        BalanceSettings::default(),
    );
    for _ in 0..100 {
        let tried = Tried::default();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let replica = balancer.shared.pick(Some(&tried)).expect("a replica");
            tried.push(replica.id);
            seen.push(replica.url.clone());
        }
        seen.sort();
        assert_eq!(seen, urls, "three attempts, three replicas");
        // Every one tried: the fourth may go anywhere.
        assert!(balancer.shared.pick(Some(&tried)).is_some());
    }
}

/// A replica nobody has measured yet takes one call at a time until its first answer:
/// its 1 ms default is a guess, and a slow replica would otherwise take a third of the
/// calls until that answer came.
#[tokio::test]
async fn an_unmeasured_replica_takes_one_call_until_its_first_answer() {
    let urls: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let balancer = Balancer::with_urls(
        Downstream::Urls(urls.clone()),
        &urls,
        BalanceSettings::default(),
    );
    let replicas = balancer.shared.current();
    let now = Instant::now();
    for replica in &replicas[..2] {
        replica
            .load
            .lock()
            .unwrap()
            .observe(Duration::from_millis(5), now);
    }
    // The third took one call and has not answered: it takes no other.
    let _probe = InFlight::start(Arc::clone(&replicas[2]));
    let mut held = Vec::new();
    for _ in 0..60 {
        let picked = balancer.shared.pick(None).expect("a replica");
        assert_ne!(
            picked.id, replicas[2].id,
            "the unmeasured one waits for its answer"
        );
        held.push(InFlight::start(picked));
    }
    // Its first answer replaces the default, whatever it was.
    replicas[2]
        .load
        .lock()
        .unwrap()
        .observe(Duration::from_micros(200), Instant::now());
    assert!(replicas[2].load.lock().unwrap().rtt_ns < 300_000.0);
}

#[tokio::test]
async fn the_cheaper_of_two_is_taken() {
    let urls: Vec<String> = (1..=2).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let balancer = Balancer::with_urls(
        Downstream::Urls(urls.clone()),
        &urls,
        BalanceSettings::default(),
    );
    let replicas = balancer.shared.current();
    replicas[0]
        .load
        .lock()
        .unwrap()
        .observe(Duration::from_millis(50), Instant::now());
    for _ in 0..50 {
        let picked = balancer.shared.pick(None).expect("a replica");
        assert_eq!(
            picked.url, urls[1],
            "the slow one is never the cheaper of the two"
        );
    }
}

#[tokio::test]
async fn a_changed_set_keeps_known_replicas_and_their_history() {
    let a = "http://127.0.0.1:1".to_owned();
    let b = "http://127.0.0.1:2".to_owned();
    let c = "http://127.0.0.1:3".to_owned();
    let balancer = Balancer::with_urls(
        Downstream::Urls(vec![a.clone()]),
        &[a.clone(), b.clone()],
        BalanceSettings::default(),
    );
    let before = balancer.shared.current();
    balancer.set_replicas(&[b.clone(), c.clone()]);
    let after = balancer.shared.current();
    assert_eq!(balancer.replicas(), vec![b.clone(), c]);
    assert_eq!(after[0].id, before[1].id, "b is the same replica");
    assert!(after.iter().all(|r| r.url != a), "a left");
}

#[tokio::test(start_paused = true)]
async fn a_replica_failing_on_its_own_is_ejected_then_readmitted_one_at_a_time() {
    let urls: Vec<String> = (1..=3).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let settings = BalanceSettings {
        base_ejection: Duration::from_secs(1),
        ..BalanceSettings::default()
    };
    let balancer = Balancer::with_urls(Downstream::Urls(urls.clone()), &urls, settings);
    let shared = &balancer.shared;
    let replicas = shared.current();
    let ejected = |r: &Replica| r.health.lock().unwrap().ejected_until.is_some();
    for _ in 0..4 {
        shared.record(&replicas[0], Outcome::Failed, Instant::now());
    }
    shared.record(&replicas[0], Outcome::Answered, Instant::now());
    for _ in 0..4 {
        shared.record(&replicas[0], Outcome::Failed, Instant::now());
    }
    assert!(
        !ejected(&replicas[0]),
        "an answer in between starts the count again"
    );
    shared.record(&replicas[0], Outcome::Failed, Instant::now());
    assert!(ejected(&replicas[0]), "five in a row");
    for _ in 0..50 {
        assert_ne!(
            shared.pick(None).unwrap().id,
            replicas[0].id,
            "out of rotation"
        );
    }
    for _ in 0..5 {
        shared.record(&replicas[1], Outcome::Failed, Instant::now());
    }
    assert!(!ejected(&replicas[1]), "10% of three: only one at a time");
    tokio::time::advance(Duration::from_millis(1100)).await;
    shared.pick(None);
    assert!(!ejected(&replicas[0]), "back after its ejection time");
    for _ in 0..5 {
        shared.record(&replicas[0], Outcome::Failed, Instant::now());
    }
    let until = replicas[0].health.lock().unwrap().ejected_until.unwrap();
    assert_eq!(
        until - Instant::now(),
        Duration::from_secs(2),
        "the second ejection lasts twice as long"
    );
}

/// With one replica (a lone ledger whose database is down), or the last one in
/// rotation, nothing is ejected: an ejected last replica would be called anyway.
#[tokio::test(start_paused = true)]
async fn the_last_replica_in_rotation_is_never_ejected() {
    let one = vec!["http://127.0.0.1:1".to_owned()];
    let balancer = Balancer::with_urls(
        Downstream::Urls(one.clone()),
        &one,
        BalanceSettings::default(),
    );
    let replica = balancer.shared.current()[0].clone();
    for _ in 0..20 {
        balancer
            .shared
            .record(&replica, Outcome::Failed, Instant::now());
    }
    assert!(replica.health.lock().unwrap().ejected_until.is_none());
    assert!(
        replica.health.lock().unwrap().spared,
        "the decision was made (and logged)"
    );

    let two: Vec<String> = (1..=2).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let settings = BalanceSettings {
        max_ejection_percent: 100,
        ..BalanceSettings::default()
    };
    let balancer = Balancer::with_urls(Downstream::Urls(two.clone()), &two, settings);
    let replicas = balancer.shared.current();
    for replica in replicas.iter() {
        for _ in 0..5 {
            balancer
                .shared
                .record(replica, Outcome::Failed, Instant::now());
        }
    }
    let ejected = replicas
        .iter()
        .filter(|r| r.health.lock().unwrap().ejected_until.is_some())
        .count();
    assert_eq!(ejected, 1, "the second is the last in rotation");
}

#[tokio::test(start_paused = true)]
async fn a_replica_failing_most_calls_is_ejected_by_its_failure_percentage() {
    let urls: Vec<String> = (1..=5).map(|i| format!("http://127.0.0.1:{i}")).collect();
    let settings = BalanceSettings {
        max_ejection_percent: 40,
        failure_percentage_threshold: 50,
        ..BalanceSettings::default()
    };
    let balancer = Balancer::with_urls(Downstream::Urls(urls.clone()), &urls, settings);
    let shared = &balancer.shared;
    let replicas = shared.current();
    let ejected = |r: &Replica| r.health.lock().unwrap().ejected_until.is_some();
    // Replica 0 fails 3 of 4, never 5 in a row; replica 1 fails 1 of 3 (under 50%);
    // the others answer.
    for round in 0..60 {
        for (i, replica) in replicas.iter().enumerate() {
            let failed = match i {
                0 => round % 4 != 0,
                1 => round % 3 == 0,
                _ => false,
            };
            let outcome = if failed {
                Outcome::Failed
            } else {
                Outcome::Answered
            };
            shared.record(replica, outcome, Instant::now());
        }
    }
    assert!(
        replicas.iter().all(|r| !ejected(r)),
        "not judged before the interval ends"
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    shared.record(&replicas[2], Outcome::Answered, Instant::now());
    let stats = balancer.endpoints();
    let rate = |i: usize| stats[i].failures as f64 / stats[i].calls as f64;
    assert!(rate(0) > 0.5 && rate(1) < 0.5, "{} {}", rate(0), rate(1));
    assert!(ejected(&replicas[0]), "over 50%");
    assert!(!ejected(&replicas[1]), "under 50%");
    assert_eq!(stats[0].ejections, 1);
    // Four judged replicas are fewer than the minimum of five: nobody is ejected.
    let few = Balancer::with_urls(Downstream::Urls(urls[..4].to_vec()), &urls[..4], settings);
    let replicas = few.shared.current();
    for _ in 0..60 {
        for replica in replicas.iter() {
            few.shared.record(replica, Outcome::Failed, Instant::now());
            few.shared
                .record(replica, Outcome::Answered, Instant::now());
        }
        few.shared
            .record(&replicas[0], Outcome::Failed, Instant::now());
    }
    tokio::time::advance(Duration::from_secs(10)).await;
    few.shared
        .record(&replicas[1], Outcome::Answered, Instant::now());
    assert!(replicas.iter().all(|r| !ejected(r)));
}
