//! End-to-end tests of `ppo` (step 3) on small random models: a run saves the step-3 models and
//! logs the diagnostics; a run resumed from a checkpoint ends with exactly the weights of the
//! uninterrupted run; bad input is one clear error line.

use candle_core::Device;
use hybrid_engine::checkpoints::resume::save_model_dir;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::reward_model::{add_score_head, causal_lm_config, sequence_classification_config};
use hybrid_engine::ParamStore;
use std::path::Path;
use std::process::{Command, Output};

/// A 1-layer actor and reward model over the real GPT-2 vocabulary, and 60 demo-style prompts.
fn setup(dir: &Path) {
    let cfg = Gpt2Config { n_layer: 1, n_embd: 16, n_head: 2, n_positions: 64, ..Gpt2Config::tiny() };
    let tok = data::Tokenizer::gpt2_default().unwrap();
    let write_tok = |d: &Path| tok.save(&d.join("tokenizer.json"));
    let actor = ParamStore::init(&cfg, 1, &Device::Cpu).unwrap();
    save_model_dir(&dir.join("actor"), &causal_lm_config(&cfg), &actor, &write_tok).unwrap();
    let mut rm = ParamStore::init(&cfg, 2, &Device::Cpu).unwrap();
    add_score_head(&mut rm, &cfg, 2, &Device::Cpu).unwrap();
    save_model_dir(&dir.join("reward"), &sequence_classification_config(&cfg, 50256), &rm, &write_tok).unwrap();
    let rows: Vec<String> = (0..60)
        .map(|i| {
            let prompt = format!("\n\nHuman: What is {i} plus one?\n\nAssistant:");
            serde_json::json!({"prompt": prompt, "chosen": " x", "rejected": " y"}).to_string()
        })
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows.join("\n")).unwrap();
}

fn ppo(dir: &Path, out: &str, extra: &[&str]) -> Output {
    ppo_with_env(dir, out, extra, &[])
}

fn ppo_with_env(dir: &Path, out: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let d = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let mut args: Vec<String> = [
        "--data-path",
        &d("prompts.jsonl"),
        "--data-split",
        "0,0,1",
        "--no-data-cache",
        "--actor-model-name-or-path",
        &d("actor"),
        "--critic-model-name-or-path",
        &d("reward"),
        "--max-prompt-seq-len",
        "24",
        "--max-answer-seq-len",
        "6",
        "--per-device-generation-batch-size",
        "8",
        "--per-device-training-batch-size",
        "4",
        "--actor-learning-rate",
        "1e-3",
        "--num-warmup-steps",
        "2",
        "--do-sample",
        "--enable-ema",
        "--unsupervised-dataset-name",
        "shakespeare",
        "--unsup-coef",
        "0.5",
        "--print-answers-interval",
        "3",
        "--output-dir",
        &d(out),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // GRPO and RLOO refuse the critic's flags, and without a reward model too its path.
    if !critic_free(extra) {
        args.extend(["--critic-learning-rate".to_string(), "1e-3".to_string()]);
    } else if extra.contains(&"--no-reward-model") {
        let at = args.iter().position(|a| a == "--critic-model-name-or-path").expect("the critic's path");
        args.drain(at..at + 2);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(env!("CARGO_BIN_EXE_ppo")).args(&args).envs(env.iter().copied()).output().expect("spawn ppo")
}

/// The per-rollout records of a run's metrics.jsonl.
fn rollout_records(out: &Path) -> Vec<serde_json::Value> {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("rollout").is_some())
        .collect()
}

/// `extra` picks GRPO or RLOO, which train no critic.
/// The bytes of the files under `dir`.
fn directory_bytes(dir: &Path) -> u64 {
    let sizes = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path());
    sizes.map(|p| if p.is_dir() { directory_bytes(&p) } else { p.metadata().unwrap().len() }).sum()
}

