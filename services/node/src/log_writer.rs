//! Where log lines go: gathered in memory and written to stdout in batches by a thread of
//! its own, every [`FLUSH_EVERY`] or sooner when a batch fills.
//!
//! Why not tracing-appender's non-blocking writer (used before): it hands each line to its
//! thread over a channel, so every line can wake that thread — a futex wake, a context
//! switch and a write(2) per line or few lines, about 0.4 writes and 0.5 context switches
//! per request in a relay under load. Here a request's task appends its formatted line to a
//! shared buffer under a lock held for a copy; nothing wakes until the timer does, or a
//! batch reaches [`BATCH_BYTES`].
//!
//! A service never waits for its stdout. Past [`BACKLOG_BYTES`] not yet written (stdout
//! not being read: a log collector stopped, a terminal paused, a pipe nobody drains), new
//! lines are dropped and counted ([`dropped_lines`], `retrychain_log_lines_dropped_total`
//! on `/metrics`) rather than written by the task that logs: a service runs on one thread
//! by default, and one write(2) blocked on a full pipe would stop every call it serves —
//! and its admin port, so its health checks too. The charges are Postgres's record, not the
//! log's; a line says how many were dropped once stdout takes lines again. Before that
//! limit nothing is dropped. Lines reach stdout in the order they were logged: a batch is
//! taken from the buffer and written under one lock. [`Flusher`], dropped at the end of
//! `main`, writes out the last lines (waiting at most [`SHUTDOWN_WAIT`] for a stdout that
//! is not being read); a line logged after that is written by the task that logs it. A
//! process killed outright loses the lines not yet written: the last [`FLUSH_EVERY`] of
//! them while stdout keeps up.

