//! End-to-end tests of the `train` launcher: the embedded demo (the three steps on the CPU, each
//! in its own process) meets its targets and leaves models that load and chat; unsupported
//! requests are one clear error line.

use std::path::Path;
use std::process::{Command, Output};

fn train(args: &[&str]) -> Output {
    train_env(args, &[])
}

/// `train` with these variables, and none of the machine user's wandb settings.
fn train_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("WANDB_") || k == "RLHF_ENABLE_WANDB") {
        cmd.env_remove(k);
    }
    cmd.args(args).envs(env.iter().copied()).output().expect("spawn train")
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The demo itself, as `train` runs it with no arguments (here into a temporary directory, with
/// --enable-tensorboard and offline --enable-wandb, which add event files and wandb rows and
/// change nothing else).
#[test]
fn the_demo_lowers_perplexity_trains_an_accurate_reward_model_and_ppo_beats_sft() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("output");
    let home = dir.path().to_str().unwrap();
    let run = train_env(
        &["--output-dir", out.to_str().unwrap(), "--enable-tensorboard", "--enable-wandb", "--wandb-run-name", "demo"],
        &[("WANDB_MODE", "offline"), ("HOME", home)],
    );
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    // Piped output gets log lines, never bar drawing (carriage returns, escape sequences).
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    for (name, text) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(!text.contains('\r') && !text.contains('\x1b'), "progress drawn into piped {name}");
    }
    for line in [
        "---=== Running Step 1 ===---",
        "---=== Finished Step 1 in",
        "---=== Running Step 2 ===---",
        "---=== Running Step 3 ===---",
        "---=== Summary ===---",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }

    // Step 1: perplexity on the held-out SFT rows falls far below the random model's.
    let ppl = step1_perplexity(&out);
    assert!(ppl[0] > 1000.0 && *ppl.last().unwrap() < 2.0, "SFT perplexity {ppl:?}");

    // Step 2: from the step-1 actor, at least 0.9 accuracy on the held-out demo pairs.
    assert!(stdout.contains("step 2 reward model: the step-1 actor"), "{stdout}");
    let report = json(&out.join("reward/reward_eval.json"));
    let acc = report["final"]["accuracy"].as_f64().unwrap();
    assert!(acc >= 0.9, "reward accuracy {acc}: {report}");

    // Step 3: on the held-out prompts PPO raises the reward model's score and the rule-based
    // task score. Measured with this recipe (docs/RLHF-INVESTIGATION.md, section 19): 4.540 ->
    // 5.058 and 0.750 -> 0.865 (+6 of 52 prompts) since 2026-12-01's learning-rate stepping (5.734
    // -> 7.141 and +8 prompts before it). The margins asserted, +0.5 and +0.10 (6 prompts),
    // fail for a policy that does not learn (+0) or learns the wrong way (an advantage of the
    // wrong sign lowers both), and for the earlier recipe (clipped raw scores: +0.05 task).
    let metrics = std::fs::read_to_string(out.join("step3/metrics.jsonl")).unwrap();
    let end: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let (sft, ppo) = (&end["summary"]["sft_eval"], &end["summary"]["ppo_eval"]);
    let reward = |e: &serde_json::Value| e["reward_mean"].as_f64().unwrap();
    let task = |e: &serde_json::Value| e["task_success"].as_f64().unwrap();
    assert!(reward(ppo) >= reward(sft) + 0.5, "reward-model score SFT {} -> PPO {}", reward(sft), reward(ppo));
    assert!(task(ppo) >= task(sft) + 0.10, "task score SFT {} -> PPO {}", task(sft), task(ppo));
    for dir in ["step3/actor", "step3/critic"] {
        assert!(out.join(dir).join("model.safetensors").is_file(), "{dir} was not saved");
    }
    // 52 held-out phrasings of the 40 countries steps 2 and 3 train on, and the 8 held-out
    // countries asked 8 ways each, scored apart.
    assert!(stdout.contains("held-out prompts (52)") && stdout.contains("held-out countries (64)"), "{stdout}");

    // --enable-tensorboard reached every step: one event file each in output/tensorboard, with
    // every metric its metrics.jsonl holds (step 3 also under DS-Chat's `reward`).
    use hybrid_engine::telemetry::tensorboard::{read_scalars, scalars_of_records, DS_CHAT_STEP3_TAGS};
    for (step, aliases) in [("actor", &[][..]), ("reward", &[]), ("step3", DS_CHAT_STEP3_TAGS)] {
        let files: Vec<_> =
            std::fs::read_dir(out.join("tensorboard").join(step)).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1, "{step}: {files:?}");
        let records = hybrid_engine::training::metrics::read_records(&out.join(step).join("metrics.jsonl")).unwrap();
        let scalars = read_scalars(&files[0]).unwrap();
        assert!(
            scalars == scalars_of_records(&records, aliases, 0),
            "{step}: the event file differs from metrics.jsonl"
        );
        assert!(scalars.len() > 100, "{step}: {} scalars", scalars.len());
    }
    // Step 3's sampled rollouts as a table in TensorBoard's text panel, at the steps that print them.
    let step3_events = std::fs::read_dir(out.join("tensorboard/step3")).unwrap().next().unwrap().unwrap().path();
    let texts = hybrid_engine::telemetry::tensorboard::read_texts(&step3_events).unwrap();
    let samples: Vec<_> = texts.iter().filter(|(_, tag, _)| tag == "rollout/samples").collect();
    assert!(!samples.is_empty() && samples[0].0 == 1, "rollout samples from the first step: {texts:?}");
    assert!(samples[0].2.starts_with("| prompt | answer | reward |"), "{}", samples[0].2);
    assert!(stdout.contains("TensorBoard: tensorboard --logdir"), "{stdout}");

    // --enable-wandb reached every step too: one wandb run each, named after the train run and
    // grouped under it, finished, holding the same scalars (a wandb row's keys are in name
    // order, so both sides are sorted). Without a key, `train wandb-sync` is one error line.
    let sorted = |mut v: Vec<(i64, String, f32)>| {
        v.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)).then(a.2.total_cmp(&b.2)));
        v
    };
    for (step, aliases) in [("actor", &[][..]), ("reward", &[]), ("step3", DS_CHAT_STEP3_TAGS)] {
        let wandb = out.join("wandb").join(step);
        let run_dir = wandb.join(std::fs::read_to_string(wandb.join("latest-run")).unwrap().trim());
        let record = json(&run_dir.join("run.json"));
        assert_eq!(record["display_name"], format!("demo-{step}").as_str());
        assert_eq!((record["group"].as_str(), record["exit_code"].as_i64()), (Some("demo"), Some(0)), "{record}");
        let (mut rows, mut steps) = (Vec::new(), Vec::new());
        for line in std::fs::read_to_string(run_dir.join("history.jsonl")).unwrap().lines() {
            let row: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line).unwrap();
            let at = row["_step"].as_i64().unwrap();
            steps.push(at);
            rows.extend(
                row.iter()
                    .filter(|(k, _)| !k.starts_with('_'))
                    .map(|(k, v)| (at, k.clone(), v.as_f64().unwrap() as f32)),
            );
        }
        let records = hybrid_engine::training::metrics::read_records(&out.join(step).join("metrics.jsonl")).unwrap();
        // One row per step, holding the step's last value of each name.
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "{step}: one wandb row per step, in order: {steps:?}");
        assert!(
            sorted(rows) == sorted(last_per_step_and_name(scalars_of_records(&records, aliases, 0))),
            "{step}: wandb rows differ from metrics.jsonl"
        );
    }
    assert!(stdout.contains("wandb: each step's rows are kept in"), "{stdout}");
    let sync = train_env(&["wandb-sync", out.join("wandb").to_str().unwrap()], &[("HOME", home)]);
    let stderr = String::from_utf8_lossy(&sync.stderr).to_string();
    assert_eq!((sync.status.code(), stderr.lines().count()), (Some(2), 1), "{stderr}");
    assert!(stderr.contains("WANDB_API_KEY"), "{stderr}");

    // Each step drew its curves beside its metrics.jsonl: PNGs of 2 panels per row, 640 x 400
    // each (step 1: loss, perplexity, learning rate, throughput; step 2: + accuracy and margin;
    // step 3: reward, KL, clip fraction, entropy, answer length, losses, learning rates; the
    // loss scale only in fp16). The summary names them, and `train plot` redraws the same.
    let png_size = |path: &Path| {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n") && &bytes[12..16] == b"IHDR",
            "{} is not a PNG",
            path.display()
        );
        assert!(bytes.len() > 20_000, "{}: {} bytes, a blank canvas?", path.display(), bytes.len());
        let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        (be(16), be(20))
    };
    let expected = [("actor", (1280, 800)), ("reward", (1280, 1200)), ("step3", (1280, 1600))];
    for (step, size) in expected {
        assert_eq!(png_size(&out.join(step).join("curves.png")), size, "{step}");
    }
    assert!(stdout.contains("training curves: ") && stdout.contains("step3/curves.png"), "{stdout}");
    for (step, _) in expected {
        std::fs::remove_file(out.join(step).join("curves.png")).unwrap();
    }
    let replot = train(&["plot", out.to_str().unwrap()]);
    let replot_out = String::from_utf8_lossy(&replot.stdout).to_string();
    assert!(replot.status.success(), "train plot: {replot_out}{}", String::from_utf8_lossy(&replot.stderr));
    for (step, size) in expected {
        assert_eq!(png_size(&out.join(step).join("curves.png")), size, "{step} redrawn");
    }
    assert!(replot_out.contains("Reward, KL to the reference, Clip fraction"), "{replot_out}");

    // The run report: one file with the summary, each step's flags and curves (linked), and
    // the 116 held-out prompts with both actors' answers, marked by the task scorer.
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(stdout.contains("run report: ") && report.starts_with("# RLHF run report"), "{stdout}");
    assert!(report.contains("task score SFT") && report.contains("| 3 (PPO) |"), "{report}");
    for step in ["actor", "reward", "step3"] {
        let target = format!("]({step}/curves.png)");
        assert_eq!(report.matches(&target).count(), 1, "{step}'s curves linked as {target}: {report}");
    }
    assert!(report.len() < 64 * 1024, "report.md is text: {} bytes", report.len());
    for step in ["Step 1 (SFT):", "Step 2 (reward model):", "Step 3 (PPO):"] {
        let flags = report.split(step).nth(1).unwrap_or_else(|| panic!("{step} flags missing"));
        assert!(flags.trim_start().starts_with("```\n") && flags.contains("--data-path demo"), "{step}");
    }
    let rows: Vec<&str> =
        report.lines().filter(|l| l.starts_with("| ") && (l.contains(" | ✓ ") || l.contains(" | ✗ "))).collect();
    assert_eq!(rows.len(), 52 + 64, "{report}");
    let correct = |rows: &[&str], column: usize| {
        rows.iter().filter(|r| r.split(" | ").nth(column).unwrap().starts_with('✓')).count() as f64 / rows.len() as f64
    };
    let (phrasings, countries) = rows.split_at(52);
    let countries_task = |e: &serde_json::Value| e["heldout_country_task_success"].as_f64().unwrap();
    assert_eq!(
        [correct(phrasings, 2), correct(phrasings, 3), correct(countries, 2), correct(countries, 3)],
        [task(sft), task(ppo), countries_task(sft), countries_task(ppo)],
        "the marks are the task scores"
    );

    // Each step's log holds its output; the models are HF directories the next tools read.
    let log = std::fs::read_to_string(out.join("actor/training.log")).unwrap();
    assert!(log.contains("Evaluating perplexity") && log.contains("saved the fine-tuned model"), "{log}");
    assert!(std::fs::read_to_string(out.join("reward/training.log")).unwrap().contains("acc (higher is better)"));
    assert_eq!(json(&out.join("actor/config.json"))["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(json(&out.join("reward/config.json"))["architectures"][0], "GPT2ForSequenceClassification");

    let chat = Command::new(env!("CARGO_BIN_EXE_chat"))
        .args(["--path", out.join("step3/actor").to_str().unwrap(), "--prompt", "What is the capital of France?"])
        .args(["--chat-format", "--greedy", "--max-new-tokens", "12"])
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&chat.stdout).to_string();
    assert!(chat.status.success(), "{}", String::from_utf8_lossy(&chat.stderr));
    assert!(answer.contains("Paris"), "the PPO actor answers a training-distribution question: {answer:?}");

    // The demo on 2 ranks (single_node), step 1: each rank takes half of every batch, so the run
    // follows the one-process demo, up to the rounding of summing the gradients over ranks, which
    // Adam amplifies over 750 steps (the first evaluation agrees to 1e-5, the last measured 1.300
    // and 1.296). Step 1 only, for CI's time (the whole 2-rank demo took 5m50s of this test's 11
    // minutes on 2 cores): steps 2 and 3 split their batches by the same recipe arithmetic
    // (recipe_args.rs: every demo recipe's global batch equal on 1 and 4 ranks), and
    // tests/distributed.rs shows each step on 2 and 3 ranks equal to one rank.
    let out2 = dir.path().join("output-2-ranks");
    let run = train(&[
        "--demo",
        "--step",
        "1",
        "--deployment-type",
        "single_node",
        "--num-gpus",
        "2",
        "--output-dir",
        out2.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "2-rank demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("data parallel: 2 ranks"), "{stdout}");
    let (one, two) = (step1_perplexity(&out), step1_perplexity(&out2));
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * a.abs().max(1.0);
    assert_eq!(one.len(), two.len(), "the same evaluations: {one:?} {two:?}");
    assert!(close(one[0], two[0], 1e-5), "the same initial model: {one:?} {two:?}");
    assert!(close(*one.last().unwrap(), *two.last().unwrap(), 0.02), "{one:?} {two:?}");
}

/// Step 1's evaluation perplexities, in order, from its metrics.jsonl's summary.
fn step1_perplexity(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("actor/metrics.jsonl")).unwrap();
    let end: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    serde_json::from_value(end["summary"]["perplexity"].clone()).unwrap()
}

#[test]
fn unsupported_requests_are_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("output");
    let out = out.to_str().unwrap();
    let check = |args: &[&str], want: &[&str]| {
        let mut all = vec!["--output-dir", out];
        all.extend_from_slice(args);
        let run = train(&all);
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line, got:\n{stderr}");
        for w in want {
            assert!(stderr.contains(w), "{args:?}: want {w:?} in {stderr}");
        }
    };
    // single_node and multi_node run every step across ranks (tests/distributed.rs,
    // tests/multi_node.rs); what they cannot do is refused.
    check(
        &["--step", "1", "--deployment-type", "multi_node", "--hostfile", "/no/such/hostfile"],
        &["/no/such/hostfile"],
    );
    check(&["--step", "1", "--hostfile", "hosts"], &["--hostfile sets up --deployment-type multi_node"]);
    check(&["--step", "1", "--num-gpus", "2"], &["--num-gpus 2", "single_node"]);
    check(&["--step", "1", "--deployment-type", "cluster"], &["cluster", "single_gpu"]);
    check(&["--step", "4"], &["--step 4"]);
    // e2e_rlhf.py's OPT sizes name the GPT-2 size to use; a stage that does not exist is refused.
    check(&["--actor-model", "1.3b"], &["--actor-model 1.3b", "OPT", "gpt2-xl"]);
    check(&["--step", "1", "2", "--reward-model", "350m"], &["--reward-model 350m", "gpt2-medium"]);
    check(&["--actor-zero-stage", "5"], &["--actor-zero-stage", "0, 1, 2 or 3", "recipe's default"]);
    check(&["--step", "3"], &["step 3 needs the step-1 model", "train --step 1"]);
    check(&["--step", "2", "3"], &["step 3 needs the step-1 model", "train --step 1"]);
    let actor = format!("{out}/actor");
    check(&["--step", "2", "--reward-model", &actor], &["step 2 starts from the step-1 actor", "train --step 1"]);
    // Step 3 continues from the outputs of steps 1 and 2: naming their starting models does nothing.
    check(&["--step", "3", "--actor-model", "gpt2"], &["--actor-model", "step 1 is not run", "drop --actor-model"]);
    check(&["--step", "2", "3", "--actor-model", "gpt2"], &["--actor-model", "--step 1"]);
    check(&["--step", "1", "3", "--reward-model", "gpt2"], &["--reward-model", "step 2 is not run"]);
    // DPO replaces steps 2 and 3: it has no step 3 and trains no reward model.
    check(&["--algorithm", "dpo", "--step", "1", "3"], &["--algorithm dpo", "no step 3"]);
    check(&["--algorithm", "dpo", "--step", "1", "2", "--reward-model", "gpt2"], &["--reward-model"]);
    check(&["--algorithm", "dpo", "--step", "2"], &["step 2 starts from the step-1 actor", "train --step 1"]);
    // The demo splits its batches of 16 over the data-parallel ranks; its models are its own.
    check(
        &["--demo", "--deployment-type", "single_node", "--num-gpus", "3"],
        &["the demo's batches of 16 do not split over 3 data-parallel ranks"],
    );
    check(&["--demo", "--actor-model", "gpt2"], &["--demo", "--actor-model"]);
    // The arithmetic task's reward is a rule (no reward model, no step 2); its batches split as the demo's.
    check(&["--task", "arithmetic", "--algorithm", "ppo"], &["--algorithm ppo", "use grpo"]);
    check(&["--task", "arithmetic", "--step", "2"], &["no step 2", "drop 2 from --step"]);
    check(&["--task", "arithmetic", "--step", "3"], &["step-1 model", "train --task arithmetic --step 1"]);
    check(&["--task", "arithmetic", "--actor-model", "gpt2"], &["drop --actor-model"]);
    check(
        &["--task", "arithmetic", "--deployment-type", "single_node", "--num-gpus", "3"],
        &["the arithmetic task's batches of 16 do not split over 3 data-parallel ranks"],
    );
    check(&["--algorithm", "sac"], &["sac"]);
    check(&["--algorithm", "dpo", "--reward-zero-stage", "2"], &["--reward-zero-stage", "dpo"]);
    check(&["--algorithm", "grpo", "--step", "3", "--reward-zero-stage", "2"], &["--reward-zero-stage", "grpo"]);
    // A step's flags when the step is not run.
    check(&["--step", "1", "--reward-zero-stage", "1"], &["--reward-zero-stage", "neither is run"]);
    check(
        &["--step", "2", "--reward-model", "gpt2", "--actor-zero-stage", "2"],
        &["--actor-zero-stage", "none of them"],
    );
    check(&["--step", "1", "--algorithm", "grpo"], &["--algorithm grpo", "step 3 is not run"]);
    // wandb: a setting without wandb on; no key; one run id for three runs.
    check(&["--wandb-group", "g"], &["--wandb-group", "--enable-wandb"]);
    let home = dir.path().to_str().unwrap();
    let refused = |args: &[&str], env: &[(&str, &str)], want: &[&str]| {
        let run = train_env(&[&["--output-dir", out][..], args].concat(), &[&[("HOME", home)][..], env].concat());
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert_eq!((run.status.code(), stderr.lines().count()), (Some(2), 1), "{args:?}: {stderr}");
        for w in want {
            assert!(stderr.contains(w), "{args:?}: want {w:?} in {stderr}");
        }
    };
    refused(&["--enable-wandb"], &[], &["WANDB_API_KEY"]);
    refused(
        &["--wandb-project", "p"],
        &[("WANDB_MODE", "offline"), ("WANDB_RUN_ID", "abc")],
        &["WANDB_RUN_ID", "unset it"],
    );
    assert!(!Path::new(out).join("actor").exists(), "a refused run creates no step output");
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