fn critic_free(extra: &[&str]) -> bool {
    extra.windows(2).any(|w| w[0] == "--algorithm" && w[1] != "ppo")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "ppo failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// DS-Chat's step-3 script flags (run_1.3b.sh's, with `--enable_test_mode`): accepted, and
/// the test mode stops after `--test_stop_step` rollouts, then saves as a run's end does.
#[test]
fn ds_chats_script_flags_run_and_the_test_mode_stops_early() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let ds_chat = [
        "--num_padding_at_beginning",
        "1",
        "--deepspeed",
        "--seed",
        "1234",
        "--enable_hybrid_engine",
        "--offload_reference_model",
        "--actor_dropout",
        "0.0",
        "--lr_scheduler_type",
        "cosine",
        "--enable_tensorboard",
        "--enable_test_mode",
        "--test_stop_step",
        "2",
        "--no-final-checkpoint",
    ];
    let log = ok(&ppo(dir.path(), "out", &ds_chat));
    assert!(log.contains("--enable-test-mode: stopping after 2 rollouts"), "{log}");
    assert!(log.contains("--offload-reference-model: no effect on the CPU"), "{log}");
    let out = dir.path().join("out");
    assert_eq!(rollout_records(&out).len(), 2, "two rollouts, not the epoch's 8");
    assert!(out.join("actor/model.safetensors").is_file() && out.join("critic/model.safetensors").is_file());
}

#[test]
fn a_resumed_run_ends_with_the_uninterrupted_runs_weights() {
    resume_is_exact(&[]);
}

/// `--no-final-checkpoint`: the trained models are saved, no resumable checkpoint is written.
#[test]
fn no_final_checkpoint_saves_the_models_and_no_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let log = ok(&ppo(dir.path(), "out", &["--no-final-checkpoint"]));
    assert!(log.contains("step     7/7") && !log.contains("final step-3 checkpoint"), "{log}");
    let out = dir.path().join("out");
    assert!(out.join("actor/model.safetensors").is_file() && out.join("critic/model.safetensors").is_file());
    assert!(!out.join("checkpoints").exists(), "no checkpoint was asked for");
}

#[test]
fn with_lora_only_the_adapters_train_and_resume_is_exact() {
    let lora = ["--actor-lora-dim", "4", "--critic-lora-dim", "4", "--only-optimize-lora"];
    let (dir, full) = resume_is_exact(&lora);
    assert!(full.contains("actor LoRA: rank 4") && full.contains("critic LoRA: rank 4"), "{full}");
    // The saved actor has the adapters merged: plain GPT-2 tensors, and the change from the
    // step-1 weights is the rank-4 product scaling * A^T B^T in every adapted linear.
    let saved =
        hybrid_engine::checkpoints::hf_io::load_model_dir(&dir.path().join("full/actor"), &Device::Cpu).unwrap();
    let start = hybrid_engine::checkpoints::hf_io::load_model_dir(&dir.path().join("actor"), &Device::Cpu).unwrap();
    assert!(saved.extra_tensors.keys().all(|k| !k.contains("lora")), "adapters are merged, not saved");
    let unchanged = |name: &str| {
        let d = (&saved.tensors[name] - &start.tensors[name]).unwrap().abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() == 0.0
    };
    for name in ["wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.bias", "ln_f.bias"] {
        assert!(unchanged(name), "{name} must not train with --only-optimize-lora");
    }
    assert!(!unchanged("h.0.attn.c_attn.weight"), "the merged adapter changed the adapted weight");
}

