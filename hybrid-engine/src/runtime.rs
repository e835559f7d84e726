//! Process setup, called once at the start of `main` (before any thread is spawned) by every
//! binary: the training steps, `chat` and the benchmarks. It installs the panic hook that reports
//! a panic as one line naming it a bug, and tunes the CPU backend.

/// Test hook: set to `main` or `thread`, [`init`] panics on purpose on the main thread or on a
/// worker thread, so that tests can check the panic hook through a real binary. No other value
/// does anything, and nothing else reads it.
pub const TEST_PANIC_ENV: &str = "RLHF_TEST_PANIC";

/// The exit code of a process that panicked (Rust's own for a panic on the main thread).
pub const PANIC_EXIT_CODE: i32 = 101;

/// Configures the process: reports panics as one line ([`install_panic_hook`]), keeps freed memory for reuse ([`retain_freed_memory`]),
/// fixes candle's thread count and shortens its workers' spinning.
///
/// candle 0.11 asks for its thread count before every matmul, and without `RAYON_NUM_THREADS`
/// it re-detects the physical core count by parsing `/proc/cpuinfo` each time: about 50 us per
/// call, 10-15% of a GPT-2 decoding step at batch 1. Setting the variable to the detected count
/// (when neither it nor `CANDLE_NUM_THREADS` is set) gives the same count for the price of an
/// environment lookup.
///
/// candle's element-wise thread pool spins 25,000 times before a worker sleeps, while gemm's
/// rayon threads want the same cores: on a busy 2-core machine the spinning costs about 20% of a
/// GPT-2 training step (3.6 s against 2.9 s at load 5), and shortening it to 2,000 spins costs
/// nothing on a quiet one (1.52-1.62 s against 1.58-1.68 s). `CANDLE_BARRIER_POOL_SPIN_LIMIT`,
/// when set, is kept.
pub fn init() {
    install_panic_hook();
    if !returns_freed_memory() {
        retain_freed_memory();
    }
    // Called at the start of main, before other threads exist to read the environment.
    if !threads_chosen_by_user() {
        // A count an earlier process of ours detected (for its machine, and for itself alone) is
        // detected again here.
        std::env::remove_var("RAYON_NUM_THREADS");
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        std::env::set_var(THREADS_DETECTED_ENV, "1");
    }
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000");
    }
    panic_if_asked_by_a_test();
}

/// Makes any panic, on any thread, print `error: internal error (a bug, please report it):
/// MESSAGE at FILE:LINE` and end the process with code 101; the backtrace follows only when
/// `RUST_BACKTRACE` asks for it. Exiting from the hook matters off the main thread: a panicking
/// rayon worker or spawned thread would otherwise print Rust's multi-line report and leave the
/// process running, or hung, without the work it was doing.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        if CONTAINED.get().is_some_and(|contained| contained()) {
            // A reader boundary catches this one and reports the input as bad.
            return;
        }
        let location = info.location().map_or(String::new(), |l| format!(" at {}:{}", l.file(), l.line()));
        eprintln!("error: internal error (a bug, please report it): {}{location}", panic_message(info.payload()));
        if backtrace_requested(std::env::var("RUST_BACKTRACE").ok().as_deref()) {
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
        }
        std::process::exit(PANIC_EXIT_CODE);
    }));
}

static CONTAINED: std::sync::OnceLock<fn() -> bool> = std::sync::OnceLock::new();

/// Tells the panic hook how to recognise a panic that a reader boundary catches (the `data`
/// crate's `panics::panic_is_contained`, for the parquet crate's panics on malformed files):
/// the hook then stays silent and does not exit, and the boundary reports one error line.
pub fn contain_panics_when(contained: fn() -> bool) {
    let _ = CONTAINED.set(contained);
}

/// The text a panic was raised with, on one line.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string());
    text.replace('\n', " ")
}

/// Whether `RUST_BACKTRACE` asks for a backtrace: set to anything but `0`, as the standard hook reads it.
fn backtrace_requested(rust_backtrace: Option<&str>) -> bool {
    rust_backtrace.is_some_and(|v| v != "0")
}

/// The [`TEST_PANIC_ENV`] hook.
fn panic_if_asked_by_a_test() {
    match std::env::var(TEST_PANIC_ENV).as_deref() {
        Ok("main") => panic!("{TEST_PANIC_ENV}=main: a deliberate panic on the main thread"),
        Ok("thread") => {
            // A worker's panic must end the process from the hook, before join could report it.
            let worker =
                std::thread::spawn(|| panic!("{TEST_PANIC_ENV}=thread: a deliberate panic on a worker thread"));
            let _ = worker.join();
            unreachable!("the panic hook exits the process");
        }
        _ => {}
    }
}

