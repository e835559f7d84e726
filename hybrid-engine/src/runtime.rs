//! Process setup for the CPU backend, called once at the start of `main` (before any thread is
//! spawned) by every binary: the training steps, `chat` and the benchmarks.

/// Configures the process: keeps freed memory for reuse ([`crate::memory::retain_freed_memory`])
/// and fixes candle's thread count.
///
/// candle 0.11 asks for its thread count before every matmul, and without `RAYON_NUM_THREADS`
/// it re-detects the physical core count by parsing `/proc/cpuinfo` each time: about 50 us per
/// call, 10-15% of a GPT-2 decoding step at batch 1. Setting the variable to the detected count
/// (when neither it nor `CANDLE_NUM_THREADS` is set) gives the same count for the price of an
/// environment lookup.
pub fn init() {
    crate::memory::retain_freed_memory();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        // Called at the start of main, before other threads exist to read the environment.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}

/// candle's thread count, detected once (see [`init`]).
pub fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}
