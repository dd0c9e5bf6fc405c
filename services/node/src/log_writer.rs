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
//! limit nothing is dropped (the limit counts the lines waiting, not the batch the writer
//! thread is writing). A batch whose write fails (stdout closed) is counted as dropped too.
//! Lines reach stdout in the order they were logged: a batch is taken from the buffer and
//! written under one lock. [`Flusher`], dropped as a service stops, writes out the last
//! lines, waiting at most [`SHUTDOWN_WAIT`] for a stdout that is not being read; a line
//! logged after that is written by the task that logs it, or, when the writer thread is
//! still stuck on stdout, dropped and counted, so that a service whose stdout nobody reads
//! still stops. A process killed outright loses the lines not yet written: the last
//! [`FLUSH_EVERY`] of them while stdout keeps up. Should no writer thread start, each task
//! writes its own line and waits for stdout as a blocking writer would.

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
    /// Set by [`Flusher`]'s drop when the writer thread did not finish within
    /// [`SHUTDOWN_WAIT`]: it is stuck on stdout, holding the output, and a line is dropped
    /// rather than waited for.
    abandoned: bool,
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

    /// Writes out whatever is pending, in order with every other batch. False when the
    /// write failed: its lines are counted as dropped (there is nowhere else to say so).
    fn write_out(&self, spare: &mut Vec<u8>) -> bool {
        let mut out = self.out.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::swap(&mut self.pending().lines, spare);
        let mut written = true;
        if !spare.is_empty() {
            if out.write_all(spare).and_then(|()| out.flush()).is_err() {
                let lines = spare.iter().filter(|&&b| b == b'\n').count();
                self.dropped.fetch_add(lines as u64, Ordering::Relaxed);
                written = false;
            }
            spare.clear();
        }
        written
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
            let written = self.write_out(&mut spare);
            let dropped = self.dropped.load(Ordering::Relaxed);
            // Said once stdout takes lines again (a stdout that fails every write would
            // only have this line fail too, again and again).
            if written && dropped > reported {
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
                } else {
                    self.shared.pending().abandoned = true;
                }
            }
            // No thread could be started: write out here.
            None => {
                self.shared.write_out(&mut Vec::new());
            }
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
            // A line alone is never over the limit, however long.
            let full = !pending.lines.is_empty()
                && pending.lines.len() + line.len() > BACKLOG_BYTES
                && !WRITER_THREAD.with(std::cell::Cell::get);
            if pending.abandoned || (full && !pending.stop) {
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
            let _ = self.shared.write_out(&mut Vec::new());
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
    fn every_line_from_every_thread_is_written_once_in_its_order_or_counted_dropped() {
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

        fn text(&self) -> String {
            String::from_utf8(self.kept.0.lock().expect("kept").clone()).expect("utf8")
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

    /// Runs `work` on a thread of its own and waits at most 30 s for it: a line that
    /// waits for a shut output would otherwise hang the test run.
    fn within_30_s<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
        let (done, result) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(work());
        });
        result
            .recv_timeout(Duration::from_secs(30))
            .expect("a line waited for an output that takes nothing")
    }

    /// 100-byte lines, numbered.
    fn line(i: usize) -> String {
        format!("{i:>8} {}\n", "x".repeat(90))
    }

    /// A writer to an output shut from the start.
    fn shut() -> (Gate, BatchedStdout, Flusher) {
        let gate = Gate::default();
        gate.set(true);
        let (writer, flusher) = BatchedStdout::to(Box::new(gate.clone()));
        (gate, writer, flusher)
    }

    /// Lines 0 to `lines`, each written as a task logs it (within 30 s in all).
    fn write_lines(writer: &BatchedStdout, lines: usize) {
        let writing = writer.clone();
        within_30_s(move || {
            for i in 0..lines {
                writing
                    .make_writer()
                    .write_all(line(i).as_bytes())
                    .expect("write");
            }
        });
    }

    #[test]
    fn a_backlog_under_the_limit_loses_nothing_while_stdout_takes_nothing() {
        let (gate, writer, flusher) = shut();
        let lines = BACKLOG_BYTES / line(0).len();
        write_lines(&writer, lines);
        assert_eq!(writer.dropped(), 0);
        gate.set(false);
        drop(flusher);
        let text = gate.text();
        let numbers: Vec<usize> = text
            .lines()
            .map(|l| l.split_whitespace().next().expect("n").parse().expect("n"))
            .collect();
        assert_eq!(
            numbers,
            (0..lines).collect::<Vec<_>>(),
            "every line, in order"
        );
    }

    #[test]
    fn a_stdout_that_takes_nothing_never_holds_a_line_and_the_backlog_is_kept() {
        let (gate, writer, flusher) = shut();
        // Three times the backlog, each line sent as if stdout took it.
        let lines = 3 * BACKLOG_BYTES / line(0).len();
        write_lines(&writer, lines);
        let dropped = writer.dropped() as usize;
        // Dropped past the backlog (and the batch the writer took before the output shut):
        // a full backlog is kept.
        assert!(
            dropped > 0 && dropped <= lines - BACKLOG_BYTES / line(0).len(),
            "{dropped} of {lines} dropped"
        );
        gate.set(false);
        drop(flusher);
        // The batch taken before the output shut, and the backlog, are written.
        let written = gate.text().lines().count();
        assert_eq!(written + dropped, lines);
    }

    #[test]
    fn the_writer_threads_own_line_is_kept_however_full_the_backlog() {
        let (gate, writer, flusher) = shut();
        let lines = 2 * BACKLOG_BYTES / line(0).len();
        write_lines(&writer, lines);
        let dropped = writer.dropped();
        assert!(dropped > 0, "the backlog is full");
        // What the writer thread logs about the lines dropped (its report goes through the
        // subscriber and back here, from that thread).
        let reporting = writer.clone();
        within_30_s(move || {
            WRITER_THREAD.with(|writer| writer.set(true));
            reporting
                .make_writer()
                .write_all(b"lines dropped\n")
                .expect("write");
        });
        assert_eq!(writer.dropped(), dropped, "the report is not dropped");
        gate.set(false);
        drop(flusher);
        assert!(
            gate.text().ends_with("lines dropped\n"),
            "the report is written last"
        );
    }

    #[test]
    fn a_stopping_service_whose_stdout_is_stuck_drops_its_last_lines_rather_than_wait() {
        let (gate, writer, flusher) = shut();
        writer
            .make_writer()
            .write_all(line(0).as_bytes())
            .expect("write");
        // The writer thread takes the line and waits on the shut output past SHUTDOWN_WAIT.
        std::thread::sleep(FLUSH_EVERY * 5);
        drop(flusher);
        let writing = writer.clone();
        within_30_s(move || {
            writing
                .make_writer()
                .write_all(line(1).as_bytes())
                .expect("write");
        });
        assert_eq!(writer.dropped(), 1, "the line after the stop is dropped");
        gate.set(false);
    }

    #[test]
    fn a_batch_that_fails_to_be_written_is_counted_dropped() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }

            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (writer, flusher) = BatchedStdout::to(Box::new(Closed));
        for i in 0..3 {
            writer
                .make_writer()
                .write_all(line(i).as_bytes())
                .expect("write");
        }
        drop(flusher);
        assert_eq!(writer.dropped(), 3);
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