#[test]
fn fp16_with_aligned_overflow_logs_its_loss_scale_and_resumes_exactly() {
    // 2^24 overflows at first: updates are skipped and the scale falls, then grows back every 3
    // clean steps; the resumed run must restore both scalers to end with the same weights.
    let fp16 = ["--dtype", "fp16", "--align-overflow", "--initial-scale-power", "24", "--loss-scale-window", "3"];
    let (dir, full) = resume_is_exact(&fp16);
    assert!(full.contains("loss scale "), "fp16 logs its loss scales:\n{full}");
    let metrics = std::fs::read_to_string(dir.path().join("full/metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().rev().nth(1).unwrap()).unwrap();
    let skipped = last["actor_skipped_steps"].as_u64().expect("actor_skipped_steps")
        + last["critic_skipped_steps"].as_u64().expect("critic_skipped_steps");
    assert!(skipped > 0, "2^24 must overflow at first: {last}");
    assert!(last["actor_loss_scale"].as_f64().unwrap() < 2f64.powi(24), "{last}");
}

/// A run that ends inside an accumulated step applies what it accumulated: one rollout of 8
/// prompts is 2 micro-batches of 4, fewer than `--gradient-accumulation-steps 3`, so only the
/// end of the run's flush trains the actor and the critic.
#[test]
fn a_run_ending_inside_an_accumulated_step_applies_it() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    // No warmup: the run's one update would run at its first rate, 0.
    let partial = [
        "--enable-test-mode",
        "--test-stop-step",
        "1",
        "--gradient-accumulation-steps",
        "3",
        "--num-warmup-steps",
        "0",
    ];
    ok(&ppo(dir.path(), "out", &[&partial[..], &["--no-final-checkpoint"]].concat()));
    let load = |d: &str| hybrid_engine::checkpoints::hf_io::load_model_dir(&dir.path().join(d), &Device::Cpu).unwrap();
    for (model, start) in [("out/actor", "actor"), ("out/critic", "reward")] {
        let (saved, start) = (load(model), load(start));
        let name = "h.0.mlp.c_fc.weight";
        let moved = (&saved.tensors[name] - &start.tensors[name]).unwrap().abs().unwrap().max_all().unwrap();
        assert!(moved.to_scalar::<f32>().unwrap() > 0.0, "{model}'s {name} did not train");
    }
}

/// Runs 7 rollouts with checkpoints, resumes from the one after rollout 2, and checks that both
/// runs end with the same weights. Returns the directory and the full run's log.
fn resume_is_exact(extra: &[&str]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let full = ok(&ppo(dir.path(), "full", &[&["--save-interval", "2", "--enable-tensorboard"], extra].concat()));
    // 54 training prompts in batches of 8: 7 rollouts; checkpoints after rollouts 2, 4 and 6.
    assert!(full.contains("step     7/7"), "{full}");
    assert!(full.contains("saved a step-3 checkpoint at rollout 2"), "{full}");
    // The end of a run is resumable, the checkpoint's size logged.
    let final_checkpoint = dir.path().join("full/checkpoints/iter_0000007");
    assert!(final_checkpoint.join("actor/model.safetensors").is_file(), "{full}");
    let logged = full
        .split_once("saved the final step-3 checkpoint (rollout 7, ")
        .and_then(|(_, rest)| rest.split_once(" GiB) to "))
        .map(|(size, _)| size.parse::<f64>().unwrap())
        .unwrap_or_else(|| panic!("no final checkpoint with its size in the log:\n{full}"));
    let gib = directory_bytes(&final_checkpoint) as f64 / (1u64 << 30) as f64;
    assert!((logged - gib).abs() <= 0.005, "logged {logged} GiB, the directory holds {gib:.4}");
    // GRPO and RLOO train no critic: none is logged, saved or checkpointed.
    let critic_free = critic_free(extra);
    let mut lines = vec!["reward", "kl_ref", "clip", "entropy", "--- answer:"];
    if !critic_free {
        lines.push("expl var");
    }
    for line in lines {
        assert!(full.contains(line), "missing {line:?} in the log:\n{full}");
    }
    if critic_free {
        assert!(!full.contains("critic loss") && !full.contains("expl var"), "{full}");
        assert!(!dir.path().join("full/critic").exists() && !final_checkpoint.join("critic").exists());
        assert!(!final_checkpoint.join("critic_optimizer.safetensors").exists());
    }
    let metrics = std::fs::read_to_string(dir.path().join("full/metrics.jsonl")).unwrap();
    let step: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let keys = [
        "actor_loss",
        "ratio_mean",
        "clip_fraction",
        "approx_kl",
        "entropy",
        "ptx_loss",
        "generation_secs",
        "generate_secs",
        "experience_secs",
        "training_secs",
    ];
    for key in keys {
        assert!(step.get(key).is_some(), "metrics.jsonl lacks {key}: {step}");
    }
    let keys =
        ["reward_mean", "reward_std", "kl_ref_k1", "kl_ref_k3", "explained_variance", "answer_len_mean", "eos_share"];
    for key in keys {
        assert!(step["rollout"].get(key).is_some(), "metrics.jsonl lacks rollout.{key}: {step}");
    }

    // --enable-tensorboard: beside the output directory, every metric of every rollout at its
    // step, and DS-Chat's `reward` tag.
    use hybrid_engine::telemetry::tensorboard::{read_scalars, scalars_of_records, DS_CHAT_STEP3_TAGS};
    let tb: Vec<_> =
        std::fs::read_dir(dir.path().join("tensorboard/full")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(tb.len(), 1, "one event file: {tb:?}");
    let records = hybrid_engine::training::metrics::read_records(&dir.path().join("full/metrics.jsonl")).unwrap();
    let scalars = read_scalars(&tb[0]).unwrap();
    assert!(
        scalars == scalars_of_records(&records, DS_CHAT_STEP3_TAGS, 0),
        "the event file holds what metrics.jsonl holds"
    );
    let reward: Vec<i64> = scalars.iter().filter(|(_, tag, _)| tag == "reward").map(|(step, _, _)| *step).collect();
    assert_eq!(reward, (1..=7).collect::<Vec<i64>>());

    // Resume from the checkpoint after rollout 2 (as if the run had died during rollout 3).
    let ckpts = dir.path().join("full/checkpoints");
    std::fs::write(ckpts.join("latest"), "iter_0000002\n").unwrap();
    let resumed = ok(&ppo(dir.path(), "resumed", &[&["--load", ckpts.to_str().unwrap()], extra].concat()));
    assert!(resumed.contains("resumed from") && resumed.contains("at rollout 2"), "{resumed}");
    assert!(!resumed.contains("step     2/7 |"), "rollouts 1 and 2 are not redone:\n{resumed}");
    let models: &[&str] = if critic_free { &["actor", "actor_ema"] } else { &["actor", "critic", "actor_ema"] };
    for model in models {
        let a = std::fs::read(dir.path().join("full").join(model).join("model.safetensors")).unwrap();
        let b = std::fs::read(dir.path().join("resumed").join(model).join("model.safetensors")).unwrap();
        assert!(a == b, "{model}: the resumed run's weights differ from the uninterrupted run's");
    }
    // Equal weights must not be the equality of nothing happening: both models took optimizer
    // steps, and the weights moved after the resume point (the checkpoint of rollout 2).
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("full/checkpoints/iter_0000007/ppo_state.json")).unwrap(),
    )
    .unwrap();
    let at_resume: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpts.join("iter_0000002/ppo_state.json")).unwrap()).unwrap();
    let trained: &[(&str, &str)] = if critic_free {
        &[("actor_steps", "actor/model.safetensors")]
    } else {
        &[("actor_steps", "actor/model.safetensors"), ("critic_steps", "critic/model.safetensors")]
    };
    for (steps, _) in trained {
        let (end, start) = (state[steps].as_u64().unwrap(), at_resume[steps].as_u64().unwrap());
        assert!(end > start, "{steps}: {start} at the resume point, {end} at the end: no update was applied");
    }
    for (model, file) in trained {
        let end = std::fs::read(dir.path().join("resumed").join(file)).unwrap();
        let resume_point = std::fs::read(ckpts.join("iter_0000002").join(file)).unwrap();
        assert!(end != resume_point, "{model}: the weights did not move after the resume point");
    }
    (dir, full)
}

