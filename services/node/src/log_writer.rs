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
//! Nothing is dropped: past [`BACKLOG_BYTES`] (stdout not being drained), the task that
//! logs writes the backlog out itself and so waits for the reader, as a blocking writer
//! would. Lines reach stdout in the order they were logged: a batch is taken from the
//! buffer and written under one lock. [`Flusher`], dropped at the end of `main`, writes
//! out the last lines (waiting at most [`SHUTDOWN_WAIT`] for a stdout that is not being
//! read); a line logged after that is written by the task that logs it. A process killed
//! outright loses the lines not yet written: the last [`FLUSH_EVERY`] of them while stdout
//! keeps up.

use std::{
    io::Write,
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    thread::JoinHandle,
    time::Duration,
};

use tracing_subscriber::fmt::MakeWriter;

/// The longest a line waits in memory.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);

/// A batch this large wakes the writer thread before its time.
pub const BATCH_BYTES: usize = 64 * 1024;

/// Past this many bytes not yet written, a task that logs writes them out itself.
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
}

/// See [`Shared::pending`].
#[derive(Default)]
struct Pending {
    /// The bytes of whole lines.
    lines: Vec<u8>,
    /// Set by [`Flusher`]'s drop.
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
        Self::to(Box::new(std::io::stdout()))
    }

    /// A writer to `out` (stdout but in tests), and its guard.
    pub fn to(out: Box<dyn Write + Send>) -> (Self, Flusher) {
        let shared = Arc::new(Shared {
            pending: Mutex::default(),
            wake: Condvar::new(),
            out: Mutex::new(out),
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

    /// The writer thread: a batch every [`FLUSH_EVERY`], or sooner when woken.
    fn run(&self) {
        let mut spare = Vec::with_capacity(BATCH_BYTES);
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
            pending.lines.extend_from_slice(line);
            (pending.lines.len(), pending.stop)
        };
        if stopped || backlog >= BACKLOG_BYTES {
            // After the flusher stopped (a task still logging at exit), or when the writer
            // thread is not keeping up (stdout not drained): write here, waiting for the
            // reader rather than growing without bound or dropping lines.
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
        let mut next = [0usize; 4];
        for line in text.lines() {
            let mut words = line.split(' ');
            let t: usize = words.nth(1).expect("thread").parse().expect("number");
            let i: usize = words.nth(1).expect("line").parse().expect("number");
            assert_eq!(i, next[t], "thread {t}'s lines out of order or lost");
            next[t] += 1;
        }
        assert_eq!(next, [40_000; 4]);
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
