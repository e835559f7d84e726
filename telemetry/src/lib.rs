//! Where a run's metrics go besides `metrics.jsonl`; imports point down this list:
//!
//! - `tfrecord`: the TFRecord framing (length, data, masked CRC-32C) of event files;
//! - `hparams`: TensorBoard's hparams plugin messages (a run's configuration, its end);
//! - `tensorboard`: TensorBoard's Event/Summary messages, an event-file writer and reader, and the
//!   mapping from a metrics record to scalars;
//! - `wandb`: the same scalars as wandb history rows, kept on disk and uploaded over HTTP;
//! - `plots`: the same scalars as a PNG grid of training curves;
//! - `progress`: bars (on a terminal) or log lines for long phases.

pub mod hparams;
pub mod plots;
pub mod progress;
pub mod tensorboard;
pub mod tfrecord;
pub mod wandb;

/// This machine's host name (gethostname(2)), as TensorBoard's event-file names and wandb's run
/// metadata carry it; "localhost" where there is none.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; gethostname NUL-terminates within it when
    // the name fits (and the last byte stays 0 when it does not).
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) } == 0;
    let name = ok.then(|| std::ffi::CStr::from_bytes_until_nul(&buf).ok()).flatten();
    match name.map(|n| n.to_string_lossy().trim().to_string()) {
        Some(n) if !n.is_empty() => n,
        _ => "localhost".into(),
    }
}

/// `text` as one cell of a Markdown table (report.md's answers, TensorBoard's rollout samples):
/// its whitespace runs, newlines included, as one space, and `|` escaped.
pub fn markdown_cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_markdown_cell_stays_one_cell_on_one_line() {
        assert_eq!(super::markdown_cell("\n\nHuman: a | b\n\nAssistant:"), "Human: a \\| b Assistant:");
    }

    #[test]
    fn the_host_name_is_the_kernels() {
        if let Ok(kernel) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            assert_eq!(super::host_name(), kernel.trim());
        }
    }
}
