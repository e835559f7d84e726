//! End-to-end tests of `sft --from-scratch`: the loss falls, checkpoints are Hugging Face
//! directories, a resumed run reproduces the uninterrupted one bit for bit (also after a kill in
//! the middle of a save), and bad input is one clear error line with exit code 2 that leaves
//! earlier checkpoints intact.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A small model on the embedded corpus: fast enough for CI, big enough to learn.
const SMALL: &[&str] = &[
    "--from-scratch",
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "2",
    "--log-interval",
    "2",
];

fn sft(args: &[&str], extra_env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sft"));
    cmd.args(args).env_remove("RLHF_FAILPOINT");
    // No wandb settings of the machine's user leak into a test.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("WANDB_") || k == "RLHF_ENABLE_WANDB") {
        cmd.env_remove(k);
    }
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn sft")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "sft failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The one error line; asserts exit code 2 and no panic.
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "want exit 2, got {:?}; stderr:\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "panic instead of an error:\n{stderr}");
    // A phase's timing line (tokenizing slowed by a loaded machine) is the log's, not an error.
    let lines: Vec<&str> = stderr.lines().filter(|l| !hybrid_engine::telemetry::progress::is_phase_line(l)).collect();
    assert_eq!(lines.len(), 1, "want one error line, got:\n{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

fn args<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(more).copied().collect()
}

/// Per-iteration training losses from metrics.jsonl; a resumed run's record of an iteration
/// replaces the interrupted run's.
fn losses(dir: &Path) -> BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).expect("metrics line is JSON");
        if let (Some(i), Some(l)) = (v["iteration"].as_u64(), v["lm_loss"].as_f64()) {
            out.insert(i, l);
        }
    }
    out
}

fn latest(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("latest")).expect("latest").trim().to_string()
}

/// A file of data/tests/fixtures/megatron (the same 12 documents as jsonl and as Megatron's
/// pre-tokenized pairs), as a path argument.
fn megatron_fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tests/fixtures/megatron").join(name);
    path.to_str().unwrap().to_string()
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn pretraining_lowers_the_loss_and_saves_a_hugging_face_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let tb = tmp.path().join("tb");
    let o = out.to_str().unwrap();
    let stdout = ok(&sft(
        &args(
            SMALL,
            &[
                "--train-iters",
                "60",
                "--lr",
                "3e-3",
                "--lr-warmup-iters",
                "5",
                "--eval-interval",
                "30",
                "--output-dir",
                o,
                "--tensorboard-dir",
                tb.to_str().unwrap(),
            ],
        ),
        &[],
    ));
    assert!(stdout.contains("validation loss at iteration 30") && stdout.contains("lm loss PPL"), "{stdout}");
    assert!(stdout.contains("test loss at iteration 60"), "{stdout}");
    assert!(stdout.contains("elapsed time per iteration (ms)") && stdout.contains("tokens/s"), "{stdout}");
    let l = losses(&out);
    assert_eq!(l.len(), 60);
    let first: f64 = l.values().take(10).sum::<f64>() / 10.0;
    let last: f64 = l.values().rev().take(10).sum::<f64>() / 10.0;
    assert!(last < first - 2.0, "loss should fall: first ten {first:.3}, last ten {last:.3}");

    let ckpt = out.join(latest(&out));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "optimizer-manifest.json",
        "optimizer-rank-000-of-001.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(f).is_file(), "{f} missing from {}", ckpt.display());
    }
    let config: Value = serde_json::from_slice(&read(ckpt.join("config.json"))).unwrap();
    assert_eq!(config["vocab_size"], 50304, "embedding padded to a multiple of 128 and recorded");
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["eos_token_id"], 50256);
    let end: Value =
        serde_json::from_str(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().last().unwrap())
            .unwrap();
    let ppl = end["summary"]["valid_ppl"].as_f64().unwrap();
    assert!(ppl < first.exp() / 10.0, "validation perplexity {ppl} should be far below the start's {}", first.exp());

    // --tensorboard-dir (Megatron's spelling): one event file with every metric of
    // metrics.jsonl at its iteration, under our names and Megatron's.
    use hybrid_engine::telemetry::tensorboard::{read_scalars, scalars_of_records, MEGATRON_TAGS};
    let files: Vec<PathBuf> = std::fs::read_dir(&tb).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let records = hybrid_engine::training::metrics::read_records(&out.join("metrics.jsonl")).unwrap();
    let scalars = read_scalars(&files[0]).unwrap();
    let want = scalars_of_records(&records, MEGATRON_TAGS, 0);
    let first_difference = scalars.iter().zip(&want).find(|(a, b)| a != b);
    assert!(
        first_difference.is_none() && scalars.len() == want.len(),
        "{first_difference:?}, {} vs {} scalars",
        scalars.len(),
        want.len()
    );
    let lm_loss: Vec<(i64, f32)> =
        scalars.iter().filter(|(_, t, _)| t == "lm loss").map(|(s, _, x)| (*s, *x)).collect();
    assert_eq!(lm_loss.len(), 60);
    assert_eq!(lm_loss[59], (60, l[&60] as f32));
    assert!(scalars.iter().any(|(s, t, _)| *s == 30 && t == "lm loss validation"), "{scalars:?}");
    // The last validation is on the curve (at the last iteration), and nothing is written twice.
    assert!(scalars.iter().any(|(s, t, _)| *s == 60 && t == "lm loss validation"), "{scalars:?}");
    // The flags as parsed in the HPARAMS tab (a default too), the session ended successfully.
    use hybrid_engine::telemetry::hparams::{HParam, STATUS_SUCCESS};
    let session = hybrid_engine::telemetry::tensorboard::read_hparams(&files[0]).unwrap().expect("hparams");
    let (hparams, status) = (session.hparams, session.status);
    assert_eq!(hparams.get("seed"), Some(&HParam::number(1234.0)), "{hparams:?}");
    assert_eq!(hparams.get("train_iters"), Some(&HParam::number(60.0)), "{hparams:?}");
    assert_eq!(status, Some(STATUS_SUCCESS));
    let mut tags: Vec<(i64, &str)> = scalars.iter().map(|(s, t, _)| (*s, t.as_str())).collect();
    let all = tags.len();
    tags.sort();
    tags.dedup();
    assert_eq!(tags.len(), all, "a (step, tag) written twice");
    // RLHF_ENABLE_TENSORBOARD (how `train --enable-tensorboard` reaches the steps) turns it on
    // at the default place, tensorboard/<name> beside the output directory; 0 or false is off.
    for (value, on) in [("1", true), ("true", true), ("0", false), ("false", false)] {
        let run = tmp.path().join(format!("env-{value}"));
        let short = ["--train-iters", "2", "--eval-iters", "1", "--output-dir", run.to_str().unwrap()];
        ok(&sft(&args(SMALL, &short), &[("RLHF_ENABLE_TENSORBOARD", value)]));
        assert_eq!(tmp.path().join(format!("tensorboard/env-{value}")).is_dir(), on, "RLHF_ENABLE_TENSORBOARD={value}");
    }
    // And the curves, beside metrics.jsonl (the loss scale of an fp32 run is not drawn).
    assert!(stdout.contains("training curves: ") && stdout.contains("LM loss, Learning rate, Throughput"), "{stdout}");
    assert!(out.join("curves.png").is_file());
}