/// A --save-interval rollout that is not a safe point moves the checkpoint, with a log line; the
/// models are saved before the held-out evaluation (a run killed during it keeps them) and the
/// final checkpoint is written.
#[test]
fn an_interval_off_a_safe_point_moves_and_the_models_are_saved_before_the_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let prompts = dir.path().join("prompts.jsonl");
    let extra = ["--generation-batches", "2", "--save-interval", "3", "--eval-prompts", prompts.to_str().unwrap()];
    let out = ppo_with_env(dir.path(), "moved", &extra, &[("RLHF_FAILPOINT", "ppo-before-eval")]);
    let log = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "the failpoint must abort the run during the evaluation:\n{log}");
    // Rollout 3 is buffered (generation batches of 2): the checkpoint moves to rollout 4.
    assert!(log.contains("rollout 3: the --save-interval checkpoint moves to the next safe point"), "{log}");
    assert!(log.contains("saved a step-3 checkpoint at rollout 4"), "{log}");
    let root = dir.path().join("moved");
    assert!(root.join("checkpoints/iter_0000004").is_dir() && !root.join("checkpoints/iter_0000003").exists());
    assert!(root.join("checkpoints/iter_0000007").is_dir(), "the final checkpoint is written:\n{log}");
    for model in ["actor", "critic", "actor_ema"] {
        hybrid_engine::checkpoints::hf_io::load_model_dir(&root.join(model), &Device::Cpu)
            .unwrap_or_else(|e| panic!("{model} was not saved before the evaluation: {e:#}"));
    }
}

