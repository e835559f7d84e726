//! End-to-end tests of `reward` (step 2): a short run on the demo pairs learns (accuracy rises
//! above chance), writes reward_eval.json and saves a GPT2ForSequenceClassification directory;
//! bad input is one clear error line with exit code 2.

use std::process::{Command, Output};

fn reward(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reward")).args(args).output().expect("spawn reward")
}

#[test]
fn a_short_run_learns_the_demo_pairs_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("reward");
    let cache = dir.path().join("data");
    let run = reward(&[
        "--data-path",
        "demo",
        "--data-split",
        "2,6,2",
        "--model-name-or-path",
        "tiny",
        "--max-seq-len",
        "48",
        "--per-device-train-batch-size",
        "16",
        "--per-device-eval-batch-size",
        "64",
        "--learning-rate",
        "1e-3",
        "--num-train-epochs",
        "2",
        "--num-warmup-steps",
        "10",
        "--dropout",
        "0",
        "--output-dir",
        out.to_str().unwrap(),
        "--data-output-path",
        cache.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "reward failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    // The demo's step-2 share less its rows about the held-out countries (step 1's only).
    assert!(stdout.contains("data phase 2 (reward): 2031 train / 203 eval rows from demo"), "{stdout}");

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("reward_eval.json")).unwrap()).unwrap();
    let (before, after) = (&report["before_training"], &report["final"]);
    assert_eq!(after["pairs"], 203);
    let (acc0, acc) = (before["accuracy"].as_f64().unwrap(), after["accuracy"].as_f64().unwrap());
    // Held-out accuracy after a short run from random init is noisy (one epoch gave 0.57 to 0.71
    // with numerically equivalent kernels); two epochs gave 0.679 (composed ops) and 0.692 (fused),
    // and 0.783 without the held-out countries' pairs.
    assert!(acc > 0.65 && acc > acc0 + 0.04, "two epochs from random init learn the held-out pairs: {acc0} -> {acc}");
    let q = &after["margin_quantiles"];
    assert!(q["q50"].as_f64().unwrap() > 0.0, "most margins are positive: {report}");
    assert!(
        q["q00"].as_f64().unwrap() <= q["q50"].as_f64().unwrap()
            && q["q50"].as_f64().unwrap() <= q["q100"].as_f64().unwrap()
    );
    assert!(after["score_length_correlation"].as_f64().unwrap().abs() <= 1.0);

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "GPT2ForSequenceClassification");
    assert_eq!(config["num_labels"], 1);
    assert_eq!(config["pad_token_id"], 50256);
    let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&out, &candle_core::Device::Cpu).unwrap();
    assert_eq!(files.extra_tensors["score.weight"].dims(), [1, 128]);
}

/// DS-Chat's step-2 flags take effect: `--num_padding_at_beginning 1` (OPT's) is read as 0 on
/// GPT-2's rows, which begin with no padding, and says so; `--eval_interval` evaluates between
/// epochs, `--eval_iters` caps the eval batches; `--print_loss` prints each micro-batch's loss.
#[test]
fn ds_chats_step2_flags_take_effect() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("reward");
    let run = reward(&[
        "--data_path",
        "demo",
        "--data_split",
        "8,1,1",
        "--model_name_or_path",
        "tiny",
        "--max_seq_len",
        "48",
        "--per_device_train_batch_size",
        "16",
        "--per_device_eval_batch_size",
        "8",
        "--num_padding_at_beginning",
        "1",
        "--eval_interval",
        "5",
        "--eval_iters",
        "2",
        "--print_loss",
        "--deepspeed",
        "--no-data-cache",
        "--output_dir",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "reward failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("--num-padding-at-beginning 1: the rows do not begin with padding"), "{stdout}");
    assert!(stdout.contains("***** Evaluating reward, Step 5 *****"), "{stdout}");
    assert!(stdout.contains("***** Evaluating reward, Epoch 1/1 *****"), "{stdout}");
    assert!(stdout.contains("Epoch: 0, Step: 0, Rank: 0, loss = "), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("reward_eval.json")).unwrap()).unwrap();
    assert_eq!(report["final"]["pairs"], 16, "2 eval batches of 8 on the one rank");
}

