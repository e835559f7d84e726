//! A watchdog over collectives that complete asynchronously. NCCL's are enqueued on a CUDA stream
//! and return at once: a rank whose peer died, hangs or never calls the same collective would
//! wait in its next synchronisation forever. Each collective in flight is watched through a probe
//! of its completion (a CUDA event recorded after it); a thread looks at the oldest every poll
//! interval, and the first one still incomplete past the timeout is handed to `on_stuck`, once
//! (NCCL's: read the communicator's asynchronous error, abort it, exit with one line naming the
//! collective and the rank), as PyTorch's NCCL watchdog does. The TCP ring needs none: each of
//! its reads and writes times out by itself.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A collective still incomplete past the timeout.
#[derive(Debug)]
pub struct Stuck {
    /// The collective, as named when it was watched ("all-reduce of 1024 bf16 values").
    pub what: String,
    /// How long it has been in flight.
    pub waited: Duration,
}

/// One collective in flight.
struct InFlight {
    what: String,
    started: Instant,
    done: Box<dyn Fn() -> bool + Send>,
}

#[derive(Default)]
struct State {
    /// In the order they were enqueued (on one stream, the order they complete in).
    in_flight: VecDeque<InFlight>,
    stop: bool,
}

/// Watches collectives in flight on a thread of its own; stops when dropped.
pub struct Watchdog {
    shared: Arc<(Mutex<State>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching: every `poll` (at most), a collective in flight longer than `timeout` is
    /// handed to `on_stuck` and the watch ends.
    pub fn start(timeout: Duration, poll: Duration, on_stuck: impl FnOnce(Stuck) + Send + 'static) -> Self {
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let watched = shared.clone();
        let thread = std::thread::Builder::new()
            .name("collective-watchdog".into())
            .spawn(move || {
                if let Some(stuck) = watch(&watched, timeout, poll) {
                    on_stuck(stuck);
                }
            })
            .expect("the OS refused a thread for the collective watchdog");
        Self { shared, thread: Some(thread) }
    }

    /// Watches a collective just enqueued: `done` says whether it has completed.
    pub fn watch(&self, what: impl Into<String>, done: impl Fn() -> bool + Send + 'static) {
        let mut state = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        state.in_flight.push_back(InFlight { what: what.into(), started: Instant::now(), done: Box::new(done) });
    }

    /// Collectives watched and not yet seen complete.
    pub fn in_flight(&self) -> usize {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).in_flight.len()
    }
}

/// The watch loop: drops completed collectives from the front, returns the first one past
/// `timeout`, or `None` once stopped.
fn watch(shared: &(Mutex<State>, Condvar), timeout: Duration, poll: Duration) -> Option<Stuck> {
    let (lock, wake) = shared;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        while state.in_flight.front().is_some_and(|c| (c.done)()) {
            state.in_flight.pop_front();
        }
        if let Some(oldest) = state.in_flight.front() {
            let waited = oldest.started.elapsed();
            if waited > timeout {
                return Some(Stuck { what: oldest.what.clone(), waited });
            }
        }
        if state.stop {
            return None;
        }
        state = wake.wait_timeout(state, poll).unwrap_or_else(|e| e.into_inner()).0;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        self.shared.1.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How often a watchdog with `timeout` looks: a tenth of it, between 10 ms and a second.
pub fn poll_interval(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;

    /// A collective that never completes is reported once, past the timeout and not before,
    /// by its name; completed ones ahead of it are dropped and never reported.
    #[test]
    fn a_collective_past_the_timeout_is_reported_once_by_name() {
        let (tx, rx) = mpsc::channel();
        let started = Instant::now();
        let dog = Watchdog::start(Duration::from_millis(200), Duration::from_millis(10), move |stuck| {
            tx.send(stuck).unwrap();
        });
        dog.watch("all-reduce of 4 f32 values", || true);
        dog.watch("all-gather of 8 bf16 values", || false);
        let stuck = rx.recv_timeout(Duration::from_secs(10)).expect("the stuck collective is reported");
        assert_eq!(stuck.what, "all-gather of 8 bf16 values");
        assert!(stuck.waited > Duration::from_millis(200) && started.elapsed() >= Duration::from_millis(200));
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "reported once");
    }

    /// Collectives that complete within the timeout are never reported, and the watch ends
    /// when the watchdog is dropped (no thread left behind).
    #[test]
    fn completed_collectives_are_dropped_and_never_reported() {
        let (tx, rx) = mpsc::channel();
        let dog = Watchdog::start(Duration::from_millis(100), Duration::from_millis(5), move |stuck| {
            tx.send(stuck).unwrap();
        });
        let finished = Arc::new(AtomicBool::new(false));
        let flag = finished.clone();
        dog.watch("reduce-scatter", move || flag.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(dog.in_flight(), 1, "still running");
        finished.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(10);
        while dog.in_flight() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(dog.in_flight(), 0, "seen complete");
        std::thread::sleep(Duration::from_millis(200));
        drop(dog);
        // The watch thread has ended (joined by the drop), and with it the sender it held.
        assert_eq!(rx.try_recv().unwrap_err(), mpsc::TryRecvError::Disconnected, "nothing reported");
    }

    #[test]
    fn the_poll_interval_follows_the_timeout_within_bounds() {
        assert_eq!(poll_interval(Duration::from_secs(300)), Duration::from_secs(1));
        assert_eq!(poll_interval(Duration::from_secs(2)), Duration::from_millis(200));
        assert_eq!(poll_interval(Duration::from_millis(1)), Duration::from_millis(10));
    }
}