use std::{
    io::Write,
    sync::{
        Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use tracing_subscriber::fmt::MakeWriter;

/// The longest a line waits in memory.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// A batch this large wakes the writer thread before its time.
pub const BATCH_BYTES: usize = 64 * 1024;

/// Past this many bytes not yet written, new lines are dropped (see the module docs).
pub const BACKLOG_BYTES: usize = 4 * 1024 * 1024;

/// The longest the process waits at exit for its last lines to be written: a stdout that
/// nobody reads must not keep a stopped service from ending.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

/// The log writer (a [`MakeWriter`] for the fmt layer); see the module docs.
#[derive(Clone)]
pub struct BatchedStdout {
    /// What it shares with its thread.
    shared: Arc<Shared>,
}

/// The pending lines and the output, shared by the tasks that log and the writer thread.
struct Shared {
    /// Lines formatted and not yet written, and whether the writer thread should stop.
    pending: Mutex<Pending>,
    /// Wakes the writer thread (a full batch, or stop).
    wake: Condvar,
    /// The output; a batch is taken from `pending` and written while this is held, so
    /// batches go out in order.
    out: Mutex<Box<dyn Write + Send>>,
    /// Lines dropped because the backlog was full, since the start.
    dropped: AtomicU64,
}

thread_local! {
    /// Set on the writer thread: the line it logs about dropped lines is never dropped
    /// itself, however full the backlog is again by then.
    static WRITER_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The process's stdout writer, once made: what [`dropped_lines`] reads.
static STDOUT: OnceLock<Arc<Shared>> = OnceLock::new();

/// Log lines this process dropped because stdout was not taking them (see the module
/// docs): the figure `/metrics` shows, 0 before any log writer to stdout exists.
pub fn dropped_lines() -> u64 {
    STDOUT
        .get()
        .map_or(0, |shared| shared.dropped.load(Ordering::Relaxed))
}

/// See [`Shared::pending`].
#[derive(Default)]
struct Pending {
    /// The bytes of whole lines.
    lines: Vec<u8>,
    /// Set by [`Flusher`]'s drop, or when no writer thread could be started: each task
    /// then writes its own line.
    stop: bool,
}

/// Stops the writer thread when dropped, once it has written every line.
#[must_use = "dropping the flusher stops the log writer"]
pub struct Flusher {
    /// What it shares with the writer.
    shared: Arc<Shared>,
    /// The writer thread.
    thread: Option<JoinHandle<()>>,
    /// Says when the writer thread has written its last batch.
    finished: std::sync::mpsc::Receiver<()>,
}

impl BatchedStdout {
    /// A writer to stdout, and the guard that writes out its last lines.
    pub fn stdout() -> (Self, Flusher) {
        let (writer, flusher) = Self::to(Box::new(std::io::stdout()));
        // The first is the process's (`init` makes one; a second would change nothing).
        let _ = STDOUT.set(Arc::clone(&writer.shared));
        (writer, flusher)
    }

    /// Lines this writer dropped (see the module docs).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// A writer to `out` (stdout but in tests), and its guard.
    pub fn to(out: Box<dyn Write + Send>) -> (Self, Flusher) {
        let shared = Arc::new(Shared {
            pending: Mutex::default(),
            wake: Condvar::new(),
            out: Mutex::new(out),
            dropped: AtomicU64::new(0),
        });
        let (finish, finished) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("retrychain-log".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || {
                    shared.run();
                    let _ = finish.send(());
                }
            })
            .ok();
        if thread.is_none() {
            shared.pending().stop = true;
        }
        (
            Self {
                shared: Arc::clone(&shared),
            },
            Flusher {
                shared,
                thread,
                finished,
            },
        )
    }
}

impl Shared {
    /// The pending lines, whoever panicked while holding them (a panic cannot leave a
    /// half-appended line: appending is one `extend_from_slice`).
    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes out whatever is pending, in order with every other batch.
    fn write_out(&self, spare: &mut Vec<u8>) {
        let mut out = self.out.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::swap(&mut self.pending().lines, spare);
        if !spare.is_empty() {
            // Nowhere to report a failed write of the log itself; the next batch tries again.
            let _ = out.write_all(spare).and_then(|()| out.flush());
            spare.clear();
        }
    }

    /// The writer thread: a batch every [`FLUSH_EVERY`], or sooner when woken; after a
    /// batch is written, a line saying how many were dropped since the last such line.
    fn run(&self) {
        WRITER_THREAD.with(|writer| writer.set(true));
        let mut spare = Vec::with_capacity(BATCH_BYTES);
        let mut reported = 0;
        loop {
            let stop = {
                let pending = self.pending();
                let (pending, _) = self
                    .wake
                    .wait_timeout_while(pending, FLUSH_EVERY, |p| {
                        !p.stop && p.lines.len() < BATCH_BYTES
                    })
                    .unwrap_or_else(PoisonError::into_inner);
                pending.stop
            };
            self.write_out(&mut spare);
            let dropped = self.dropped.load(Ordering::Relaxed);
            if dropped > reported {
                // Through the subscriber, so it is a line of the service's format; it
                // comes back here as any other line does (this thread holds no lock now).
                tracing::warn!(
                    dropped = dropped - reported,
                    dropped_total = dropped,
                    "log lines dropped: stdout was not taking them"
                );
                reported = dropped;
            }
            if stop {
                return;
            }
        }
    }
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flusher").finish_non_exhaustive()
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.shared.pending().stop = true;
        self.shared.wake.notify_one();
        match self.thread.take() {
            Some(thread) => {
                // Joined once it has written everything; left behind if stdout is stuck.
                if self.finished.recv_timeout(SHUTDOWN_WAIT).is_ok() {
                    let _ = thread.join();
                }
            }
            // No thread could be started: write out here.
            None => self.shared.write_out(&mut Vec::new()),
        }
    }
}

/// One line's writer ([`BatchedStdout::make_writer`]).
pub struct LineWriter<'a> {
    /// Where the line goes.
    shared: &'a Shared,
}