#[test]
fn bad_input_is_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let check = |args: &[&str], want: &[&str]| {
        let mut all = vec!["--output-dir", out, "--no-data-cache", "--max-seq-len", "48"];
        all.extend_from_slice(args);
        let run = reward(&all);
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line, got:\n{stderr}");
        for w in want {
            assert!(stderr.contains(w), "{args:?}: want {w:?} in {stderr}");
        }
    };
    check(&["--data-path", "demo", "--data-split", "1,0,1"], &["--data-split", "phase 2"]);
    check(&["--data-path", "demo", "--loss", "hinge"], &["hinge"]);
    check(&["--data-path", "demo", "--model-name-or-path", "/no/such/model"], &["/no/such/model", "does not exist"]);
    check(&["--data-path", "demo", "--zero-stage", "4"], &["--zero-stage"]);
    check(&["--data-path", "demo", "--learning-rate=-1"], &["--learning-rate"]);
    check(&["--data-path", "demo", "--only-optimize-lora"], &["--only-optimize-lora", "--lora-dim"]);
    check(&["--data-path", "demo", "--lora-dim", "2", "--lora-module-name", "decoder."], &["--lora-module-name"]);
    check(&["--data-path", "demo", "--beta", "0.5"], &["--beta", "--algorithm dpo"]);
    check(&["--data-path", "demo", "--algorithm", "dpo", "--loss", "last-token"], &["--loss", "--dpo-loss"]);
    check(&["--data-path", "demo", "--algorithm", "dpo", "--beta", "0"], &["--beta"]);
    check(&["--data-path", "demo", "--rpo-alpha", "1"], &["--rpo-alpha", "--algorithm dpo"]);
    check(&["--data-path", "demo", "--algorithm", "dpo", "--rpo-alpha=-1"], &["--rpo-alpha"]);
}

/// `--only-optimize-lora` in step 2: the adapters and the score head train (DS-Chat forces its
/// `v_head` into the optimizer), the trunk does not; the saved model has LoRA merged and the
/// adapter saved alone (with the head as PEFT's modules_to_save) on the unchanged starting
/// model gives the saved model's scores.
#[test]
fn lora_only_run_saves_a_merged_model_and_an_adapter_that_reproduces_it() {
    use candle_core::{Device, Tensor};
    use hybrid_engine::lora::peft::load_peft_adapter;
    use hybrid_engine::model::gpt2::Gpt2Config;
    use hybrid_engine::model::positions::Positions;
    use hybrid_engine::model::reward_model::{RewardModel, SCORE_WEIGHT};
    use hybrid_engine::ParamStore;

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("reward");
    let run = reward(&[
        "--data-path",
        "demo",
        "--data-split",
        "6,2,2",
        "--model-name-or-path",
        "tiny",
        "--max-seq-len",
        "48",
        "--per-device-train-batch-size",
        "16",
        "--per-device-eval-batch-size",
        "64",
        "--num-train-epochs",
        "1",
        "--dropout",
        "0",
        "--lora_dim",
        "2",
        "--lora_module_name",
        "attn",
        "--only_optimize_lora",
        "--lora-learning-rate",
        "2e-3",
        "--output-dir",
        out.to_str().unwrap(),
        "--no-data-cache",
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "reward failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("LoRA: rank 2 on 8 linears matching \"attn\""), "{stdout}");
    assert!(stdout.contains("only LoRA is optimized"), "{stdout}");

    let d = Device::Cpu;
    let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&out, &d).unwrap();
    assert_eq!(files.extra_tensors.keys().collect::<Vec<_>>(), [SCORE_WEIGHT], "no adapter tensors in the model");
    let mut saved = ParamStore::from_tensors(&files.config, &files.tensors, &d).unwrap();
    saved.push(SCORE_WEIGHT, &files.extra_tensors[SCORE_WEIGHT]).unwrap();

    // The starting model: the tiny preset at the default seed; its trunk must be unchanged
    // wherever no adapter merged into it.
    let cfg = Gpt2Config::tiny();
    let mut base = ParamStore::init(&cfg, 1234, &d).unwrap();
    for (name, var) in base.iter() {
        let diff = (var.as_tensor() - saved.get(name).unwrap().as_tensor()).unwrap().abs().unwrap();
        let diff: f32 = diff.max_all().unwrap().to_scalar().unwrap();
        let adapted = name.contains(".attn.c_") && name.ends_with(".weight");
        assert_eq!(diff > 0.0, adapted, "{name}: changed by {diff}");
    }

    let adapter = load_peft_adapter(&out.join("adapter"), &d).unwrap();
    assert_eq!((adapter.task_type.as_str(), adapter.adapters.len()), ("SEQ_CLS", 8));
    let (head_name, head) = &adapter.modules_to_save[0];
    assert_eq!(head_name, SCORE_WEIGHT);
    base.push(SCORE_WEIGHT, head).unwrap();
    base.add_adapters(adapter.scaling(), &adapter.adapters).unwrap();
    let ids = Tensor::new(&[[464u32, 3139, 286, 4881, 318, 6342, 13, 50256]], &d).unwrap();
    let scores = |p: &ParamStore| {
        let rm = RewardModel::new(p, &files.config).unwrap();
        rm.token_scores(&rm.trunk.forward_blocks(&ids, &Positions::default(), None, None).unwrap()).unwrap()
    };
    let diff: f32 = (scores(&saved) - scores(&base)).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
    assert!(diff < 1e-5, "base + adapter scores differ from the saved (merged) model's by {diff}");
}