#[test]
fn bad_input_is_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let check = |extra: &[&str], want: &[&str]| {
        let out = ppo(dir.path(), "bad", extra);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{extra:?}: one line, got:\n{stderr}");
        for w in want {
            assert!(stderr.contains(w), "{extra:?}: want {w:?} in {stderr}");
        }
    };
    let actor = dir.path().join("actor");
    check(&["--critic-model-name-or-path", actor.to_str().unwrap()], &["score.weight", "step 2"]);
    check(&["--max-answer-seq-len", "100"], &["exceeds", "context"]);
    check(&["--load", dir.path().to_str().unwrap()], &["no step-3 checkpoint"]);
    check(&["--cliprange", "0"], &["--cliprange"]);
    check(&["--max-answer-seq-len", &usize::MAX.to_string()], &["overflows", "--max-answer-seq-len"]);
    check(&["--critic-zero-stage", "4"], &["--critic-zero-stage 4", "ZeRO stages"]);
    check(&["--algorithm", "grpo"], &["--num-samples-per-prompt"]);
    // Greedy rollouts give a group one answer: every advantage 0.
    let greedy: Vec<&str> = ["--algorithm", "rloo", "--num-samples-per-prompt", "2"].to_vec();
    let out = Command::new(env!("CARGO_BIN_EXE_ppo")).args(&greedy).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("greedy answers are all the same") && stderr.contains("add --do-sample"), "{stderr}");
    check(&["--algorithm", "rloo", "--num-samples-per-prompt", "0"], &["--num-samples-per-prompt must be at least 1"]);
    let critic_flag = ["--algorithm", "rloo", "--num-samples-per-prompt", "2", "--critic-lora-dim", "4"];
    check(&critic_flag, &["--critic-lora-dim", "trains no critic"]);
    check(&["--algorithm", "grpo", "--num-samples-per-prompt", "2", "--lam", "0.9"], &["--lam", "no critic"]);
    let scaled_rloo = ["--algorithm", "rloo", "--num-samples-per-prompt", "2", "--scale-rewards", "none"];
    check(&scaled_rloo, &["--scale-rewards", "rloo"]);
    check(&["--scale-rewards", "batch"], &["--scale-rewards", "ppo"]);
}

/// GRPO and RLOO: four answers per prompt (a rollout of 8 prompts is 32 rows), no critic read,
/// trained, logged or saved, and a resumed run ends exactly where the uninterrupted one does
/// (RLOO with --normalize-reward, whose running moments are part of the state).
/// Each group's advantages sum to zero (GRPO's are normalised deviations, Dr. GRPO's
/// (`--scale-rewards none`) plain ones, RLOO's leave-one-out differences), so the rollout's mean
/// advantage is zero, and they are not all zero.
#[test]
fn grpo_and_rloo_train_without_a_critic_and_resume_exactly() {
    let mut first_std = std::collections::HashMap::new();
    for algorithm in ["grpo", "rloo", "grpo-unscaled"] {
        let mut flags = vec!["--algorithm", algorithm, "--num-samples-per-prompt", "4", "--ppo-epochs", "2"];
        // Dr. GRPO: the deviations unscaled, still summing to zero per group.
        if algorithm == "grpo-unscaled" {
            flags.splice(0..2, ["--algorithm", "grpo", "--scale-rewards", "none"]);
        }
        // RLOO's rewards from normalised scores: the running moments must survive the resume.
        if algorithm == "rloo" {
            flags.push("--normalize-reward");
        }
        let (dir, full) = resume_is_exact(&flags);
        let steps = rollout_records(&dir.path().join("full"));
        assert_eq!(steps.len(), 7, "{full}");
        for step in &steps {
            let rollout = &step["rollout"];
            assert!(rollout["rows"].as_f64().unwrap() > 8.0, "{algorithm}: 4 answers per prompt: {rollout}");
            let (mean, std) = (rollout["advantage_mean"].as_f64().unwrap(), rollout["advantage_std"].as_f64().unwrap());
            assert!(mean.abs() < 1e-5 && std > 0.0, "{algorithm}: advantages sum to 0 per group: {rollout}");
            assert!(step["critic_loss"].is_null(), "{algorithm}: {step}");
            let flat = rollout["groups_zero_std"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&flat), "{algorithm}: share of groups without spread: {rollout}");
        }
        first_std.insert(algorithm, steps[0]["rollout"]["advantage_std"].as_f64().unwrap());
    }
    // The same first rollout (same seed), scaled by each group's std or not at all.
    assert_ne!(first_std["grpo"], first_std["grpo-unscaled"], "--scale-rewards none took no effect");
}

/// REINFORCE++: one answer per prompt, no critic read, trained, logged or saved, its returns
/// normalised over the rollout (mean 0 over the answer tokens); with --normalize-reward, whose
/// running moments are part of the state, a resumed run ends exactly where the uninterrupted
/// one does.
#[test]
fn reinforce_pp_trains_without_a_critic_and_resumes_exactly() {
    let (dir, full) = resume_is_exact(&["--algorithm", "reinforce_pp", "--ppo-epochs", "2", "--normalize-reward"]);
    let steps = rollout_records(&dir.path().join("full"));
    assert_eq!(steps.len(), 7, "{full}");
    let rows: f64 = steps.iter().map(|s| s["rollout"]["rows"].as_f64().unwrap()).sum();
    assert_eq!(rows, 54.0, "one answer per prompt, each of the 54 prompts once");
    for step in &steps {
        let rollout = &step["rollout"];
        let (mean, std) = (rollout["advantage_mean"].as_f64().unwrap(), rollout["advantage_std"].as_f64().unwrap());
        assert!(mean.abs() < 1e-4 && std > 0.5, "normalised returns: {rollout}");
        assert!(step["critic_loss"].is_null(), "{step}");
    }
}

