//! `output/report.md`: a `train` run on one page: the command, the summary, each step's time and
//! flags, its training curves (linked: each step's `curves.png`, by a path relative to the
//! report), and the held-out prompts with the SFT actor's and the RLHF actor's answers side by
//! side. Everything but the curves is text in the file itself.

use anyhow::Result;
use hybrid_engine::telemetry::markdown_cell as cell;
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
        if png.is_file() {
            let _ = writeln!(md, "### Step {} ({})\n", s.number, s.name);
            let _ = writeln!(md, "![step {} curves]({})\n", s.number, link(output, &png));
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
/// side by side, each marked by its task's scorer (`data::tasks`) where one knows the prompt.
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
    let _ = writeln!(md, "Greedy answers; ✓ / ✗: the task's scorer (the demo's: the capital and no other city; arithmetic: the sum and no other number).\n");
    let mark = |prompt: &str, answer: &str| match data::tasks::score_answer(prompt, answer) {
        Some(true) => "✓ ",
        Some(false) => "✗ ",
        None => "",
    };
    for (i, ((prompt, a), b)) in prompts.iter().zip(&sft).zip(&trained).enumerate() {
        // The demo's held-out countries come last, in a table of their own.
        let new_country = data::demo::asks_about_heldout_country(prompt);
        if i == 0 || (new_country && !data::demo::asks_about_heldout_country(&prompts[i - 1])) {
            if new_country {
                let _ = writeln!(
                    md,
                    "\nThe held-out countries: step 1 trained on them; no row of steps 2 and 3 asks about them.\n"
                );
            }
            let _ = writeln!(md, "| # | prompt | SFT | {name} |\n|---|---|---|---|");
        }
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

/// "1min 23s" (DS-Chat's e2e_rlhf.py duration format), as the launcher prints step times.
pub fn duration(secs: u64) -> String {
    format!("{}min {}s", secs / 60, secs % 60)
}

/// `file` as a markdown link target from a page in `dir`: relative where `file` is under `dir`
/// (the report and its steps move together), else its absolute path; spaces escaped.
fn link(dir: &Path, file: &Path) -> String {
    let target = match file.strip_prefix(dir) {
        Ok(relative) => relative.to_path_buf(),
        Err(_) => std::path::absolute(file).unwrap_or_else(|_| file.to_path_buf()),
    };
    target.to_string_lossy().replace(' ', "%20")
}

/// Now, as `YYYY-MM-DD HH:MM` (UTC).
fn utc_now() -> String {
    utc_time(chrono::Utc::now())
}

fn utc_time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates_are_minutes() {
        let at = |secs| utc_time(chrono::DateTime::from_timestamp(secs, 0).expect("a valid time"));
        assert_eq!(at(0), "1970-01-01 00:00");
        assert_eq!(at(951_782_400), "2000-02-29 00:00"); // a leap day of a century year
        assert_eq!(at(1_795_626_439), "2026-11-25 17:07"); // as `date -u -d @1795626439`
    }

    #[test]
    fn curves_are_linked_relative_to_the_report() {
        let out = Path::new("output");
        assert_eq!(link(out, &out.join("step1").join("curves.png")), "step1/curves.png");
        assert_eq!(link(out, Path::new("/runs/my run/curves.png")), "/runs/my%20run/curves.png");
    }
}