#[test]
fn resume_is_bit_identical_even_after_a_kill_during_a_save() {
    let tmp = tempfile::tempdir().unwrap();
    // Every run shares the schedule's length so the learning rates agree.
    let common = args(
        SMALL,
        &["--lr-decay-iters", "12", "--lr-warmup-iters", "2", "--save-interval", "4", "--eval-interval", "0"],
    );
    let straight = tmp.path().join("straight");
    ok(&sft(&args(&common, &["--train-iters", "12", "--output-dir", straight.to_str().unwrap()]), &[]));

    let broken = tmp.path().join("broken");
    let b = broken.to_str().unwrap();
    ok(&sft(&args(&common, &["--train-iters", "4", "--output-dir", b]), &[]));
    assert_eq!(latest(&broken), "iter_0000004");
    let weights_at_4 = read(broken.join("iter_0000004/model.safetensors"));

    // Killed while writing the iteration-8 checkpoint, before it is renamed into place.
    let killed = sft(
        &args(&common, &["--train-iters", "12", "--load", b, "--output-dir", b]),
        &[("RLHF_FAILPOINT", "checkpoint-before-rename")],
    );
    assert!(!killed.status.success(), "the failpoint must kill the run");
    assert_eq!(latest(&broken), "iter_0000004", "latest still names the last complete checkpoint");
    assert!(!broken.join("iter_0000008").exists());
    assert_eq!(read(broken.join("iter_0000004/model.safetensors")), weights_at_4, "earlier checkpoint untouched");

    // Killed after the rename but before `latest` moves: resume still starts from iteration 4.
    let killed = sft(
        &args(&common, &["--train-iters", "12", "--load", b, "--output-dir", b]),
        &[("RLHF_FAILPOINT", "checkpoint-before-latest")],
    );
    assert!(!killed.status.success());
    assert_eq!(latest(&broken), "iter_0000004");

    let stdout = ok(&sft(&args(&common, &["--train-iters", "12", "--load", b, "--output-dir", b]), &[]));
    assert!(stdout.contains("resumed from") && stdout.contains("iteration 4"), "{stdout}");
    assert_eq!(latest(&broken), "iter_0000012");

    let (want, got) = (losses(&straight), losses(&broken));
    assert_eq!(want.len(), 12);
    for (i, l) in &want {
        assert_eq!(got.get(i), Some(l), "iteration {i}: resumed loss differs (bit-exact expected)");
    }
    assert_eq!(
        read(straight.join("iter_0000012/model.safetensors")),
        read(broken.join("iter_0000012/model.safetensors")),
        "final weights must be bit-identical"
    );
    assert_eq!(
        read(straight.join("iter_0000012/optimizer-rank-000-of-001.safetensors")),
        read(broken.join("iter_0000012/optimizer-rank-000-of-001.safetensors"))
    );
}

