//! `retrychain top`: a live terminal view of a chain, read from the five services' admin
//! ports (`GET /metrics`) — requests, success, latency, attempts, retries and budget per
//! service, and the chain's amplification (bottom calls per edge request).
//!
//! # Layout
//!
//! - [`scrape`]: one service's `/metrics` over plain HTTP/1.1, parsed into a
//!   [`scrape::Snapshot`] of totals; a service that does not answer is down.
//! - [`view`]: pure arithmetic from snapshots to figures (rates, quantiles from histogram
//!   deltas, amplification over a window); unit-tested with hand-made snapshots.
//! - [`ui`]: a [`view::ChainView`] drawn with ratatui, or rendered to plain text.
//! - here: the flags ([`TopArgs`]) and the loop ([`run`]): scrape all at once every
//!   interval, draw, until `q`, Esc or Ctrl-C; the terminal is restored however it ends.

pub mod scrape;
pub mod ui;
pub mod view;

use std::{
    collections::VecDeque,
    time::{Duration, Instant, SystemTime},
};

use clap::Args;
use ratatui::{
    DefaultTerminal,
    crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers},
};
use tokio::sync::mpsc;

use crate::view::Round;

/// The admin ports of `retrychain up` with its default base port.
const DEFAULT_ADMIN: [&str; 5] = [
    "http://127.0.0.1:51051",
    "http://127.0.0.1:51052",
    "http://127.0.0.1:51053",
    "http://127.0.0.1:51054",
    "http://127.0.0.1:51055",
];

/// Flags of `top`.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// The services' admin addresses, comma-separated, edge first and ledger last (the
    /// amplification divides the last one's bottom calls by the first one's requests).
    #[arg(
        long,
        env = "RETRYCHAIN_TOP_ADMIN",
        value_delimiter = ',',
        default_values = DEFAULT_ADMIN,
    )]
    pub admin: Vec<String>,
    /// Scrape and redraw every this many ms; rates are per second over this interval.
    #[arg(long, env = "RETRYCHAIN_TOP_INTERVAL_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..))]
    pub interval_ms: u64,
    /// The amplification counts the last this many seconds, so that one slow request
    /// retried at every layer shows whole even when it outlasts an interval.
    #[arg(long, env = "RETRYCHAIN_TOP_WINDOW_S", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub window_s: u64,
    /// Print one frame as plain text after one interval and exit (no terminal needed).
    #[arg(long)]
    pub once: bool,
    /// TLS: the operator's material (a directory holding tls.crt, tls.key and ca.crt, as
    /// `up --tls` makes under `operator/`), for https:// admin addresses: each service is
    /// checked against the CA and as its tier, as Prometheus would scrape it.
    #[arg(long, env = "RETRYCHAIN_TOP_TLS_DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
}

/// Runs `top` until `q`, Esc or Ctrl-C, or with `--once` prints one frame.
pub async fn run(args: &TopArgs) -> anyhow::Result<()> {
    let admins: Vec<String> = args
        .admin
        .iter()
        .map(|a| a.trim())
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect();
    anyhow::ensure!(!admins.is_empty(), "--admin names no address");
    let names = names(&admins);
    let tls = match &args.tls_dir {
        Some(dir) => Some(
            retrychain_tls::Tls::load(
                retrychain_tls::TlsFiles::in_dir(dir),
                retrychain_tls::ClientAuth::Optional,
            )
            .map_err(|error| anyhow::anyhow!("--tls-dir {}: {error}", dir.display()))?,
        ),
        None => None,
    };
    let admins = scrape::Scraper::new(admins, tls)?;
    let interval = Duration::from_millis(args.interval_ms);
    let timeout = interval.min(Duration::from_secs(2));
    if args.once {
        let first = scrape_round(&admins, timeout).await;
        tokio::time::sleep(interval).await;
        let second = scrape_round(&admins, timeout).await;
        let view = view::chain(&names, &first, &first, &second);
        print!("{}", ui::text(&view, SystemTime::now(), 100)?);
        return Ok(());
    }
    let mut terminal = ratatui::try_init()?;
    let window = Duration::from_secs(args.window_s);
    let result = live(&mut terminal, &admins, &names, interval, timeout, window).await;
    ratatui::restore();
    result
}