#[test]
fn a_resume_over_a_changed_ptx_corpus_is_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let corpus = dir.path().join("ptx.txt");
    let sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank.\n";
    std::fs::write(&corpus, sentence.repeat(40)).unwrap();
    let ptx = ["--unsupervised-dataset-name", corpus.to_str().unwrap()];
    ok(&ppo(dir.path(), "run", &[&ptx[..], &["--save-interval", "2"]].concat()));
    // The corpus shrinks between the save and the resume: the saved PTX position means nothing
    // in it (before the fix: an assertion, or a silent resume on other data).
    std::fs::write(&corpus, sentence.repeat(4)).unwrap();
    let ckpts = dir.path().join("run/checkpoints");
    let out = ppo(dir.path(), "resumed", &[&ptx[..], &["--load", ckpts.to_str().unwrap()]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line, got:\n{stderr}");
    assert!(stderr.contains("--unsupervised-dataset-name") && stderr.contains("now makes"), "{stderr}");
}

/// PTX from Megatron's pre-tokenized corpus (its `.bin`/`.idx` prefix) trains as the same
/// documents given as jsonl do: the same blocks, so the same run, step for step.
#[test]
fn ptx_reads_megatrons_preprocessed_corpus_as_its_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/tests/fixtures/megatron");
    let run = |out: &str, corpus: &str| {
        let path = fixtures.join(corpus);
        let stdout = ok(&ppo(dir.path(), out, &["--unsupervised-dataset-name", path.to_str().unwrap()]));
        // Each step's losses (the records' timings differ from run to run).
        let losses: Vec<[f64; 3]> = rollout_records(&dir.path().join(out))
            .iter()
            .map(|r| ["ptx_loss", "actor_loss", "critic_loss"].map(|k| r[k].as_f64().unwrap()))
            .collect();
        (losses, stdout)
    };
    let (text, text_log) = run("jsonl", "corpus.jsonl");
    let (indexed, log) = run("indexed", "corpus_text_document");
    // 239 tokens in blocks of 24 + 6: 7 blocks.
    assert!(text_log.contains("PTX: 7 blocks of 30 tokens") && log.contains("PTX: 7 blocks of 30 tokens"), "{log}");
    assert_eq!(text.len(), 7, "{text:?}");
    assert_eq!(indexed, text, "the same PTX blocks, the same run");
}

/// Several minibatches and PPO epochs per rollout make PPO's mechanics visible: after the
/// phase's first update the ratio departs from 1 and clipping acts. `--kl-target` adapts the KL
/// coefficient after every rollout as the controller's formula says, `--target-kl` stops a
/// phase's epochs once a step's approximate KL passes it; both survive a resume exactly.
#[test]
fn adaptive_kl_and_target_kl_take_effect_and_resume_exactly() {
    let flags = [
        "--ppo-epochs",
        "3",
        "--per-device-training-batch-size",
        "2",
        "--kl-target",
        "0.5",
        "--kl-horizon",
        "100",
        "--target-kl",
        "2e-3",
        // A random tiny actor's ratios move by about 1% per update: a narrow clip range acts.
        "--cliprange",
        "0.01",
    ];
    let (dir, full) = resume_is_exact(&flags);
    assert!(full.contains("(kl_ctl "), "the adaptive coefficient is logged:\n{full}");
    let steps = rollout_records(&dir.path().join("full"));
    assert_eq!(steps.len(), 7);
    // Each rollout's coefficient is the previous one moved by the controller.
    assert_eq!(steps[0]["kl_ctl"].as_f64(), Some(0.1));
    for pair in steps.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        let kl = before["rollout"]["kl_ref_sequence"].as_f64().unwrap();
        let rows = before["rollout"]["rows"].as_f64().unwrap();
        let want = ppo::ppo::adaptive_kl_coefficient(before["kl_ctl"].as_f64().unwrap(), kl, 0.5, rows, 100.0);
        let got = after["kl_ctl"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-12, "{got} vs {want}: {before}");
    }
    let last = steps.last().unwrap()["kl_ctl"].as_f64().unwrap();
    assert!((last - 0.1).abs() > 1e-3, "the coefficient moved: {last}");
    // Clipping acts after the first update, and the target KL stops some phases early.
    let later_clip = steps.iter().filter_map(|s| s["clip_fraction_after_first"].as_f64()).fold(0f64, f64::max);
    assert!(later_clip > 0.0, "{steps:?}");
    let stopped: Vec<&serde_json::Value> = steps.iter().filter(|s| !s["updates_stopped_early"].is_null()).collect();
    assert!(!stopped.is_empty(), "no phase stopped at the target KL:\n{steps:?}");
    for s in &stopped {
        let (done, planned) = (&s["updates_stopped_early"]["done"], &s["updates_stopped_early"]["planned"]);
        assert!(done.as_u64().unwrap() < planned.as_u64().unwrap(), "{s}");
        assert!(s["approx_kl_after_first"].as_f64().unwrap() > 0.0, "{s}");
    }
    assert!(full.contains("stopped at target KL after "), "{full}");
}