/// `--dtype fp16`: the loss scale starts at 2^20 so the first iterations overflow, are skipped
/// (weights and schedule stay) and halve the scale; the loss still falls; the log line and
/// metrics.jsonl carry the scale and the skip count; and a run resumed from a checkpoint taken
/// after the skips ends bit-identical to the straight one (the scaler is in the checkpoint).
#[test]
fn fp16_pretraining_skips_overflows_logs_the_scale_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let common = args(
        SMALL,
        &[
            "--dtype",
            "fp16",
            "--initial-scale-power",
            "20",
            "--loss-scale-window",
            "4",
            "--lr",
            "3e-3",
            "--lr-decay-iters",
            "30",
            "--lr-warmup-iters",
            "2",
            "--save-interval",
            "15",
            "--eval-interval",
            "0",
        ],
    );
    let straight = tmp.path().join("straight");
    let stdout = ok(&sft(&args(&common, &["--train-iters", "30", "--output-dir", straight.to_str().unwrap()]), &[]));
    assert!(stdout.contains("compute dtype: fp16"), "{stdout}");
    assert!(stdout.contains("loss scale: ") && stdout.contains("number of skipped iterations: "), "{stdout}");

    let text = std::fs::read_to_string(straight.join("metrics.jsonl")).unwrap();
    let records: Vec<Value> =
        text.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()).filter(|v| v["lm_loss"].is_number()).collect();
    assert_eq!(records.len(), 30);
    let skipped: Vec<u64> =
        records.iter().filter(|v| v["skipped"] == true).map(|v| v["iteration"].as_u64().unwrap()).collect();
    assert!(!skipped.is_empty() && skipped[0] == 1, "2^20 must overflow at once: skipped {skipped:?}");
    let scales: Vec<f64> = records.iter().map(|v| v["loss_scale"].as_f64().unwrap()).collect();
    assert!(*scales.last().unwrap() < (1u64 << 20) as f64, "the scale came down: {scales:?}");
    assert_eq!(records.last().unwrap()["skipped_iterations"].as_u64().unwrap(), skipped.len() as u64);
    let l = losses(&straight);
    let first: f64 = l.values().take(5).sum::<f64>() / 5.0;
    let last: f64 = l.values().rev().take(5).sum::<f64>() / 5.0;
    // fp32 falls about 0.9 in these 30 iterations; fp16 makes fewer updates (the skips).
    assert!(last < first - 0.4, "fp16 loss should fall: first five {first:.3}, last five {last:.3}");
    let state: Value = serde_json::from_slice(&read(straight.join("iter_0000030/trainer_state.json"))).unwrap();
    assert_eq!(state["run"]["dtype"], "fp16");
    assert_eq!(state["run"]["optimizer_step"].as_u64().unwrap(), 30 - skipped.len() as u64, "skips do not step AdamW");

    let resumed = tmp.path().join("resumed");
    let r = resumed.to_str().unwrap();
    ok(&sft(&args(&common, &["--train-iters", "15", "--output-dir", r]), &[]));
    ok(&sft(&args(&common, &["--train-iters", "30", "--load", r, "--output-dir", r]), &[]));
    let (want, got) = (losses(&straight), losses(&resumed));
    for (i, l) in &want {
        assert_eq!(got.get(i), Some(l), "iteration {i}: resumed fp16 loss differs (bit-exact expected)");
    }
    assert_eq!(
        read(straight.join("iter_0000030/model.safetensors")),
        read(resumed.join("iter_0000030/model.safetensors")),
        "final fp32 master weights must be bit-identical"
    );

    // Resuming an fp16 checkpoint without fp16 is one clear error.
    let err = error_line(&sft(&args(SMALL, &["--train-iters", "31", "--load", r, "--output-dir", r]), &[]));
    assert!(err.contains("--dtype"), "{err}");
}

/// `--dtype bf16` (no loss scaling) tracks fp32: the same 30 iterations end within 1% of fp32's
/// validation loss (measured 0.03%).
#[test]
fn bf16_pretraining_tracks_fp32() {
    let tmp = tempfile::tempdir().unwrap();
    let valid_loss = |dtype: &str| -> f64 {
        let dir = tmp.path().join(dtype);
        let common = ["--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "0", "--train-iters", "30"];
        ok(&sft(&args(&args(SMALL, &common), &["--dtype", dtype, "--output-dir", dir.to_str().unwrap()]), &[]));
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let end: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        end["summary"]["valid_loss"].as_f64().unwrap()
    };
    let (fp32, bf16) = (valid_loss("fp32"), valid_loss("bf16"));
    assert!(fp32 < 10.3, "fp32 learned: {fp32}");
    assert!((bf16 - fp32).abs() / fp32 < 0.01, "bf16 {bf16} vs fp32 {fp32}");
}

#[test]
fn bad_input_is_one_clear_error_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let o = dir.join("out");
    let o = o.to_str().unwrap();
    let run =
        |more: &[&str]| error_line(&sft(&args(SMALL, &args(&["--train-iters", "2", "--output-dir", o], more)), &[]));

    let e = run(&["--data-path", "/no/such/corpus.jsonl"]);
    assert!(e.contains("/no/such/corpus.jsonl"), "{e}");

    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"text\": oops}\n").unwrap();
    let e = run(&["--data-path", bad.to_str().unwrap()]);
    assert!(e.contains("line 2"), "malformed jsonl must name its line: {e}");

    let e = run(&["--seq-length", "300", "--model", "tiny"]);
    assert!(e.contains("--seq-length 300") && e.contains("256"), "{e}");

    let cfg = dir.join("config.json");
    std::fs::write(&cfg, r#"{"vocab_size": 50257, "n_positions": 64, "n_embd": 30, "n_layer": 1, "n_head": 4}"#)
        .unwrap();
    let e = error_line(&sft(
        &["--from-scratch", "--model", cfg.to_str().unwrap(), "--seq-length", "16", "--output-dir", o],
        &[],
    ));
    assert!(e.contains("not divisible"), "{e}");
    std::fs::write(&cfg, "{ not json").unwrap();
    let e = error_line(&sft(&["--from-scratch", "--model", cfg.to_str().unwrap(), "--output-dir", o], &[]));
    // Read before its model_type is known: the file named and the JSON error said, not GPT-2's.
    assert!(e.contains(&format!("{}: not valid JSON", cfg.display())), "{e}");

    let small = dir.join("small.txt");
    std::fs::write(&small, "To be, or not to be, that is the question. ".repeat(8)).unwrap();
    let e = run(&["--data-path", small.to_str().unwrap()]);
    assert!(e.contains("--split"), "an empty validation split is caught at start: {e}");

    let e = run(&["--micro-batch-size", "0"]);
    assert!(e.contains("--micro-batch-size"), "{e}");

    // wandb: a setting without wandb on, no key, an unknown mode.
    let e = run(&["--wandb-entity", "team"]);
    assert!(e.contains("--wandb-entity") && e.contains("--enable-wandb"), "{e}");
    let home = [("HOME", dir.to_str().unwrap())];
    let e = error_line(&sft(&args(SMALL, &["--train-iters", "2", "--output-dir", o, "--enable-wandb"]), &home));
    assert!(e.contains("WANDB_API_KEY") && e.contains("WANDB_MODE=offline"), "{e}");
    let e = error_line(&sft(
        &args(SMALL, &["--train-iters", "2", "--output-dir", o, "--wandb-project", "p"]),
        &[("WANDB_MODE", "quiet")],
    ));
    assert!(e.contains("WANDB_MODE") && e.contains("online, offline or disabled"), "{e}");
}

/// Scalars in (step, name, value) order: a wandb row is a JSON object, its keys in name order.
fn sorted(mut scalars: Vec<(i64, String, f32)>) -> Vec<(i64, String, f32)> {
    scalars.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)).then(a.2.total_cmp(&b.2)));
    scalars
}