/// The screen's loop: a scrape every `interval`, a redraw after each and on resize.
async fn live(
    terminal: &mut DefaultTerminal,
    admins: &scrape::Scraper,
    names: &[String],
    interval: Duration,
    timeout: Duration,
    window: Duration,
) -> anyhow::Result<()> {
    let (sender, mut input) = mpsc::unbounded_channel();
    // crossterm's event reading blocks: a thread of its own, which ends when `input` is
    // dropped (it looks every 100 ms).
    std::thread::spawn(move || read_keys(&sender));
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Rounds from the window's start to now, oldest first.
    let mut rounds: VecDeque<Round> = VecDeque::new();
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                rounds.push_back(scrape_round(admins, timeout).await);
                // Keep one round at least `window` old, to count the whole window from.
                while rounds.get(1).is_some_and(|r| r.at.elapsed() >= window) {
                    rounds.pop_front();
                }
            }
            key = input.recv() => match key {
                Some(Input::Redraw) => {}
                Some(Input::Failed(error)) => return Err(error.into()),
                Some(Input::Quit) | None => return Ok(()),
            },
            _ = &mut interrupted => return Ok(()),
        }
        let (Some(start), Some(current)) = (rounds.front(), rounds.back()) else {
            continue;
        };
        let previous = rounds.iter().nth_back(1).unwrap_or(current);
        let view = view::chain(names, start, previous, current);
        terminal.draw(|frame| ui::draw(frame, &view, SystemTime::now()))?;
    }
}

/// What the keyboard thread reports.
enum Input {
    /// `q`, Esc or Ctrl-C (in raw mode Ctrl-C is a key, not a signal).
    Quit,
    /// The terminal was resized.
    Redraw,
    /// Reading the terminal failed.
    Failed(std::io::Error),
}

/// Reads key and resize events until the receiver is gone or the user quits.
fn read_keys(sender: &mpsc::UnboundedSender<Input>) {
    while !sender.is_closed() {
        let input = match event::poll(Duration::from_millis(100)).and_then(|ready| {
            if ready {
                event::read().map(Some)
            } else {
                Ok(None)
            }
        }) {
            Ok(Some(Event::Key(key))) if key.kind == KeyEventKind::Press => match key.code {
                KeyCode::Char('q' | 'Q') | KeyCode::Esc => Input::Quit,
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Input::Quit,
                _ => continue,
            },
            Ok(Some(Event::Resize(..))) => Input::Redraw,
            Ok(_) => continue,
            Err(error) => Input::Failed(error),
        };
        let last = !matches!(input, Input::Redraw);
        if sender.send(input).is_err() || last {
            return;
        }
    }
}

/// Scrapes every service once, stamped with the time it finished.
async fn scrape_round(admins: &scrape::Scraper, timeout: Duration) -> Round {
    let snapshots = admins.scrape_all(timeout).await;
    Round {
        at: Instant::now(),
        snapshots,
    }
}

/// A name per position, for services that do not answer: the chain's five names when
/// there are five addresses, else the address.
fn names(admins: &[String]) -> Vec<String> {
    let five = admins.len() == retrychain_harness::NAMES.len();
    admins
        .iter()
        .enumerate()
        .map(|(i, admin)| match retrychain_harness::NAMES.get(i) {
            Some(name) if five => (*name).to_owned(),
            _ => scrape::authority(admin).to_owned(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        top: TopArgs,
    }

    #[test]
    fn the_defaults_are_the_admin_ports_of_up() {
        let cli = Cli::try_parse_from(["top"]).unwrap();
        assert_eq!(cli.top.admin, DEFAULT_ADMIN);
        assert_eq!(cli.top.interval_ms, 1000);
        assert!(!cli.top.once);
        let cli = Cli::try_parse_from(["top", "--admin", "a:1,b:2", "--once"]).unwrap();
        assert_eq!(cli.top.admin, ["a:1", "b:2"]);
        assert_eq!(names(&cli.top.admin), ["a:1", "b:2"]);
        assert_eq!(names(&DEFAULT_ADMIN.map(String::from))[4], "ledger");
    }
}
