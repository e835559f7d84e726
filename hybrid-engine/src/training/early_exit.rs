//! Megatron's early exits from a training loop (`--exit-interval`, `--exit-duration-in-mins`,
//! `--exit-signal-handler`): after an iteration, save a checkpoint and stop, so that a job with a
//! time limit (a SLURM allocation, a preemptible node) ends at a point the same command resumes
//! from. Every rank must stop at the same iteration: the interval is the same everywhere, and the
//! clock and the signal are agreed on by a maximum over the ranks (the caller's collective).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// When to stop early; all off by default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExitPolicy {
    /// Stop after an iteration divisible by this (Megatron's `--exit-interval`).
    pub interval: Option<u64>,
    /// Stop after the first iteration that ends past this much time since the process started
    /// (Megatron's `--exit-duration-in-mins`).
    pub duration: Option<Duration>,
    /// Stop after the iteration during which SIGTERM arrived (Megatron's `--exit-signal-handler`;
    /// [`catch_sigterm`] must have been called).
    pub on_sigterm: bool,
}

/// Why a run stops early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitReason {
    Interval(u64),
    Duration,
    Signal,
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Interval(n) => write!(f, "--exit-interval {n}"),
            Self::Duration => write!(f, "--exit-duration-in-mins reached"),
            Self::Signal => write!(f, "SIGTERM received (--exit-signal-handler)"),
        }
    }
}

impl ExitPolicy {
    /// Whether the policy needs the ranks to agree each iteration (a clock or a signal, which
    /// differ between ranks), so that the caller spends a collective only then.
    pub fn needs_agreement(&self) -> bool {
        self.duration.is_some() || self.on_sigterm
    }

    /// This rank's view after `iteration`, `elapsed` since the process started: the reasons
    /// that only it can see (clock, signal) as a number to take the maximum of over the ranks,
    /// 0 for none, 1 for the clock, 2 for the signal.
    pub fn local_vote(&self, elapsed: Duration) -> f64 {
        if self.on_sigterm && SIGTERM_RECEIVED.load(Ordering::Relaxed) {
            2.0
        } else if self.duration.is_some_and(|limit| elapsed > limit) {
            1.0
        } else {
            0.0
        }
    }

    /// The reason to stop after `iteration`, given the maximum of the ranks' votes.
    pub fn decide(&self, iteration: u64, agreed_vote: f64) -> Option<ExitReason> {
        if agreed_vote >= 2.0 {
            Some(ExitReason::Signal)
        } else if agreed_vote >= 1.0 {
            Some(ExitReason::Duration)
        } else {
            self.interval.filter(|&n| iteration.is_multiple_of(n)).map(ExitReason::Interval)
        }
    }
}

static SIGTERM_RECEIVED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_sigterm(_: libc::c_int) {
    // Only an atomic store: what a signal handler may do.
    SIGTERM_RECEIVED.store(true, Ordering::Relaxed);
}

/// Installs the SIGTERM handler that [`ExitPolicy::on_sigterm`] reads: SIGTERM then no longer
/// kills the process, it asks the loop to save and stop.
pub fn catch_sigterm() -> anyhow::Result<()> {
    let handler: extern "C" fn(libc::c_int) = note_sigterm;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    let previous = unsafe { libc::signal(libc::SIGTERM, handler as libc::sighandler_t) };
    if previous == libc::SIG_ERR {
        anyhow::bail!(
            "cannot install the SIGTERM handler of --exit-signal-handler: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_stops_at_its_iteration_and_the_ranks_vote_decides() {
        let off = ExitPolicy::default();
        assert!(!off.needs_agreement());
        assert_eq!((off.local_vote(Duration::from_secs(1 << 30)), off.decide(1000, 0.0)), (0.0, None));

        let every_5 = ExitPolicy { interval: Some(5), ..off };
        assert!(!every_5.needs_agreement(), "an interval is the same on every rank");
        let stops: Vec<u64> = (1..=12).filter(|&i| every_5.decide(i, 0.0).is_some()).collect();
        assert_eq!(stops, [5, 10]);
        assert_eq!(every_5.decide(10, 0.0), Some(ExitReason::Interval(5)));
        // An interval of 0 (the flag refuses it) stops nowhere: iterations start at 1.
        assert_eq!(ExitPolicy { interval: Some(0), ..off }.decide(3, 0.0), None);

        let hour = ExitPolicy { duration: Some(Duration::from_secs(3600)), ..off };
        assert!(hour.needs_agreement());
        assert_eq!(hour.local_vote(Duration::from_secs(3600)), 0.0, "not yet at the limit itself");
        assert_eq!(hour.local_vote(Duration::from_secs(3601)), 1.0);
        // One rank past the limit stops them all at the same iteration.
        assert_eq!(hour.decide(7, 1.0), Some(ExitReason::Duration));
        assert_eq!(hour.decide(7, 0.0), None);
        // The signal outranks the clock, which outranks the interval.
        let all = ExitPolicy { interval: Some(7), duration: Some(Duration::ZERO), on_sigterm: true };
        assert_eq!(all.decide(7, 2.0), Some(ExitReason::Signal));
        assert_eq!(all.decide(7, 1.0), Some(ExitReason::Duration));
        assert_eq!(all.decide(7, 0.0), Some(ExitReason::Interval(7)));
        // What the run's "exiting program at iteration N: ..." line says.
        let said = [ExitReason::Interval(7), ExitReason::Duration, ExitReason::Signal].map(|r| r.to_string());
        assert_eq!(
            said,
            ["--exit-interval 7", "--exit-duration-in-mins reached", "SIGTERM received (--exit-signal-handler)"]
        );
    }

    #[test]
    fn sigterm_is_caught_and_voted_only_with_the_handler_asked_for() -> anyhow::Result<()> {
        catch_sigterm()?;
        let watching = ExitPolicy { on_sigterm: true, ..ExitPolicy::default() };
        let before = watching.local_vote(Duration::ZERO);
        // SAFETY: raising a signal this process handles.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        assert_eq!((before, watching.local_vote(Duration::ZERO)), (0.0, 2.0), "the process lives on and votes");
        assert_eq!(ExitPolicy::default().local_vote(Duration::ZERO), 0.0, "without --exit-signal-handler: no vote");
        Ok(())
    }
}