/// The last value of each (step, name) of `scalars`, in no particular order: what one wandb row a
/// step keeps of the step's records.
fn last_per_step_and_name(scalars: Vec<(i64, String, f32)>) -> Vec<(i64, String, f32)> {
    let mut last = std::collections::BTreeMap::new();
    for (step, name, value) in scalars {
        last.insert((step, name), value);
    }
    last.into_iter().map(|((step, name), value)| (step, name, value)).collect()
}

/// The wandb rows of a run's directory (one per step, asserted): (step, name, value) of every
/// scalar but wandb's own, sorted.
fn wandb_rows(wandb_dir: &Path) -> (serde_json::Value, Vec<(i64, String, f32)>) {
    let latest = std::fs::read_to_string(wandb_dir.join("latest-run")).expect("latest-run");
    let run = wandb_dir.join(latest.trim());
    let record: Value = serde_json::from_str(&std::fs::read_to_string(run.join("run.json")).unwrap()).unwrap();
    let (mut rows, mut last_step) = (Vec::new(), i64::MIN);
    for line in std::fs::read_to_string(run.join("history.jsonl")).unwrap().lines() {
        let row: serde_json::Map<String, Value> = serde_json::from_str(line).unwrap();
        let step = row["_step"].as_i64().unwrap();
        assert!(step > last_step, "one wandb row per step, in order: {step} after {last_step}");
        last_step = step;
        rows.extend(
            row.iter().filter(|(k, _)| !k.starts_with('_')).map(|(k, v)| (step, k.clone(), v.as_f64().unwrap() as f32)),
        );
    }
    (record, sorted(rows))
}

/// `--wandb-project` in offline mode: every scalar of metrics.jsonl as a wandb row at its
/// iteration (with Megatron's names, as TensorBoard), the flags as the config, the exit code; a
/// resumed run continues the same wandb run. With the service unreachable the run succeeds,
/// warns once and keeps every row.
#[test]
fn wandb_rows_are_the_metrics_and_a_resumed_run_continues_its_wandb_run() {
    use hybrid_engine::telemetry::tensorboard::{scalars_of_records, MEGATRON_TAGS};
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().to_str().unwrap();
    let out = tmp.path().join("run");
    let o = out.to_str().unwrap();
    let common = args(SMALL, &["--lr-decay-iters", "8", "--save-interval", "4", "--eval-interval", "4"]);
    let offline = [("WANDB_MODE", "offline"), ("HOME", home)];
    let wandb_dir = tmp.path().join("wandb/run");

    // Four iterations, then resumed to eight.
    let first_run =
        sft(&args(&common, &["--train-iters", "4", "--output-dir", o, "--wandb-project", "proj"]), &offline);
    ok(&first_run);
    let stderr = String::from_utf8_lossy(&first_run.stderr);
    assert!(stderr.contains("wandb: offline") && stderr.contains("train wandb-sync"), "{stderr}");
    let (first, _) = wandb_rows(&wandb_dir);
    assert_eq!(first["exit_code"], Value::from(0));
    let resumed = ["--train-iters", "8", "--load", o, "--output-dir", o, "--wandb-project", "proj"];
    let stdout = ok(&sft(&args(&common, &resumed), &offline));
    assert!(stdout.contains("resumed from"), "{stdout}");
    let (record, rows) = wandb_rows(&wandb_dir);
    assert_eq!(record["id"], first["id"], "the resumed run continues the wandb run of its first attempt");
    assert_eq!((record["project"].as_str(), record["display_name"].as_str()), (Some("proj"), Some("run")));
    assert_eq!(record["exit_code"], Value::from(0));
    assert_eq!(record["config"]["train_iters"]["value"], Value::from(8));
    // The config is the flags as parsed: the defaults too, with their help as the description.
    assert_eq!(record["config"]["seed"]["value"], Value::from(1234), "{}", record["config"]);
    assert_eq!(record["config"]["adam_eps"]["value"], Value::from(1e-8));
    // Both attempts' rows, as metrics.jsonl holds them.
    let records = hybrid_engine::training::metrics::read_records(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(rows, sorted(last_per_step_and_name(scalars_of_records(&records, MEGATRON_TAGS, 0))));
    assert!(rows.iter().any(|(s, t, _)| *s == 8 && t == "lm loss"), "{rows:?}");

    // The service unreachable: the run succeeds, warns once, keeps every row.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let down = tmp.path().join("down");
    let run = sft(
        &args(&common, &["--train-iters", "4", "--output-dir", down.to_str().unwrap(), "--enable-wandb"]),
        &[("WANDB_BASE_URL", &url), ("WANDB_API_KEY", "k"), ("HOME", home)],
    );
    ok(&run);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(stderr.matches("warning: wandb: cannot reach").count(), 1, "{stderr}");
    assert!(stderr.contains("train wandb-sync"), "{stderr}");
    let (record, rows) = wandb_rows(&tmp.path().join("wandb/down"));
    let records = hybrid_engine::training::metrics::read_records(&down.join("metrics.jsonl")).unwrap();
    assert_eq!(rows, sorted(last_per_step_and_name(scalars_of_records(&records, MEGATRON_TAGS, 0))));
    assert_eq!(record["exit_code"], Value::from(0));
}

#[test]
fn model_dimensions_too_large_are_one_error_line_before_anything_is_allocated() {
    let tmp = tempfile::tempdir().unwrap();
    let o = tmp.path().join("out");
    let o = o.to_str().unwrap();
    let run =
        |more: &[&str]| error_line(&sft(&args(SMALL, &args(&["--train-iters", "2", "--output-dir", o], more)), &[]));
    // Beyond 64-bit arithmetic: used to overflow, then abort in an allocation.
    let e = run(&["--hidden-size", "4294967296", "--num-attention-heads", "1"]);
    assert!(e.contains("more parameters than any machine can address"), "{e}");
    // Countable (1.3 trillion parameters) but beyond this machine's memory.
    let e = run(&["--num-layers", "100000000"]);
    assert!(e.contains("more than this machine's") && e.contains("choose smaller dimensions"), "{e}");
    // A micro-batch no machine holds: used to abort allocating its indices.
    let e = run(&["--micro-batch-size", "1000000000000"]);
    assert!(e.contains("memory plan") && e.contains("lower the micro-batch size"), "{e}");
    let cfg = tmp.path().join("config.json");
    std::fs::write(
        &cfg,
        r#"{"vocab_size": 1000000000000000000, "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}"#,
    )
    .unwrap();
    let e = error_line(&sft(&args(SMALL, &["--model", cfg.to_str().unwrap(), "--output-dir", o]), &[]));
    assert!(e.contains("vocab_size 1000000000000000000") && e.contains("any machine can address"), "{e}");
    assert!(!Path::new(o).exists(), "nothing was written");
}

#[test]
fn corrupt_checkpoint_is_a_clear_error_and_leaves_other_checkpoints_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    let r = root.to_str().unwrap();
    ok(&sft(
        &args(SMALL, &["--train-iters", "2", "--save-interval", "1", "--eval-interval", "0", "--output-dir", r]),
        &[],
    ));
    let e = error_line(&sft(
        &args(SMALL, &["--train-iters", "4", "--hidden-size", "64", "--load", r, "--output-dir", r]),
        &[],
    ));
    assert!(e.contains("n_embd"), "{e}");
    let good = read(root.join("iter_0000001/model.safetensors"));
    let target = root.join("iter_0000002/model.safetensors");
    let bytes = read(target.clone());
    std::fs::write(&target, &bytes[..bytes.len() / 3]).unwrap();
    let e = error_line(&sft(&args(SMALL, &["--train-iters", "4", "--load", r, "--output-dir", r]), &[]));
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
    assert_eq!(read(root.join("iter_0000001/model.safetensors")), good, "other checkpoints untouched");
    assert_eq!(latest(&root), "iter_0000002", "a failed run does not move `latest`");

    // A root without a checkpoint is a fresh start as Megatron's (next test), and an error with
    // Megatron's --exit-on-missing-checkpoint.
    let missing = ["--train-iters", "4", "--load", "/no/such/ckpt", "--exit-on-missing-checkpoint", "--output-dir", r];
    let e = error_line(&sft(&args(SMALL, &missing), &[]));
    assert!(e.contains("/no/such/ckpt holds no checkpoint"), "{e}");
}