/// `--algorithm dpo`: the starting model trains on the demo pairs against its frozen copy. At
/// the start the policy is the reference, so the sigmoid loss is ln 2, the implicit rewards 0
/// and no pair is ranked right; after one epoch from random weights the eval pairs' implicit
/// reward ranks most of them right with a positive margin, and the result is a causal LM (no
/// score head).
#[test]
fn dpo_trains_the_actor_on_the_pairs_against_its_frozen_copy() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("dpo");
    let run = reward(&[
        "--algorithm",
        "dpo",
        "--beta",
        "0.1",
        "--data-path",
        "demo",
        // Step 2's share of the demo is 20% here (about 670 training pairs), not
        // the demo's 60%: the policy and its frozen reference both run the 50k-token LM head
        // on every pair, the slowest training in the suite.
        "--data-split",
        "6,2,2",
        "--model-name-or-path",
        "tiny",
        "--max-seq-len",
        "48",
        "--per-device-train-batch-size",
        "16",
        "--per-device-eval-batch-size",
        "64",
        "--learning-rate",
        "1e-3",
        "--num-train-epochs",
        "1",
        "--num-warmup-steps",
        "10",
        "--dropout",
        "0",
        "--no-data-cache",
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "dpo failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let evals: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| r.get("eval").cloned())
        .collect();
    assert_eq!(evals.len(), 2, "{stdout}");
    let (before, after) = (&evals[0], &evals[1]);
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    assert!((f(before, "loss") - std::f64::consts::LN_2).abs() < 1e-5, "policy = reference: {before}");
    assert_eq!(f(before, "reward_accuracy"), 0.0, "{before}");
    // Measured 0.6875 (from random weights, one epoch of 800 pairs; 0.6625 before the demo data
    // had off-topic rejections); chance is 0.5, a wrong sign would be below.
    assert!(f(after, "reward_accuracy") > 0.6 && f(after, "reward_margin") > 0.0, "{before} -> {after}");
    assert!(f(after, "loss") < f(before, "loss"), "{before} -> {after}");
    let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&out, &candle_core::Device::Cpu).unwrap();
    assert!(!files.extra_tensors.contains_key("score.weight"));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
}

/// `--rpo-alpha` (RPO: DPO plus alpha times the chosen answers' NLL per token). At the first
/// step the policy is its reference, so the DPO term is ln 2 and the rest is alpha x the NLL:
/// twice the alpha, twice the excess, and for the untrained tiny model about ln(vocabulary).
#[test]
fn rpo_adds_alpha_times_the_chosen_answers_nll() {
    let dir = tempfile::tempdir().unwrap();
    let first_loss = |alpha: &str| {
        let out = dir.path().join(format!("rpo-{alpha}"));
        #[rustfmt::skip]
        let run = reward(&[
            "--algorithm", "dpo", "--rpo-alpha", alpha, "--data-path", "demo", "--data-split", "98,1,1",
            "--model-name-or-path", "tiny", "--max-seq-len", "48", "--per-device-train-batch-size", "16",
            "--num-train-epochs", "1", "--dropout", "0", "--no-data-cache", "--output-dir", out.to_str().unwrap(),
        ]);
        assert!(run.status.success(), "rpo {alpha}: {}", String::from_utf8_lossy(&run.stderr));
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let step1 = metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|r| r["step"] == 1 && r.get("loss").is_some())
            .expect("a first step");
        step1["loss"].as_f64().unwrap() - std::f64::consts::LN_2
    };
    let (one, two) = (first_loss("1"), first_loss("2"));
    assert!((two - 2.0 * one).abs() < 1e-4 * two, "alpha 1: ln 2 + {one}, alpha 2: ln 2 + {two}");
    assert!((one - 50257f64.ln()).abs() < 1.0, "the tiny model's NLL per token {one} is not about ln(50257)");
}