/// `--reward-fn exec:...` with `--no-reward-model`: one scorer process serves the whole run, it
/// sees every kept answer once (prompt and answer as text, EOS removed), and each rollout's
/// logged reward is the mean of what it answered; no reward model is read. A scorer that fails
/// or a reward-model-free run without one is one clear error line.
#[test]
fn an_exec_reward_fn_scores_every_answer_without_a_reward_model() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    // Reward 1 for an answer with an "e" in it, else -1; each reward and the scorer's process
    // id logged, one line each.
    let log = dir.path().join("scored.txt");
    let script = format!(
        r#"while IFS= read -r line; do case "${{line#*\"answer\":}}" in *e*) r=1;; *) r=-1;; esac; echo "$$ $r" >> '{}'; echo $r; done"#,
        log.display()
    );
    std::fs::write(dir.path().join("scorer.sh"), script).unwrap();
    let spec = format!("exec:sh {}", dir.path().join("scorer.sh").display());
    let flags = ["--algorithm", "grpo", "--num-samples-per-prompt", "2", "--no-reward-model", "--reward-fn", &spec];
    let stdout = ok(&ppo(dir.path(), "rule", &flags));
    assert!(stdout.contains(&format!("rewards: {spec}")), "{stdout}");
    let scored: Vec<(String, f64)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            let (pid, r) = l.split_once(' ').unwrap();
            (pid.to_string(), r.parse().unwrap())
        })
        .collect();
    assert!(scored.iter().all(|(pid, _)| *pid == scored[0].0), "one process for the whole run");
    let steps = rollout_records(&dir.path().join("rule"));
    let mut next = 0;
    for step in &steps {
        let rollout = &step["rollout"];
        let rows = rollout["rows"].as_f64().unwrap() as usize;
        let rewards = &scored[next..next + rows];
        next += rows;
        let mean = rewards.iter().map(|(_, r)| r).sum::<f64>() / rows as f64;
        assert!((rollout["reward_mean"].as_f64().unwrap() - mean).abs() < 1e-6, "{rollout} vs {mean}");
    }
    assert_eq!(next, scored.len(), "every scored answer is in a rollout, once");
    assert!(scored.iter().any(|(_, r)| *r > 0.0) && scored.iter().any(|(_, r)| *r < 0.0), "{scored:?}");

    let fails = |extra: &[&str], want: &[&str]| {
        let out = ppo(dir.path(), "bad", extra);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        // One error line, the last (a failure in a rollout comes after the run's warnings).
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            errors.len() == 1 && stderr.trim_end().ends_with(errors[0]),
            "{extra:?}: one error line, got:\n{stderr}"
        );
        for w in want {
            assert!(errors[0].contains(w), "{extra:?}: want {w:?} in {stderr}");
        }
    };
    fails(&["--no-reward-model"], &["--no-reward-model", "--reward-fn"]);
    fails(&["--reward-fn", "score.py"], &["exec:COMMAND"]);
    // The demo's scorer on prompts that are not the demo's: the answer is named.
    fails(&["--reward-fn", "builtin:capitals"], &["--reward-fn builtin:capitals", "answer 1", "no single country"]);
    fails(&["--reward-fn", "exec:exit 3"], &["--reward-fn exec:exit 3", "exited"]);
    assert!(!dir.path().join("bad").join("actor").exists(), "a failed scorer saves nothing");
}