/// Megatron's scripts pass `--save DIR --load DIR` from the first run on: the first run finds no
/// checkpoint and starts from scratch, saying so; the same command again resumes where it ended
/// and continues the same trajectory as one run of the whole length.
#[test]
fn one_script_with_save_and_load_of_the_same_directory_starts_then_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    let r = root.to_str().unwrap();
    let common = ["--lr-decay-iters", "8", "--eval-interval", "0", "--save", r, "--load", r];
    let first = ok(&sft(&args(SMALL, &args(&common, &["--train-iters", "4", "--output-dir", r])), &[]));
    assert!(first.contains(&format!("--load {r}: no checkpoint there yet")), "{first}");
    assert_eq!(latest(&root), "iter_0000004");
    let again = ok(&sft(&args(SMALL, &args(&common, &["--train-iters", "8", "--output-dir", r])), &[]));
    assert!(again.contains("resumed from") && again.contains("at iteration 4"), "{again}");
    assert_eq!(latest(&root), "iter_0000008");
    let whole = tmp.path().join("whole");
    let w = whole.to_str().unwrap();
    let whole_args = ["--lr-decay-iters", "8", "--eval-interval", "0", "--train-iters", "8", "--output-dir", w];
    ok(&sft(&args(SMALL, &whole_args), &[]));
    assert_eq!(losses(&root), losses(&whole), "the two runs are the one run");
}