/// "1" beside a RAYON_NUM_THREADS that [`init`] detected rather than the user set: a process
/// that inherits both (a step started by `train`, the ranks' launcher, a host over ssh) detects
/// again instead of keeping a count meant for another process or machine.
pub const THREADS_DETECTED_ENV: &str = "RLHF_THREADS_DETECTED";

/// Whether the user chose candle's thread count (RAYON_NUM_THREADS or CANDLE_NUM_THREADS set,
/// and not by an earlier [`init`]), read once, before [`init`] sets one.
pub fn threads_chosen_by_user() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let var = |name| std::env::var(name).ok();
        user_set_threads(var("RAYON_NUM_THREADS"), var("CANDLE_NUM_THREADS"), var(THREADS_DETECTED_ENV))
    })
}

/// [`threads_chosen_by_user`] of these variables' values.
fn user_set_threads(rayon: Option<String>, candle: Option<String>, detected: Option<String>) -> bool {
    candle.is_some() || (rayon.is_some() && detected.as_deref() != Some("1"))
}

/// The thread count of each of `local_ranks` ranks sharing this machine: its cores divided
/// among them, at least one (torchrun gives its ranks OMP_NUM_THREADS=1 for the same reason:
/// ranks that each use every core fight over them; 1 thread per rank made a 2- and 3-rank SFT
/// test 23% faster on 2 cores than 2 threads per rank). `None` when the user chose a count:
/// every rank keeps it.
pub fn threads_per_rank(local_ranks: usize) -> Option<usize> {
    (!threads_chosen_by_user()).then(|| (threads() / local_ranks.max(1)).max(1))
}

/// candle's thread count, detected once (see [`init`]).
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// `RLHF_RETURN_FREED_MEMORY=1`: freed buffers go back to the kernel as glibc does by default,
/// instead of [`retain_freed_memory`]. A rank's peak RSS is then its live memory rather than its
/// heap's high-water mark (gpt2 at ZeRO-3 on 4 ranks: 0.34x one rank's peak against 0.42x), at the
/// price of page faults on every large buffer (its steps about 1.7x slower, BENCHMARKS.md).
pub const RETURN_FREED_MEMORY_ENV: &str = "RLHF_RETURN_FREED_MEMORY";

fn returns_freed_memory() -> bool {
    std::env::var(RETURN_FREED_MEMORY_ENV).is_ok_and(|v| ["1", "true", "yes", "on"].contains(&v.trim()))
}

/// Keeps freed memory in the process for reuse instead of returning it to the kernel.
///
/// candle allocates a fresh buffer for every op result and frees it when dropped. glibc serves
/// buffers above 32 MiB (a (B*T, V) logits tensor is 100-800 MiB) with a new `mmap` each time, and
/// the kernel zero-fills every page on first touch: measured at about 20% of a tiny-model step in
/// page faults. Serving them from the heap and never trimming it makes steps about 30% faster
/// (BENCHMARKS.md); the price is that RSS stays at its peak, which a training process reaches
/// on its first step anyway (`RLHF_RETURN_FREED_MEMORY=1` keeps glibc's behaviour). Call once at
/// startup, before threads allocate.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; called before other threads
    // exist, it cannot race with allocations.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// RAM plus swap, `None` where it cannot be read.
pub fn machine_memory_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysinfo only writes the struct it is given, which is zero-initialised POD.
        let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
        if unsafe { libc::sysinfo(&mut info) } != 0 {
            return None;
        }
        let unit = u64::from(info.mem_unit.max(1));
        Some((info.totalram as u64).saturating_add(info.totalswap as u64).saturating_mul(unit))
    }
    #[cfg(not(target_os = "linux"))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_count_is_the_users_unless_an_earlier_process_of_ours_detected_it() {
        let some = |v: &str| Some(v.to_string());
        assert!(!user_set_threads(None, None, None));
        assert!(user_set_threads(some("4"), None, None), "the user's RAYON_NUM_THREADS");
        assert!(user_set_threads(None, some("4"), None), "the user's CANDLE_NUM_THREADS");
        assert!(!user_set_threads(some("2"), None, some("1")), "inherited from our own detection");
        assert!(user_set_threads(some("1"), None, some("0")), "a rank's share, set by its launcher");
    }

    #[test]
    fn panic_messages_become_one_line_and_backtraces_follow_rust_backtrace() {
        assert_eq!(panic_message(&"index out of bounds\nsecond line"), "index out of bounds second line");
        assert_eq!(panic_message(&String::from("owned")), "owned");
        assert_eq!(panic_message(&42u8), "a panic without a message");
        assert!(!backtrace_requested(None) && !backtrace_requested(Some("0")));
        assert!(backtrace_requested(Some("1")) && backtrace_requested(Some("full")));
    }
}