/// A scorer that crashes once is restarted, the rollout sent again, and the run ends with the
/// weights of a run without the fault; one gone for good ends the run with one error line and
/// a checkpoint of the rollouts done (no --save-interval given), from which the same command
/// with --load ends with those weights too, byte for byte.
#[test]
fn a_failing_scorer_is_restarted_or_leaves_a_checkpoint_to_resume_from() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let (lines, fail_at) = (dir.path().join("lines"), dir.path().join("fail_at"));
    // Reward 1 for an answer with an "e" in it, else -1. It counts the lines its processes read
    // (in `lines`); while `fail_at` holds a number, from that line on it exits 1 before answering
    // (once only when `fail_at` says so).
    let script = format!(
        r#"while IFS= read -r line; do
n=$(( $(cat '{lines}' 2>/dev/null || echo 0) + 1 )); echo $n > '{lines}'
if [ -f '{fail}' ]; then set -- $(cat '{fail}'); if [ $n -ge $1 ]; then [ "$2" = once ] && rm '{fail}'; exit 1; fi; fi
case "${{line#*\"answer\":}}" in *e*) echo 1;; *) echo -1;; esac
done"#,
        lines = lines.display(),
        fail = fail_at.display()
    );
    std::fs::write(dir.path().join("scorer.sh"), script).unwrap();
    let spec = format!("exec:sh {}", dir.path().join("scorer.sh").display());
    let flags = ["--algorithm", "grpo", "--num-samples-per-prompt", "2", "--no-reward-model", "--reward-fn", &spec];
    let weights = |out: &str| {
        ["actor", "actor_ema"].map(|m| std::fs::read(dir.path().join(out).join(m).join("model.safetensors")).unwrap())
    };
    let stderr = |out: &Output| String::from_utf8_lossy(&out.stderr).to_string();
    let clean = ok(&ppo(dir.path(), "clean", &flags));
    assert!(clean.contains("step     7/7"), "{clean}");
    let read = std::fs::read_to_string(&lines).unwrap().trim().parse::<usize>().unwrap();
    assert!(read > 40, "the fault must fall inside the run: {read} lines in all");

    // Line 40 falls in rollout 3 or later (16 answers a rollout at most): a crash there.
    std::fs::remove_file(&lines).unwrap();
    std::fs::write(&fail_at, "40 once").unwrap();
    let crashed = ppo(dir.path(), "crashed", &flags);
    ok(&crashed);
    assert!(!fail_at.exists(), "the scorer crashed");
    let said = stderr(&crashed);
    assert!(said.contains("restarting it and sending the rollout again in 1 s (try 2 of 3)"), "{said}");
    assert!(weights("crashed") == weights("clean"), "a restarted scorer changes nothing");

    // The scorer gone for good: every restart exits at once.
    std::fs::remove_file(&lines).unwrap();
    std::fs::write(&fail_at, "40").unwrap();
    let broken = ppo(dir.path(), "broken", &flags);
    let said = stderr(&broken);
    assert_eq!(broken.status.code(), Some(2), "{said}");
    let errors: Vec<&str> = said.lines().filter(|l| l.starts_with("error")).collect();
    assert!(errors.len() == 1 && said.trim_end().ends_with(errors[0]), "one error line, the last:\n{said}");
    let root = dir.path().join("broken/checkpoints");
    for want in ["--reward-fn exec:", "tried 3 times", "exited", "saved a checkpoint of rollouts 1-", "--load"] {
        assert!(errors[0].contains(want), "want {want:?} in {}", errors[0]);
    }
    assert!(errors[0].ends_with(&format!("--load {}", root.display())), "{}", errors[0]);
    assert!(!dir.path().join("broken/actor").exists(), "the failed run's models are its checkpoint's");
    // Resumed with the scorer still gone, its checkpoints going elsewhere: the first rollout
    // fails again, and the line points back at the checkpoint it was resumed from.
    let elsewhere = dir.path().join("elsewhere");
    let again = ppo(
        dir.path(),
        "broken",
        &[&flags[..], &["--load", root.to_str().unwrap(), "--save", elsewhere.to_str().unwrap()]].concat(),
    );
    let said = stderr(&again);
    assert_eq!(again.status.code(), Some(2), "{said}");
    assert!(
        said.contains("is saved already") && said.trim_end().ends_with(&format!("--load {}", root.display())),
        "{said}"
    );
    std::fs::remove_file(&fail_at).unwrap();
    let resumed = ok(&ppo(dir.path(), "broken", &[&flags[..], &["--load", root.to_str().unwrap()]].concat()));
    assert!(resumed.contains("resumed from"), "{resumed}");
    assert!(weights("broken") == weights("clean"), "the resumed run ends with the fault-free run's weights");
}