/// Megatron's pre-tokenized corpus (a `.bin`/`.idx` pair written by megatron-core's builder, as
/// preprocess_data.py with --append-eod writes it; `scripts/fixtures/megatron_indexed.py`) with
/// a Megatron script's flags trains exactly as the same documents given as jsonl do: the same
/// blocks, the same schedule, the same losses, the same saved tokenizer.
#[test]
fn megatrons_preprocessed_corpus_and_script_flags_train_as_its_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tests/fixtures/megatron");
    let path = |name: &str| fixtures.join(name).to_str().unwrap().to_string();
    // GPT-2's gpt2-vocab.json and gpt2-merges.txt, as Megatron's scripts pass them.
    let tokenizer: Value = serde_json::from_slice(data::GPT2_TOKENIZER_JSON).unwrap();
    let (vocab, merges) = (tmp.path().join("gpt2-vocab.json"), tmp.path().join("gpt2-merges.txt"));
    std::fs::write(&vocab, serde_json::to_vec(&tokenizer["model"]["vocab"]).unwrap()).unwrap();
    let pairs = tokenizer["model"]["merges"].as_array().unwrap();
    let lines: String =
        pairs.iter().map(|p| format!("{} {}\n", p[0].as_str().unwrap(), p[1].as_str().unwrap())).collect();
    std::fs::write(&merges, format!("#version: 0.2\n{lines}")).unwrap();
    let common = ["--train-iters", "6", "--lr-decay-iters", "30", "--split", "10,2,2", "--eval-interval", "3"];
    let run = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        let stdout = ok(&sft(&args(SMALL, &args(&common, &args(&["--output-dir", out.to_str().unwrap()], more))), &[]));
        (out, stdout)
    };
    let (text, text_log) = run("jsonl", &["--data-path", &path("corpus.jsonl"), "--lr-warmup-iters", "3"]);
    assert!(text_log.contains("corpus: 12 documents, 239 tokens, 14 blocks of 16 tokens"), "{text_log}");
    let megatron = [
        "--data-impl",
        "mmap",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab.to_str().unwrap(),
        "--merge-file",
        merges.to_str().unwrap(),
        "--lr-warmup-fraction",
        ".1",
        // Megatron's defaults, said explicitly as its scripts do: no change.
        "--init-method-std",
        "0.02",
        "--attention-dropout",
        "0.1",
        "--hidden-dropout",
        "0.1",
        "--pipeline-model-parallel-size",
        "1",
        "--use-distributed-optimizer",
    ];
    for prefix in ["corpus_text_document", "corpus_sentences_int32"] {
        let (indexed, log) = run(prefix, &args(&["--data-path", &path(prefix)], &megatron));
        let line =
            "corpus (Megatron's indexed dataset, read in place): 12 documents, 239 tokens, 14 blocks of 16 tokens";
        assert!(log.contains(line), "{log}");
        assert_eq!(losses(&indexed), losses(&text), "{prefix}");
        assert_eq!(losses(&indexed).len(), 6);
        let saved = |dir: &Path| read(dir.join(latest(dir)).join("tokenizer.json"));
        assert_eq!(saved(&indexed), saved(&text), "{prefix}: the BPE files make the embedded tokenizer");
    }

    // A pair that does not match is refused before training; a token the model's vocabulary
    // lacks fails the run when its block is read, naming the token and the file. Both one line.
    let broken = tmp.path().join("broken");
    std::fs::copy(fixtures.join("corpus_text_document.bin"), broken.with_extension("bin")).unwrap();
    let idx = read(fixtures.join("corpus_text_document.idx"));
    std::fs::write(broken.with_extension("idx"), &idx[..idx.len() - 8]).unwrap();
    let o = tmp.path().join("refused");
    let e = error_line(&sft(
        &args(SMALL, &args(&common, &["--data-path", broken.to_str().unwrap(), "--output-dir", o.to_str().unwrap()])),
        &[],
    ));
    assert!(e.contains("broken.idx is not a Megatron indexed dataset's index") && e.contains("truncated"), "{e}");
    // Token 0 set to 60000, past the 50304 rows (50257 padded to a multiple of 128): the first
    // training block, which an epoch of 6 iterations of 2 over 10 training blocks reads.
    let beyond = tmp.path().join("beyond");
    let mut bin = read(fixtures.join("corpus_text_document.bin"));
    bin[..2].copy_from_slice(&60000u16.to_le_bytes());
    std::fs::write(beyond.with_extension("bin"), bin).unwrap();
    std::fs::write(beyond.with_extension("idx"), &idx).unwrap();
    let e = error_line(&sft(
        &args(SMALL, &args(&common, &["--data-path", beyond.to_str().unwrap(), "--output-dir", o.to_str().unwrap()])),
        &[],
    ));
    assert!(e.contains("token 0 of") && e.contains("beyond.bin is 60000") && e.contains("50304-row vocabulary"), "{e}");
}

/// Megatron's early exits: each saves a checkpoint and stops with exit code 0 at an iteration
/// the same command resumes from, and the pieces make the one uninterrupted run.
#[test]
fn early_exits_save_and_stop_where_the_same_command_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let schedule = ["--lr-decay-iters", "400", "--eval-interval", "0"];
    let uninterrupted = |iters: &str| {
        let dir = tmp.path().join(format!("whole-{iters}"));
        ok(&sft(&args(SMALL, &args(&schedule, &["--train-iters", iters, "--output-dir", dir.to_str().unwrap()])), &[]));
        losses(&dir)
    };

    // --exit-interval 3 over 8 iterations: three runs of one command, stopping at 3 and 6.
    let root = tmp.path().join("interval");
    let r = root.to_str().unwrap();
    let command = args(
        SMALL,
        &args(&schedule, &["--train-iters", "8", "--exit-interval", "3", "--save", r, "--load", r, "--output-dir", r]),
    );
    for stop in ["3", "6"] {
        let out = ok(&sft(&command, &[]));
        assert!(out.contains(&format!("exiting program at iteration {stop}: --exit-interval 3")), "{out}");
        assert_eq!(latest(&root), format!("iter_000000{stop}"));
    }
    let last = ok(&sft(&command, &[]));
    assert!(!last.contains("exiting program") && latest(&root) == "iter_0000008", "{last}");
    assert_eq!(losses(&root), uninterrupted("8"));

    // --exit-duration-in-mins: the first iteration already ends past 6 ms after the start.
    let quick = tmp.path().join("duration");
    let q = quick.to_str().unwrap();
    let out = ok(&sft(
        &args(
            SMALL,
            &args(
                &schedule,
                &["--train-iters", "400", "--exit-duration-in-mins", "0.0001", "--save", q, "--output-dir", q],
            ),
        ),
        &[],
    ));
    assert!(out.contains("exiting program at iteration 1: --exit-duration-in-mins reached"), "{out}");
    assert_eq!(latest(&quick), "iter_0000001");

    // --exit-signal-handler: SIGTERM in the middle of a long run saves after the iteration it
    // arrived in and stops; resumed for two more iterations it is the uninterrupted run.
    let signal = tmp.path().join("signal");
    let s = signal.to_str().unwrap();
    let long = args(
        SMALL,
        &args(&schedule, &["--train-iters", "400", "--exit-signal-handler", "--save", s, "--output-dir", s]),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_sft"))
        .args(&long)
        .env_remove("RLHF_FAILPOINT")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !signal.join("metrics.jsonl").is_file() || losses(&signal).len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no iteration within 120 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // SAFETY: signalling the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let (status, mut stdout) = (child.wait().unwrap(), String::new());
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    assert!(status.success(), "{status:?}: {stdout}");
    let stopped: u64 = stdout
        .split("exiting program at iteration ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exit line: {stdout}"));
    assert!(stdout.contains(&format!("exiting program at iteration {stopped}: SIGTERM received")), "{stdout}");
    assert!((2..400).contains(&stopped), "{stopped}");
    assert_eq!(latest(&signal), format!("iter_{stopped:07}"));
    let total = (stopped + 2).to_string();
    ok(&sft(
        &args(SMALL, &args(&schedule, &["--train-iters", &total, "--load", s, "--save", s, "--output-dir", s])),
        &[],
    ));
    assert_eq!(losses(&signal), uninterrupted(&total));
}

