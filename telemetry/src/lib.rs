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
    or_localhost(name.map(|n| n.to_string_lossy().trim().to_string()))
}

/// `name`, or "localhost" where there is none or it is empty.
fn or_localhost(name: Option<String>) -> String {
    name.filter(|n| !n.is_empty()).unwrap_or_else(|| "localhost".into())
}

/// The host name as an event file's name carries it: letters, digits, '-' and '_' only.
pub(crate) fn file_name_host(name: &str) -> String {
    or_localhost(Some(name.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_')).collect()))
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
    fn a_missing_or_empty_host_name_is_localhost() {
        assert_eq!(super::or_localhost(None), "localhost");
        assert_eq!(super::or_localhost(Some(String::new())), "localhost");
        assert_eq!(super::or_localhost(Some("node-1".into())), "node-1");
    }

    #[test]
    fn an_event_files_host_keeps_letters_digits_dashes_and_underscores() {
        assert_eq!(super::file_name_host("gpu_node-07.cluster.local"), "gpu_node-07clusterlocal");
        assert_eq!(super::file_name_host("a b/c\\d"), "abcd");
        assert_eq!(super::file_name_host("..."), "localhost");
        assert_eq!(super::file_name_host("höst"), "hst");
    }

    #[test]
    fn the_host_name_is_the_kernels() {
        if let Ok(kernel) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            assert_eq!(super::host_name(), kernel.trim());
        }
    }
}
