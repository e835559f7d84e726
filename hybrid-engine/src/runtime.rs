//! Process setup for the CPU backend, called once at the start of `main` (before any thread is
//! spawned) by every binary: the training steps, `chat` and the benchmarks.

/// Configures the process: keeps freed memory for reuse ([`crate::memory::retain_freed_memory`]),
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
    crate::memory::retain_freed_memory();
    // Called at the start of main, before other threads exist to read the environment.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000");
    }
}

/// candle's thread count, detected once (see [`init`]).
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}