/// Megatron's blend of corpora (`--data-path 0.3 A 0.7 B`): each corpus split on its own and
/// said in a line; a blend of one is that corpus; a blended run stopped and resumed by the same
/// command is the uninterrupted run; another blend does not resume it; and a corpus too small
/// for the split is named. Which corpus each sample comes from is Megatron's own order (pinned
/// in `data::blend` against megatron-core's helper).
#[test]
fn megatrons_blend_of_corpora_trains_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (indexed, jsonl) = (megatron_fixture("corpus_text_document"), megatron_fixture("corpus.jsonl"));
    let (indexed, jsonl) = (indexed.as_str(), jsonl.as_str());
    // The same 12 documents twice, as Megatron's pair and as jsonl: 10 train blocks each, which
    // 6 iterations of 2 blocks pass through at 0.7 (8.4 blocks) and not at 0.3.
    let common = ["--lr-decay-iters", "30", "--split", "10,2,2", "--eval-interval", "3"];
    let run = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        let stdout = ok(&sft(&args(SMALL, &args(&common, &args(&["--output-dir", out.to_str().unwrap()], more))), &[]));
        (out, stdout)
    };
    let blend = ["--data-path", "30", indexed, "70", jsonl];
    let (whole, log) = run("whole", &args(&blend, &["--train-iters", "6"]));
    let lines = [
        format!("corpus {indexed} at 0.300 of the train samples (Megatron's indexed dataset, read in place): 12 documents, 239 tokens, 14 blocks of 16 tokens: train 10, valid 2, test 2"),
        format!("corpus {jsonl} at 0.700 of the train samples: 12 documents, 239 tokens, 14 blocks of 16 tokens: train 10, valid 2, test 2"),
    ];
    for line in &lines {
        assert!(log.contains(line.as_str()), "{line}\n{log}");
    }
    assert_eq!(losses(&whole).len(), 6);
    let (lone, _) = run("lone", &["--data-path", jsonl, "--train-iters", "6"]);
    let (one, one_log) = run("one", &["--data-path", "1", jsonl, "--train-iters", "6"]);
    assert!(one_log.contains("corpus: 12 documents, 239 tokens"), "{one_log}");
    assert_eq!(losses(&one), losses(&lone), "a blend of one corpus is that corpus");
    assert_ne!(losses(&whole), losses(&lone), "the blend draws other blocks than one corpus");

    // --exit-interval 3 twice with --save and --load of one directory: the pieces are the whole.
    let root = tmp.path().join("pieces");
    let r = root.to_str().unwrap();
    let command = args(&blend, &["--train-iters", "6", "--exit-interval", "3", "--save", r, "--load", r]);
    let (_, first) = run("pieces", &command);
    assert!(first.contains("exiting program at iteration 3"), "{first}");
    let state: Value = serde_json::from_slice(&read(root.join("iter_0000003").join("trainer_state.json"))).unwrap();
    assert_eq!(state["data_cursor"]["blend"].as_array().map(Vec::len), Some(2), "{state}");
    run("pieces", &command);
    assert_eq!(losses(&root), losses(&whole), "stopped at 3 and resumed: the uninterrupted blend");

    // Other weights do not resume it; a corpus too small for a block is named.
    let reweighed = ["--data-path", "50", indexed, "50", jsonl, "--train-iters", "8", "--load", r];
    let o = tmp.path().join("refused");
    let e =
        error_line(&sft(&args(SMALL, &args(&common, &args(&reweighed, &["--output-dir", o.to_str().unwrap()]))), &[]));
    assert!(e.contains("trained on different data"), "{e}");
    let small = tmp.path().join("small.jsonl");
    std::fs::write(&small, "{\"text\": \"Only a few words here, twenty tokens or so, in one document.\"}\n").unwrap();
    let small_blend = ["--data-path", "0.5", jsonl, "0.5", small.to_str().unwrap(), "--train-iters", "2"];
    let e = error_line(&sft(
        &args(SMALL, &args(&common, &args(&small_blend, &["--output-dir", o.to_str().unwrap()]))),
        &[],
    ));
    assert!(e.contains(&format!("corpus {} of --data-path: the corpus gives 0 blocks", small.display())), "{e}");
}