impl<'a> MakeWriter<'a> for BatchedStdout {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

impl Write for LineWriter<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let (backlog, stopped) = {
            let mut pending = self.shared.pending();
            if !pending.stop
                && pending.lines.len() + line.len() > BACKLOG_BYTES
                && !WRITER_THREAD.with(std::cell::Cell::get)
            {
                // The writer thread is stuck on a stdout nobody reads (or far behind):
                // dropped, not waited for (see the module docs).
                drop(pending);
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(line.len());
            }
            pending.lines.extend_from_slice(line);
            (pending.lines.len(), pending.stop)
        };
        if stopped {
            // After the flusher stopped (a task still logging at exit), or without a
            // writer thread: written here.
            self.shared.write_out(&mut Vec::new());
        } else if backlog >= BATCH_BYTES && backlog - line.len() < BATCH_BYTES {
            self.shared.wake.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output that keeps what was written.
    #[derive(Clone, Default)]
    struct Kept(Arc<Mutex<Vec<u8>>>);

    impl Write for Kept {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("kept").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_from_every_thread_is_written_once_and_in_each_threads_order() {
        let kept = Kept::default();
        let (writer, flusher) = BatchedStdout::to(Box::new(kept.clone()));
        // Enough bytes to pass the batch size and the backlog limit many times.
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let writer = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..40_000 {
                        let line = format!("thread {t} line {i} {}\n", "x".repeat(60));
                        writer
                            .make_writer()
                            .write_all(line.as_bytes())
                            .expect("write");
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("joined");
        }
        drop(flusher);
        let text = String::from_utf8(kept.0.lock().expect("kept").clone()).expect("utf8");
        // Four threads may outrun the writer past the backlog: what is not dropped is
        // written whole, once, and in each thread's order.
        let mut next = [0usize; 4];
        let mut written = 0;
        for line in text.lines() {
            let mut words = line.split(' ');
            let t: usize = words.nth(1).expect("thread").parse().expect("number");
            let i: usize = words.nth(1).expect("line").parse().expect("number");
            assert!(i >= next[t], "thread {t}'s lines out of order or twice");
            next[t] = i + 1;
            written += 1;
        }
        assert_eq!(written + writer.dropped(), 4 * 40_000);
    }

    /// An output whose writes wait while it is shut (a pipe nobody reads).
    #[derive(Clone, Default)]
    struct Gate {
        kept: Kept,
        shut: Arc<(Mutex<bool>, Condvar)>,
    }

    impl Gate {
        fn set(&self, shut: bool) {
            *self.shut.0.lock().expect("gate") = shut;
            self.shut.1.notify_all();
        }
    }

    impl Write for Gate {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            let (shut, opened) = &*self.shut;
            let _open = opened
                .wait_while(shut.lock().expect("gate"), |shut| *shut)
                .expect("gate");
            self.kept.write(bytes)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stdout_that_takes_nothing_never_holds_a_line_and_the_backlog_is_kept() {
        let gate = Gate::default();
        gate.set(true);
        let (writer, flusher) = BatchedStdout::to(Box::new(gate.clone()));
        // Twice the backlog, from this thread: had a line waited for the output, this
        // would never end (the test harness would time it out).
        let line = format!("{}\n", "x".repeat(99));
        let lines = 2 * BACKLOG_BYTES / line.len();
        for _ in 0..lines {
            writer
                .make_writer()
                .write_all(line.as_bytes())
                .expect("write");
        }
        let dropped = writer.dropped() as usize;
        // Dropped past the backlog (and the batch the writer took before the output shut):
        // a full backlog is kept.
        assert!(
            dropped > 0 && dropped <= lines - BACKLOG_BYTES / line.len(),
            "{dropped} of {lines} dropped"
        );
        gate.set(false);
        drop(flusher);
        // The batch taken before the output shut, and the backlog, are written.
        let written = gate.kept.0.lock().expect("kept").len() / line.len();
        assert_eq!(written + dropped, lines);
    }

    #[test]
    fn a_line_logged_after_the_flusher_stopped_is_still_written() {
        let kept = Kept::default();
        let (writer, flusher) = BatchedStdout::to(Box::new(kept.clone()));
        writer.make_writer().write_all(b"before\n").expect("write");
        drop(flusher);
        writer.make_writer().write_all(b"after\n").expect("write");
        assert_eq!(kept.0.lock().expect("kept").as_slice(), b"before\nafter\n");
    }

    #[test]
    fn a_lone_line_is_written_within_the_flush_interval() {
        let kept = Kept::default();
        let (writer, _flusher) = BatchedStdout::to(Box::new(kept.clone()));
        writer
            .make_writer()
            .write_all(b"one line\n")
            .expect("write");
        let started = std::time::Instant::now();
        while kept.0.lock().expect("kept").is_empty() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the line was never written"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(kept.0.lock().expect("kept").as_slice(), b"one line\n");
    }
}
