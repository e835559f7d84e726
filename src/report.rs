//! `output/report.md`: a `train` run as one shareable file: the command, the summary, each step's
//! time and flags, its training curves (embedded as PNG data), and the held-out prompts with the
//! SFT actor's and the RLHF actor's answers side by side.

use anyhow::Result;
use hybrid_engine::telemetry::plots::CURVES_FILE;
use hybrid_engine::training::metrics::{read_records, COMMAND_PREFIX, METRICS_FILE};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub const REPORT_FILE: &str = "report.md";

/// One step of the run, as the report shows it.
pub struct StepRun {
    pub number: u32,
    /// "SFT", "reward model", "PPO", ...
    pub name: String,
    /// The step's output directory (its metrics.jsonl, training.log and curves).
    pub dir: PathBuf,
    pub secs: u64,
}

/// Writes `<output>/report.md` (atomically) and returns its path.
pub fn write_report(output: &Path, command: &[String], summary: &[String], steps: &[StepRun]) -> Result<PathBuf> {
    let mut md = String::new();
    let total: u64 = steps.iter().map(|s| s.secs).sum();
    let _ = writeln!(md, "# RLHF run report\n");
    let _ = writeln!(md, "`{}`  ", command.join(" "));
    let _ = writeln!(md, "finished {} UTC, {} in all\n", utc_now(), duration(total));

    let _ = writeln!(md, "## Summary\n");
    for line in summary.iter().filter(|l| !l.starts_with("---")) {
        let _ = writeln!(md, "- {line}");
    }
    let _ = writeln!(md, "\n| step | output | time |\n|---|---|---|");
    for s in steps {
        let _ = writeln!(md, "| {} ({}) | `{}` | {} |", s.number, s.name, s.dir.display(), duration(s.secs));
    }

    let _ = writeln!(md, "\n## Training curves\n");
    for s in steps {
        let png = s.dir.join(CURVES_FILE);
        if let Ok(bytes) = std::fs::read(&png) {
            let _ = writeln!(md, "### Step {} ({})\n", s.number, s.name);
            let _ = writeln!(md, "![step {} curves](data:image/png;base64,{})\n", s.number, base64(&bytes));
        }
    }

    let _ = writeln!(md, "## Flags\n");
    for s in steps {
        if let Some(command) = step_command(&s.dir) {
            let _ = writeln!(md, "Step {} ({}):\n\n```\n{command}\n```\n", s.number, s.name);
        }
    }

    if let Some(step3) = steps.iter().find(|s| s.number == 3) {
        held_out_table(&mut md, &step3.dir, &step3.name)?;
    }
    let path = output.join(REPORT_FILE);
    hybrid_engine::durable::write_file_atomically(&path, md.as_bytes())?;
    Ok(path)
}

/// The command line a step logged (rank 0's `command:` line in its training.log).
fn step_command(dir: &Path) -> Option<String> {
    let log = std::fs::read_to_string(dir.join("training.log")).ok()?;
    log.lines().find_map(|l| l.strip_prefix(COMMAND_PREFIX)).map(str::to_string)
}

/// The held-out prompts of step 3's evaluation, the SFT actor's and the trained actor's answers
/// side by side, each marked by the demo's task scorer where it knows the prompt.
fn held_out_table(md: &mut String, step3: &Path, name: &str) -> Result<()> {
    let records = read_records(&step3.join(METRICS_FILE))?;
    let Some(summary) = records.iter().rev().find_map(|r| r.get("summary")) else { return Ok(()) };
    let texts = |eval: &str, key: &str| -> Vec<String> {
        summary[eval][key]
            .as_array()
            .map_or(vec![], |a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
    };
    let (prompts, sft, trained) =
        (texts("sft_eval", "prompt_texts"), texts("sft_eval", "answers"), texts("ppo_eval", "answers"));
    if prompts.is_empty() || prompts.len() != sft.len() || sft.len() != trained.len() {
        return Ok(());
    }
    let _ = writeln!(md, "## Held-out prompts: SFT vs {name}\n");
    let _ = writeln!(md, "Greedy answers; ✓ / ✗: the demo's task scorer (the capital, and no other city).\n");
    let _ = writeln!(md, "| # | prompt | SFT | {name} |\n|---|---|---|---|");
    let mark = |prompt: &str, answer: &str| match data::demo::score_answer(prompt, answer) {
        Some(score) if score.correct => "✓ ",
        Some(_) => "✗ ",
        None => "",
    };
    for (i, ((prompt, a), b)) in prompts.iter().zip(&sft).zip(&trained).enumerate() {
        let question = prompt.rsplit("Human:").next().unwrap_or(prompt);
        let question = question.split("Assistant:").next().unwrap_or(question);
        let _ = writeln!(
            md,
            "| {} | {} | {}{} | {}{} |",
            i + 1,
            cell(question),
            mark(prompt, a),
            cell(a),
            mark(prompt, b),
            cell(b)
        );
    }
    Ok(())
}

/// Text as one markdown table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// "1min 23s" (DS-Chat's e2e_rlhf.py duration format), as the launcher prints step times.
pub fn duration(secs: u64) -> String {
    format!("{}min {}s", secs / 60, secs % 60)
}

/// Standard base64 with padding (RFC 4648), for embedding the PNGs.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            let c = if i <= chunk.len() { ALPHABET[(n >> (18 - 6 * i) & 63) as usize] } else { b'=' };
            out.push(c as char);
        }
    }
    out
}

fn utc_now() -> String {
    utc_time(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()))
}

/// Unix time as `YYYY-MM-DD HH:MM` (UTC): days to the civil date by Howard Hinnant's algorithm.
fn utc_time(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}", rest / 3600, rest % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648_test_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn unix_time_to_utc_date() {
        assert_eq!(utc_time(0), "1970-01-01 00:00");
        assert_eq!(utc_time(951_782_400), "2000-02-29 00:00"); // a leap day of a century year
        assert_eq!(utc_time(1_795_626_439), "2026-11-25 17:07"); // as `date -u -d @1795626439`
    }

    #[test]
    fn table_cells_are_one_line() {
        assert_eq!(cell(" The capital of\nFrance | is Paris. "), "The capital of France \\| is Paris.");
    }
}