/// Megatron's sample-based run (`--train-samples`, `--lr-warmup-samples`, `--lr-decay-samples`)
/// whose counts are whole global batches is the iteration-based run of those batches, loss for
/// loss; the samples past the last whole batch are dropped, as Megatron drops them.
#[test]
fn a_sample_based_run_is_its_iteration_based_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        let stdout =
            ok(&sft(&args(SMALL, &args(&["--eval-interval", "0", "--output-dir", out.to_str().unwrap()], more)), &[]));
        (out, stdout)
    };
    // Micro-batch 2 on one rank: 13 samples are 6 iterations, 4 and 12 samples 2 and 6.
    let (samples, log) =
        run("samples", &["--train-samples", "13", "--lr-warmup-samples", "4", "--lr-decay-samples", "12"]);
    assert!(
        log.contains("--train-samples 13: 6 iterations of 2 samples (the last 1 dropped, as Megatron does)"),
        "{log}"
    );
    let (iterations, _) = run("iterations", &["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "6"]);
    assert_eq!(losses(&samples).len(), 6);
    assert_eq!(losses(&samples), losses(&iterations));
}

/// Megatron's `--finetune`: `--load`'s weights (a checkpoint root's latest, or a model directory)
/// at iteration 0 with a fresh optimizer, on other data; the model's shape comes from them.
#[test]
fn finetune_starts_from_the_loaded_weights_at_iteration_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = megatron_fixture("corpus.jsonl");
    let jsonl = jsonl.as_str();
    let pretrained = tmp.path().join("pretrained");
    let p = pretrained.to_str().unwrap();
    let pretraining = ["--train-iters", "20", "--lr", "5e-3", "--lr-warmup-iters", "0", "--eval-interval", "0"];
    ok(&sft(&args(SMALL, &args(&pretraining, &["--output-dir", p])), &[]));
    let weights = |dir: &Path| read(dir.join(latest(dir)).join("model.safetensors"));

    // One update at the warm-up's rate of 0 changes nothing: the saved weights are the loaded
    // ones, saved at iteration 1 (not 21), from a run on the other corpus.
    let on_other_data = ["--data-path", jsonl, "--split", "10,2,2", "--eval-interval", "0", "--train-iters", "1"];
    for (name, load) in [("from-root", p.to_string()), ("from-dir", format!("{p}/iter_0000020"))] {
        let out = tmp.path().join(name);
        let more = ["--lr-warmup-iters", "2", "--load", &load, "--finetune", "--output-dir", out.to_str().unwrap()];
        let log = ok(&sft(&args(SMALL, &args(&on_other_data, &more)), &[]));
        let line =
            format!("--finetune: the weights of {p}/iter_0000020 at iteration 0, with a fresh optimizer and data");
        assert!(log.contains(&line), "{line}\n{log}");
        assert_eq!(latest(&out), "iter_0000001");
        assert_eq!(weights(&out), weights(&pretrained), "{name}: the loaded weights, unchanged by an update at rate 0");
    }
    // Trained on, the loaded model starts lower than a fresh one on the same blocks (10.39
    // against 10.82 when written: 20 iterations of Shakespeare already help on other English).
    let first_loss = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        ok(&sft(&args(SMALL, &args(&on_other_data, &args(more, &["--output-dir", out.to_str().unwrap()]))), &[]));
        losses(&out)[&1]
    };
    let (tuned, fresh) = (first_loss("tuned", &["--load", p, "--finetune"]), first_loss("fresh", &[]));
    assert!(tuned < fresh - 0.2, "fine-tuned {tuned}, fresh {fresh}");

    // The shape is the loaded model's: a flag that disagrees, or a preset, is refused in one line.
    let o = tmp.path().join("refused");
    let refused = |more: &[&str]| {
        error_line(&sft(&args(SMALL, &args(&on_other_data, &args(more, &["--output-dir", o.to_str().unwrap()]))), &[]))
    };
    let e = refused(&["--load", p, "--finetune", "--num-layers", "2"]);
    assert!(e.contains("--num-layers 2: --finetune takes the model from") && e.contains("whose n_layer is 1"), "{e}");
    let e = refused(&["--load", p, "--finetune", "--model", "gpt2"]);
    assert!(e.contains("--model") && e.contains("--finetune"), "{e}");
    let e = refused(&["--finetune"]);
    assert!(e.contains("--load"), "{e}");
}

/// Megatron's `--train-data-path`, `--valid-data-path` and `--test-data-path`: each split its
/// own corpora, each whole. A lone train corpus trains as `--data-path` of it with all its
/// blocks in train; the validation corpus is what is evaluated.
#[test]
fn megatrons_data_path_per_split_serves_each_split_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let (indexed, jsonl) = (megatron_fixture("corpus_text_document"), megatron_fixture("corpus.jsonl"));
    let (indexed, jsonl) = (indexed.as_str(), jsonl.as_str());
    let run = |name: &str, more: &[&str]| {
        let out = tmp.path().join(name);
        let common = ["--train-iters", "4", "--lr-decay-iters", "8", "--eval-interval", "2", "--output-dir"];
        let stdout = ok(&sft(&args(SMALL, &args(&common, &args(&[out.to_str().unwrap()], more))), &[]));
        (out, stdout)
    };
    let valid_losses = |dir: &Path| -> Vec<f64> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines().filter_map(|l| serde_json::from_str::<Value>(l).unwrap()["valid_loss"].as_f64()).collect()
    };
    let per_split = ["--train-data-path", jsonl, "--valid-data-path", indexed, "--test-data-path", indexed];
    let (split_dir, log) = run("per-split", &per_split);
    for line in [
        format!("corpus {jsonl} at 1.000 of the train samples: 12 documents, 239 tokens, 14 blocks of 16 tokens: train 14, valid 0, test 0"),
        format!("corpus {indexed} at 1.000 of the validation samples (Megatron's indexed dataset, read in place): 12 documents, 239 tokens, 14 blocks of 16 tokens: train 0, valid 14, test 0"),
    ] {
        assert!(log.contains(&line), "{line}\n{log}");
    }
    assert!(log.contains("test loss at iteration 4"), "{log}");
    let (whole, _) = run("whole", &["--data-path", jsonl, "--split", "1,0,0"]);
    assert_eq!(losses(&split_dir), losses(&whole), "the lone train corpus trains as --data-path with all in train");
    assert!(valid_losses(&whole).is_empty(), "--split 1,0,0 has no validation");
    // The same documents as jsonl for validation: the same validation losses.
    let (jsonl_valid, _) = run("jsonl-valid", &["--train-data-path", jsonl, "--valid-data-path", jsonl]);
    assert_eq!(valid_losses(&split_dir).len(), 2, "at 2 and at the end");
    assert_eq!(valid_losses(&jsonl_valid), valid_losses(&split_dir));

    let o = tmp.path().join("refused");
    let refused = |more: &[&str]| {
        error_line(&sft(&args(SMALL, &args(&["--train-iters", "2", "--output-dir", o.to_str().unwrap()], more)), &[]))
    };
    let e = refused(&["--train-data-path", jsonl, "--split", "90,5,5"]);
    assert!(e.contains("--split") && e.contains("--train-data-path"), "{e}");
    let e = refused(&["--valid-data-path", jsonl]);
    assert!(e.contains("--train-data-path"), "{e}");
    let e = refused(&["--train-data-path", "0.3", jsonl, "0.7"]);
    assert!(e.contains("--train-data-path 0.3") && e.contains("not weights and corpora in pairs"), "{e}");
}
