//! Drawing a [`ChainView`] with ratatui: a title line with the chain's amplification and
//! the time, a help line, and a table with a row per service. Plain text, a little bold
//! and red, readable in 100×20; [`text`] renders the same frame to a string for `--once`.

use std::time::{SystemTime, UNIX_EPOCH};

use ratatui::{
    Frame, Terminal,
    backend::TestBackend,
    layout::{Constraint, Layout},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Cell, Row, Table},
};

use crate::view::{ChainView, ServiceView};

/// The columns: header, width, whether numbers (right-aligned). Retries take what the
/// others leave (36 columns of 100).
const COLUMNS: [(&str, Constraint, bool); 9] = [
    ("service", Constraint::Length(7), false),
    ("state", Constraint::Length(5), false),
    ("req/s", Constraint::Length(8), true),
    ("ok %", Constraint::Length(6), true),
    ("p50 ms", Constraint::Length(8), true),
    ("p99 ms", Constraint::Length(8), true),
    ("att/call", Constraint::Length(8), true),
    ("retries/s", Constraint::Fill(1), false),
    ("budget", Constraint::Length(6), true),
];

/// Draws `view` into the whole frame; `now` is shown as UTC wall-clock time.
pub fn draw(frame: &mut Frame, view: &ChainView, now: SystemTime) {
    let [title, help, table] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(0),
    ])
    .areas(frame.area());
    frame.render_widget(title_line(view, now), title);
    frame.render_widget(
        Line::from("q quits · rates over the last interval · admin ports as given by --admin")
            .style(Style::new().fg(Color::DarkGray)),
        help,
    );
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let header =
        Row::new(COLUMNS.map(|(name, _, right)| aligned(name.to_owned(), right))).style(bold);
    let rows = view.services.iter().map(row);
    let widths = COLUMNS.map(|(_, width, _)| width);
    frame.render_widget(Table::new(rows, widths).header(header), table);
}

/// Renders `view` as `width` columns of plain text, one line per screen row, trailing
/// blanks trimmed: the same frame the terminal shows, for `--once` and tests.
pub fn text(view: &ChainView, now: SystemTime, width: u16) -> anyhow::Result<String> {
    let height = u16::try_from(view.services.len())
        .unwrap_or(u16::MAX)
        .saturating_add(3);
    let mut terminal = Terminal::new(TestBackend::new(width, height))?;
    terminal.draw(|frame| draw(frame, view, now))?;
    let buffer = terminal.backend().buffer();
    let mut out = String::new();
    for y in 0..buffer.area.height {
        let line: String = (0..buffer.area.width)
            .filter_map(|x| buffer.cell((x, y)))
            .map(|cell| cell.symbol())
            .collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    Ok(out)
}

/// `retrychain top 12:00:01 UTC · amplification 243.0 (243 bottom calls / 1 edge request,
/// last 10 s)`: the clock first, so that a narrow terminal cuts only the detail.
fn title_line(view: &ChainView, now: SystemTime) -> Line<'static> {
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let window = format!("last {:.0} s", view.window_s);
    let (figure, detail) = match &view.amplification {
        Some(a) => (
            format!("amplification {:.1}", a.ratio()),
            format!(
                " ({} bottom calls / {} edge request{}, {window})",
                a.bottom_calls,
                a.edge_requests,
                if a.edge_requests == 1.0 { "" } else { "s" }
            ),
        ),
        None => (
            "amplification -".to_owned(),
            format!(" (no edge request, {window})"),
        ),
    };
    Line::from(vec![
        Span::styled("retrychain top", bold),
        Span::raw(format!(" {} · ", clock(now))),
        Span::styled(figure, bold),
        Span::raw(detail),
    ])
}

/// One service's row; a service that did not answer shows `down` in red.
fn row(service: &ServiceView) -> Row<'static> {
    let rates = service.rates.as_ref();
    let number = |value: Option<f64>, scale: f64, decimals: usize| {
        value.map_or_else(|| "-".to_owned(), |v| format!("{:.decimals$}", v * scale))
    };
    let retries = rates.map_or_else(
        || "-".to_owned(),
        |r| {
            let parts: Vec<String> = r
                .retries_per_s
                .iter()
                .map(|(reason, rate)| format!("{reason} {rate:.1}"))
                .chain(
                    r.refused_per_s
                        .iter()
                        .map(|(by, rate)| format!("refused:{by} {rate:.1}")),
                )
                .collect();
            if parts.is_empty() {
                "0".to_owned()
            } else {
                parts.join(", ")
            }
        },
    );
    let cells = [
        service.name.clone(),
        if service.up { "up" } else { "down" }.to_owned(),
        number(rates.map(|r| r.requests_per_s), 1.0, 1),
        number(rates.and_then(|r| r.success_ratio), 100.0, 1),
        number(rates.and_then(|r| r.p50_s), 1000.0, 1),
        number(rates.and_then(|r| r.p99_s), 1000.0, 1),
        number(rates.and_then(|r| r.attempts_per_call), 1.0, 2),
        retries,
        number(service.budget_tokens, 1.0, 1),
    ];
    let row = Row::new(
        cells
            .into_iter()
            .zip(COLUMNS)
            .map(|(cell, (_, _, right))| aligned(cell, right)),
    );
    if service.up {
        row
    } else {
        row.style(Style::new().fg(Color::Red))
    }
}

/// A cell, right-aligned when it holds a number.
fn aligned(content: String, right: bool) -> Cell<'static> {
    let line = Line::from(content);
    Cell::from(if right { line.right_aligned() } else { line })
}

/// `HH:MM:SS UTC` (no time-zone database needed).
fn clock(now: SystemTime) -> String {
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::view::{Amplification, Rates};

    #[test]
    fn a_frame_fits_100_columns_with_amplification_rates_and_a_down_service() {
        let up = |name: &str| ServiceView {
            name: name.to_owned(),
            up: true,
            rates: Some(Rates {
                requests_per_s: 2.0,
                success_ratio: Some(0.5),
                p50_s: Some(0.003),
                p99_s: Some(0.0095),
                attempts_per_call: Some(3.0),
                retries_per_s: vec![("UNAVAILABLE".to_owned(), 4.0)],
                refused_per_s: vec![],
            }),
            budget_tokens: None,
        };
        let view = ChainView {
            services: vec![
                ServiceView {
                    budget_tokens: Some(7.5),
                    ..up("edge")
                },
                up("hop2"),
                ServiceView {
                    name: "ledger".to_owned(),
                    up: false,
                    rates: None,
                    budget_tokens: None,
                },
            ],
            amplification: Some(Amplification {
                bottom_calls: 243.0,
                edge_requests: 1.0,
            }),
            window_s: 10.0,
        };
        let at = UNIX_EPOCH + Duration::from_secs(86_400 + 3600 + 61);
        let text = text(&view, at, 100).unwrap();
        println!("{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "retrychain top 01:01:01 UTC · amplification 243.0 (243 bottom calls / 1 edge request, last 10 s)"
        );
        assert!(lines[2].starts_with("service state"), "{}", lines[2]);
        assert!(lines[3].starts_with("edge    up"), "{}", lines[3]);
        for figure in [
            "2.0",
            "50.0",
            "3.0",
            "9.5",
            "3.00",
            "UNAVAILABLE 4.0",
            "7.5",
        ] {
            assert!(lines[3].contains(figure), "{figure} in {}", lines[3]);
        }
        assert!(lines[5].starts_with("ledger  down"), "{}", lines[5]);
        assert!(lines.iter().all(|l| l.chars().count() <= 100));
    }
}
