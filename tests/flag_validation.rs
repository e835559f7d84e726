//! Every float flag of every binary is checked while parsing: NaN, the infinities and values
//! outside the flag's range are one `error:` line naming the flag and its range, with clap's
//! usage exit code 2; a value in range parses. And a flag that would have no effect is refused:
//! `train --pretrain-demo` with the pipeline's flags, sampling flags without sampling, LoRA
//! options without a LoRA rank, `--unsup-coef` without PTX data, fp16's loss-scaling flags in
//! another dtype, NCCL on the CPU, a weights' gather bucket without the gather, a warm-up or a
//! decay's shape for a constant learning rate, and the others each case names.

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A float flag: the binary and the flags it needs (its mode, or the feature it tunes), the flag,
/// a value outside its range, a value inside it, and the range as the error states it.
struct FloatFlag {
    binary: &'static str,
    needs: &'static [&'static str],
    flag: &'static str,
    outside: &'static str,
    inside: &'static str,
    range: &'static str,
}

const fn flag(
    binary: &'static str,
    needs: &'static [&'static str],
    flag: &'static str,
    outside: &'static str,
    inside: &'static str,
    range: &'static str,
) -> FloatFlag {
    FloatFlag { binary, needs, flag, outside, inside, range }
}

const POSITIVE: &str = "(0, inf)";
const NON_NEGATIVE: &str = "[0, inf)";
const DROPOUT: &str = "[0, 1)";
const UNIT: &str = "[0, 1]";
const TOP_P: &str = "(0, 1]";
const SCRATCH: &[&str] = &["--from-scratch"];
const LORA: &[&str] = &["--lora-dim", "4"];
const SAMPLING: &[&str] = &["--do-sample"];

/// The flags the fine-tuning steps share (hybrid-engine's StepArgs), for `sft` and `reward`.
fn step_flags(binary: &'static str) -> Vec<FloatFlag> {
    vec![
        flag(binary, &[], "--learning-rate", "0", "1e-4", POSITIVE),
        flag(binary, &[], "--weight-decay", "-0.1", "0.1", NON_NEGATIVE),
        flag(binary, &[], "--adam-eps", "0", "1e-8", POSITIVE),
        flag(binary, &[], "--dropout", "1", "0", DROPOUT),
        flag(binary, &[], "--gradient-clipping", "-1", "0", NON_NEGATIVE),
        flag(binary, LORA, "--lora-alpha", "0", "16", POSITIVE),
        flag(binary, LORA, "--lora-learning-rate", "-1e-3", "1e-3", POSITIVE),
    ]
}

fn all_float_flags() -> Vec<FloatFlag> {
    let mut flags = step_flags("sft");
    flags.extend(step_flags("reward"));
    flags.extend([
        flag("sft", SCRATCH, "--lr", "0", "6e-4", POSITIVE),
        flag("sft", SCRATCH, "--min-lr", "-1e-5", "0", NON_NEGATIVE),
        flag("sft", SCRATCH, "--weight-decay", "-1", "0", NON_NEGATIVE),
        flag("sft", SCRATCH, "--clip-grad", "-1", "0", NON_NEGATIVE),
        flag("sft", SCRATCH, "--adam-beta1", "1", "0", "[0, 1)"),
        flag("sft", SCRATCH, "--adam-beta2", "1.5", "0.999", "[0, 1)"),
        flag("sft", SCRATCH, "--adam-eps", "0", "1e-8", POSITIVE),
        flag("sft", SCRATCH, "--dropout", "1", "0.1", DROPOUT),
        flag("ppo", &[], "--actor-learning-rate", "0", "1e-5", POSITIVE),
        flag("ppo", &[], "--critic-learning-rate", "-1", "1e-5", POSITIVE),
        flag("ppo", &[], "--actor-weight-decay", "-1", "0", NON_NEGATIVE),
        flag("ppo", &[], "--critic-weight-decay", "-1", "0.1", NON_NEGATIVE),
        flag("ppo", &[], "--adam-eps", "0", "1e-8", POSITIVE),
        flag("ppo", &[], "--gradient-clipping", "-1", "0", NON_NEGATIVE),
        flag("ppo", &[], "--actor-dropout", "1", "0", DROPOUT),
        flag("ppo", &[], "--critic-dropout", "-0.1", "0.5", DROPOUT),
        flag("ppo", &["--actor-lora-dim", "4"], "--actor-lora-learning-rate", "0", "1e-4", POSITIVE),
        flag("ppo", &["--critic-lora-dim", "4"], "--critic-lora-learning-rate", "0", "1e-4", POSITIVE),
        flag("ppo", &["--unsupervised-dataset-name", "shakespeare"], "--unsup-coef", "-1", "0", NON_NEGATIVE),
        flag("ppo", SAMPLING, "--temperature", "0", "0.7", POSITIVE),
        flag("ppo", SAMPLING, "--top-p", "0", "1", TOP_P),
        flag("ppo", &[], "--kl-ctl", "-0.1", "0", NON_NEGATIVE),
        flag("ppo", &[], "--clip-reward-value", "0", "5", POSITIVE),
        flag("ppo", &[], "--cliprange", "0", "0.2", POSITIVE),
        flag("ppo", &[], "--cliprange-high", "0", "0.28", POSITIVE),
        flag("ppo", &[], "--cliprange-value", "-0.2", "0.2", POSITIVE),
        flag("ppo", &[], "--gamma", "1.01", "1", UNIT),
        flag("ppo", &[], "--lam", "-0.5", "0", UNIT),
        flag("chat", &[], "--temperature", "0", "0.7", POSITIVE),
        flag("chat", &[], "--top-p", "1.5", "0.9", TOP_P),
    ]);
    flags
}

/// `sft`, `reward` and `ppo` are the `train` binary under another name, as the launcher runs them.
fn binary(dir: &Path, name: &str) -> PathBuf {
    let train = Path::new(env!("CARGO_BIN_EXE_train"));
    match name {
        "chat" => PathBuf::from(env!("CARGO_BIN_EXE_chat")),
        "train" => train.to_path_buf(),
        step => {
            let link = dir.join(step);
            if !link.exists() {
                std::os::unix::fs::symlink(train, &link).expect("link the step name to train");
            }
            link
        }
    }
}

/// Runs `name args` and returns its stderr, asserting a usage error: exit 2 and one line.
fn usage_error(dir: &Path, name: &str, args: &[&str]) -> String {
    let out = Command::new(binary(dir, name)).args(args).env_remove("RLHF_DTYPE").output().expect("spawn");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{name} {args:?}: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{name} {args:?}: one line, got:\n{stderr}");
    assert!(stderr.starts_with("error: "), "{name} {args:?}: {stderr}");
    stderr
}

#[test]
fn nan_infinite_and_out_of_range_floats_are_one_usage_error_naming_flag_and_range() {
    let dir = tempfile::tempdir().unwrap();
    for f in all_float_flags() {
        for bad in ["nan", "inf", "-inf", f.outside] {
            let value = format!("{}={bad}", f.flag);
            let args: Vec<&str> = f.needs.iter().copied().chain([value.as_str()]).collect();
            let stderr = usage_error(dir.path(), f.binary, &args);
            assert!(
                stderr.contains(&format!("'{}", f.flag)) && stderr.contains(&format!("{} (finite)", f.range)),
                "{} {args:?}: want the flag and {} in: {stderr}",
                f.binary,
                f.range
            );
        }
    }
}

#[test]
fn floats_in_range_parse() {
    fn parses<T: Parser>(argv: &[&str]) -> bool {
        T::try_parse_from(argv).map_err(|e| eprintln!("{argv:?}: {e}")).is_ok()
    }
    for f in all_float_flags() {
        let argv: Vec<&str> = [f.binary].into_iter().chain(f.needs.iter().copied()).chain([f.flag, f.inside]).collect();
        let ok = match (f.binary, f.needs == SCRATCH) {
            ("sft", false) => parses::<sft::args::SftArgs>(&argv),
            ("sft", true) => parses::<sft::pretrain::args::PretrainArgs>(&argv),
            ("reward", _) => parses::<reward::args::RewardArgs>(&argv),
            ("ppo", _) => parses::<ppo::args::PpoArgs>(&argv),
            ("chat", _) => parses::<rlhf::chat::ChatArgs>(&[argv.as_slice(), &["--path", "gpt2"]].concat()),
            (other, _) => panic!("no parser for {other}"),
        };
        assert!(ok, "{argv:?} is in range and must parse");
    }
}

#[test]
fn the_pretrain_demo_refuses_the_pipeline_flags_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("output");
    let pipeline_flags: [&[&str]; 10] = [
        &["--step", "1"],
        &["--task", "arithmetic"],
        &["--tensor-model-parallel-size", "2"],
        &["--inference-tp-size", "2"],
        &["--deployment-type", "single_gpu"],
        &["--actor-model", "gpt2"],
        &["--reward-model", "gpt2"],
        &["--actor-zero-stage", "2"],
        &["--reward-zero-stage", "1"],
        &["--recipe-dir", "scripts/recipes"],
    ];
    for extra in pipeline_flags {
        let args: Vec<&str> = ["--pretrain-demo", "--output-dir", out.to_str().unwrap()]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        let stderr = usage_error(dir.path(), "train", &args);
        assert!(stderr.contains("--pretrain-demo") && stderr.contains(extra[0]), "{args:?}: {stderr}");
    }
    assert!(!out.exists(), "a refused run writes nothing");
}

#[test]
fn flags_that_would_have_no_effect_are_refused_naming_what_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        ("ppo", &["--temperature", "0.7"], "--do-sample"),
        ("ppo", &["--top-k", "5"], "--do-sample"),
        ("ppo", &["--top-p", "0.9"], "--do-sample"),
        ("ppo", &["--unsup-coef", "1"], "--unsupervised-dataset-name"),
        ("ppo", &["--algorithm", "reinforce_pp", "--lam", "0.9"], "trains no critic"),
        ("ppo", &["--actor-lora-module-name", "attn"], "--actor-lora-dim"),
        ("ppo", &["--actor-lora-learning-rate", "1e-4"], "--actor-lora-dim"),
        ("ppo", &["--critic-lora-module-name", "attn"], "--critic-lora-dim"),
        ("ppo", &["--critic-lora-learning-rate", "1e-4"], "--critic-lora-dim"),
        ("sft", &["--lora-alpha", "8"], "--lora-dim"),
        ("sft", &["--lora-module-name", "attn"], "--lora-dim"),
        ("reward", &["--lora-learning-rate", "1e-3"], "--lora-dim"),
        ("chat", &["--path", "gpt2", "--greedy", "--temperature", "0.5"], "--greedy"),
        ("chat", &["--path", "gpt2", "--greedy", "--top-k", "5"], "--greedy"),
        ("chat", &["--path", "gpt2", "--greedy", "--top-p", "0.5"], "--greedy"),
        ("ppo", &["--reward-fn-timeout", "10"], "--reward-fn exec:CMD"),
        ("ppo", &["--reward-fn", "builtin:capitals", "--reward-fn-timeout", "10"], "built-in scorers"),
        ("ppo", &["--reward-fn-tries", "2"], "--reward-fn exec:CMD"),
        ("ppo", &["--reward-fn", "builtin:capitals", "--reward-fn-tries", "2"], "built-in scorers are tried once"),
        ("ppo", &["--no-final-checkpoint", "--save", "ck"], "--save-interval"),
        ("ppo", &["--whiten-advantages", "--algorithm", "reinforce_pp"], "always whitens"),
        ("sft", &["--no-data-cache", "--data-output-path", "cache"], "--no-data-cache"),
        ("sft", &["--num-eval-prompts", "3"], "--eval-prompts"),
        ("sft", &["--max-new-tokens", "3"], "--eval-prompts"),
        ("sft", &["--lr-scheduler-type", "constant", "--num-warmup-steps", "5"], "constant_with_warmup"),
        ("reward", &["--lr-scheduler-type", "constant", "--num-warmup-steps", "5"], "constant_with_warmup"),
        ("ppo", &["--lr-scheduler-type", "constant", "--num-warmup-steps", "5"], "constant_with_warmup"),
        ("sft", &["--from-scratch", "--lr-decay-style", "constant", "--min-lr", "0"], "--lr-decay-style constant"),
        ("sft", &["--from-scratch", "--lr-decay-style", "constant", "--lr-decay-iters", "9"], "has none"),
        ("sft", &["--lora-dim", "0", "--lora-module-name", "attn"], "--lora-dim is 0"),
        ("reward", &["--lora-dim", "0", "--lora-learning-rate", "1e-3"], "--lora-dim is 0"),
        ("ppo", &["--actor-lora-dim", "0", "--actor-lora-module-name", "attn"], "--actor-lora-dim is 0"),
        ("ppo", &["--critic-lora-dim", "0", "--critic-lora-learning-rate", "1e-3"], "--critic-lora-dim is 0"),
        ("chat", &["--path", "gpt2", "--greedy", "--seed", "3"], "--greedy"),
    ];
    for (name, args, want) in cases {
        let stderr = usage_error(dir.path(), name, args);
        assert!(stderr.contains(want) && stderr.contains(args[args.len() - 2]), "{name} {args:?}: {stderr}");
    }
    // `--offload` on a CPU run would move nothing: one line before any training (on GPUs it
    // holds at ZeRO 1-3 across ranks; the rule is unit-tested in engine/mod.rs).
    let out = dir.path().join("offload");
    let args = ["--offload", "--device", "cpu", "--data-path", "demo", "--max-seq-len", "64", "--output-dir"];
    let out_arg = out.to_str().unwrap();
    let stderr = usage_error(dir.path(), "sft", &[&args[..], &[out_arg]].concat());
    assert!(stderr.contains("--offload moves the optimizer states off a GPU, and this run is on the CPU"), "{stderr}");
    assert!(!out.exists(), "nothing saved");
    // NCCL on a CPU run would carry nothing; the weights' all-gather bucket sizes a gather that
    // only stages 1 and 2 make (step 3: neither model at those stages). One line each, before
    // any training.
    let out = dir.path().join("nccl");
    let out_arg = out.to_str().unwrap();
    let nccl = ["--distributed-backend", "nccl", "--device", "cpu", "--data-path", "demo", "--output-dir", out_arg];
    let stderr = usage_error(dir.path(), "sft", &nccl);
    assert!(stderr.contains("--distributed-backend nccl carries CUDA tensors"), "{stderr}");
    let gather = ["--allgather-bucket-size", "1000", "--actor-zero-stage", "3", "--output-dir", out_arg];
    let stderr = usage_error(dir.path(), "ppo", &gather);
    assert!(stderr.contains("--allgather-bucket-size") && stderr.contains("stages 1 and 2"), "{stderr}");
    assert!(!out.exists(), "nothing saved");
    let critic_gathers = ["ppo", "--allgather-bucket-size", "1000", "--critic-zero-stage", "2"];
    ppo::args::PpoArgs::try_parse_from(critic_gathers).unwrap().validate().expect("the critic's stage 2 gathers");
    // A critic's path that neither a critic nor a reward model reads; --chat-format without the
    // --prompt it formats.
    let no_critic = ["--algorithm", "grpo", "--num-samples-per-prompt", "4", "--do-sample", "--no-reward-model"];
    let scorer = ["--reward-fn", "builtin:capitals", "--critic-model-name-or-path", "reward"];
    let stderr = usage_error(dir.path(), "ppo", &[&no_critic[..], &scorer].concat());
    assert!(stderr.contains("--critic-model-name-or-path") && stderr.contains("trains no critic"), "{stderr}");
    let keys = ["--data-path", "demo", "--max-seq-len", "64", "--prompt-key", "q", "--output-dir", out_arg];
    let stderr = usage_error(dir.path(), "sft", &keys);
    assert!(stderr.contains("--prompt-key") && stderr.contains("embedded (demo)"), "{stderr}");
    let prompt_eval = Command::new(env!("CARGO_BIN_EXE_prompt_eval"))
        .args(["--model-name-or-path-baseline", "a", "--model-name-or-path-finetune", "b", "--dist-timeout", "5"])
        .output()
        .expect("spawn prompt_eval");
    let stderr = String::from_utf8_lossy(&prompt_eval.stderr).to_string();
    assert!(!prompt_eval.status.success() && stderr.lines().count() == 1, "{stderr}");
    assert!(stderr.contains("--dist-timeout") && stderr.contains("--tensor-model-parallel-size is 1"), "{stderr}");
    let stderr = usage_error(dir.path(), "chat", &["--path", "gpt2", "--chat-format"]);
    assert!(stderr.contains("--chat-format") && stderr.contains("--prompt"), "{stderr}");
    // With what they need, the same flags parse.
    assert!(ppo::args::PpoArgs::try_parse_from(["ppo", "--do-sample", "--top-k", "5", "--top-p", "0.9"]).is_ok());
    assert!(ppo::args::PpoArgs::try_parse_from(["ppo", "--actor-lora-dim", "4", "--actor-lora-module-name", "attn"])
        .is_ok());
    assert!(sft::args::SftArgs::try_parse_from(["sft", "--lora-dim", "4", "--lora-alpha", "8"]).is_ok());
    assert!(rlhf::chat::ChatArgs::try_parse_from(["chat", "--path", "gpt2", "--top-k", "5"]).is_ok());
}

#[test]
fn sft_only_data_is_refused_outside_sft() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["reward", "ppo"] {
        let out = Command::new(binary(dir.path(), name))
            .args(["--sft-only-data-path", "demo", "--output-dir"])
            .arg(dir.path().join(format!("{name}-out")))
            .output()
            .expect("spawn");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{name}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{name}: one line, got:\n{stderr}");
        assert!(stderr.contains("--sft-only-data-path feeds SFT (step 1) only"), "{name}: {stderr}");
        assert!(!dir.path().join(format!("{name}-out")).exists(), "{name}: a refused run writes nothing");
    }
}

#[test]
fn fp16_only_flags_are_refused_in_another_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        ("ppo", &["--loss-scale-window", "3"], "--loss-scale-window"),
        ("ppo", &["--dtype", "bf16", "--initial-scale-power", "20"], "the dtype is bf16"),
        ("ppo", &["--align-overflow"], "--align-overflow"),
        ("sft", &["--initial-scale-power", "20"], "--initial-scale-power"),
        ("sft", &["--from-scratch", "--loss-scale-window", "4"], "--loss-scale-window"),
        ("reward", &["--loss-scale-window", "4"], "--loss-scale-window"),
    ];
    for (name, args, want) in cases {
        let stderr = usage_error(dir.path(), name, args);
        assert!(stderr.contains(want) && stderr.contains("--dtype fp16"), "{name} {args:?}: {stderr}");
    }
    let fp16 =
        ["ppo", "--dtype", "fp16", "--loss-scale-window", "3", "--initial-scale-power", "20", "--align-overflow"];
    let args = ppo::args::PpoArgs::try_parse_from(fp16).expect("fp16 flags parse");
    args.validate().expect("with --dtype fp16 they are accepted");
    let scaling = args.precision.loss_scaling();
    assert_eq!((scaling.window, scaling.initial_scale_power), (3, 20), "and take effect");
}

/// A DS-Chat script's unknown flags are named all at once, each with the nearest known spelling,
/// and the DeepSpeed flags not supported with the reason; DS-Chat's `--deepspeed`,
/// `--enable_hybrid_engine` and a `--local_rank` that agrees with the environment are accepted
/// (the run then stops at the next problem: here a missing model).
#[test]
fn unknown_flags_are_named_together_and_ds_chats_engine_flags_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = usage_error(
        dir.path(),
        "sft",
        &["--deepspeed", "--print_loss", "--zero_stage", "2", "--lr_schedular_type", "cosine", "--print_lost"],
    );
    assert!(
        stderr.contains("unknown flags --lr_schedular_type (did you mean --lr-scheduler-type?), --print_lost (did you mean --print-loss?)"),
        "{stderr}"
    );
    assert!(!stderr.contains("--deepspeed") && !stderr.contains("--zero_stage"), "{stderr}");
    let stderr = usage_error(
        dir.path(),
        "ppo",
        &["--enable_mixed_precision_lora", "--unpin_actor_parameters", "--lr_schedular_type", "cosine"],
    );
    assert!(stderr.contains("unknown or unsupported flags --enable_mixed_precision_lora (ZeRO++'s quantized LoRA base is not implemented"), "{stderr}");
    assert!(stderr.contains("--unpin_actor_parameters (a ZeRO-3 actor is gathered once per rollout"), "{stderr}");
    assert!(stderr.contains("--lr_schedular_type (did you mean --lr-scheduler-type?)"), "{stderr}");
    let missing = dir.path().join("no-such-model");
    let missing = missing.to_str().unwrap();
    for (step, flags) in [
        ("sft", vec!["--deepspeed", "--local_rank=0", "--model-name-or-path", missing]),
        (
            "ppo",
            vec!["--deepspeed", "--enable_hybrid_engine", "--local_rank", "0", "--actor-model-name-or-path", missing],
        ),
    ] {
        let stderr = usage_error(dir.path(), step, &flags);
        assert!(stderr.contains("no-such-model"), "{step} {flags:?}: {stderr}");
    }
    let stderr = usage_error(dir.path(), "sft", &["--local_rank", "1", "--model-name-or-path", missing]);
    assert!(stderr.contains("--local_rank 1 disagrees with the environment"), "{stderr}");
}

/// The flags of DS-Chat's single_node scripts and `main.py`s parse in its spelling and take
/// effect: `--print_loss`, `--disable_dropout`, `--add_eot_token` with GPT-2's EOS,
/// `--preprocessing_num_workers`, step 2's `--num_padding_at_beginning`, `--eval_interval`,
/// `--eval_iters`, step 3's test mode, `--print_answers` and earlier DS-Chat's batch names.
#[test]
fn ds_chats_main_py_flags_parse_and_take_effect() {
    let step1 = [
        "sft",
        "--data_path",
        "Dahoas/rm-static",
        "--data_split",
        "2,4,4",
        "--model_name_or_path",
        "gpt2",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "8",
        "--max_seq_len",
        "512",
        "--learning_rate",
        "9.65e-6",
        "--weight_decay",
        "0.",
        "--num_train_epochs",
        "16",
        "--gradient_accumulation_steps",
        "1",
        "--lr_scheduler_type",
        "cosine",
        "--num_warmup_steps",
        "0",
        "--seed",
        "1234",
        "--zero_stage",
        "2",
        "--deepspeed",
        "--enable_tensorboard",
        "--tensorboard_path",
        "out",
        "--output_dir",
        "out",
        "--print_loss",
        "--disable_dropout",
        "--add_eot_token",
        "--eot_token",
        "<|endoftext|>",
        "--preprocessing_num_workers",
        "2",
    ];
    let sft = sft::args::SftArgs::try_parse_from(step1).expect("step 1's flags parse");
    assert!(sft.train.print_loss);
    assert_eq!(sft.train.dropout(), Some(0.0), "--disable_dropout is --dropout 0");
    let tok = sft.data.tokenizer(data::Tokenizer::gpt2_default().unwrap()).expect("GPT-2's EOS is the eot token");
    assert_eq!(tok.encode_batch(&["Hello world".to_string()]).unwrap(), vec![vec![15496, 995]], "on 2 workers");
    let other_eot =
        sft::args::SftArgs::try_parse_from(["sft", "--add_eot_token", "--eot_token", "<|im_end|>"]).unwrap();
    let err = other_eot.data.tokenizer(data::Tokenizer::gpt2_default().unwrap()).unwrap_err().to_string();
    assert!(err.contains("--eot-token \"<|im_end|>\" is not the tokenizer's EOS"), "{err}");

    let step2 = [
        "reward",
        "--num_padding_at_beginning",
        "1",
        "--eval_interval",
        "5",
        "--eval_iters",
        "3",
        "--per_device_eval_batch_size",
        "4",
        "--dropout",
        "0.0",
        "--zero_stage",
        "2",
        "--deepspeed",
    ];
    let reward = reward::args::RewardArgs::try_parse_from(step2).expect("step 2's flags parse");
    assert_eq!((reward.num_padding_at_beginning, reward.eval_interval), (1, 5));
    let pairs: Vec<usize> = (0..100).collect();
    assert_eq!(reward.eval_pairs(&pairs, 2).len(), 3 * 4 * 2, "3 batches of 4 on each of 2 ranks");

    let step3 = [
        "ppo",
        "--num_padding_at_beginning",
        "1",
        "--enable_test_mode",
        "--test_stop_step",
        "3",
        "--print_answers",
        "--per_device_train_batch_size",
        "4",
        "--per_device_mini_train_batch_size",
        "2",
        "--generation_batch_numbers",
        "2",
        "--disable_actor_dropout",
        "--enable_hybrid_engine",
        "--deepscale",
    ];
    let ppo = ppo::args::PpoArgs::try_parse_from(step3).expect("step 3's flags parse");
    ppo.validate().expect("and validate");
    assert_eq!((ppo.stop_after(), ppo.print_answers_every(), ppo.actor_dropout()), (Some(3), 1, Some(0.0)));
    let batches = (ppo.per_device_generation_batch_size, ppo.per_device_training_batch_size, ppo.generation_batches);
    assert_eq!(batches, (4, 2, 2), "earlier DS-Chat's names of the three batch sizes");
    let plain = ppo::args::PpoArgs::try_parse_from(["ppo"]).unwrap();
    assert_eq!((plain.stop_after(), plain.print_answers_every()), (None, 10));
    // DS-Chat's PTX source is a hub dataset's configuration; without a dataset it is an error.
    let ptx =
        ["ppo", "--unsupervised_dataset_name", "wikitext", "--unsupervised_dataset_config_name", "wikitext-2-raw-v1"];
    let ptx = ppo::args::PpoArgs::try_parse_from(ptx).unwrap();
    ptx.validate().expect("a hub dataset's configuration");
    let want = data::CorpusSource::Hub { id: "wikitext".into(), config: Some("wikitext-2-raw-v1".into()) };
    assert_eq!(ptx.ptx_source("wikitext").unwrap(), want);
    let alone = ppo::args::PpoArgs::try_parse_from(["ppo", "--unsupervised_dataset_config_name", "wikitext-2-raw-v1"]);
    assert!(alone.unwrap_err().to_string().contains("--unsupervised-dataset-name"));
    let local = ["ppo", "--unsupervised_dataset_name", "shakespeare", "--unsupervised_dataset_config_name", "x"];
    let err = ppo::args::PpoArgs::try_parse_from(local).unwrap().validate().unwrap_err().to_string();
    assert!(err.contains("the embedded corpus shakespeare has no configuration"), "{err}");
}

/// `--deepspeed_config FILE`: the JSON's settings become the step's flags; one given on the
/// command line too with another value is one error line, exit 2.
#[test]
fn a_deepspeed_config_sets_the_flags_and_a_contradiction_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ds.json");
    let json = r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": true}, "wall_clock_breakdown": false,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}}"#;
    std::fs::write(&config, json).unwrap();
    let argv: Vec<std::ffi::OsString> =
        ["sft", "--deepspeed_config", config.to_str().unwrap(), "--seed", "7"].iter().map(Into::into).collect();
    let expanded = hybrid_engine::cli::deepspeed_config::expand::<sft::args::SftArgs>(argv).unwrap();
    let sft = sft::args::SftArgs::try_parse_from(expanded).unwrap();
    let t = &sft.train;
    assert_eq!((t.per_device_train_batch_size, t.gradient_accumulation_steps, t.zero_stage), (16, 2, 1));
    assert_eq!((t.gradient_clipping, t.learning_rate, t.weight_decay, t.seed), (0.5, Some(3e-4), 0.01, 7));
    assert_eq!(t.precision.dtype.name(), "bf16");
    let stderr =
        usage_error(dir.path(), "reward", &["--deepspeed_config", config.to_str().unwrap(), "--zero_stage", "3"]);
    assert!(stderr.contains("zero_optimization.stage is 1, and --zero_stage 3 says otherwise"), "{stderr}");
}

/// Step 3 reads the same config for both its models (the ZeRO stage for each, the micro-batch as
/// its training batch); a learning rate there is refused (each model has its own); pretraining
/// reads it as Megatron-DeepSpeed does (Adam's betas, clipping, the warmup schedule).
#[test]
fn step_3_and_pretraining_read_a_deepspeed_config_in_their_own_flags() {
    use hybrid_engine::cli::deepspeed_config::expand;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, json: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, json).unwrap();
        path.to_str().unwrap().to_string()
    };
    let argv = |cmd: &str, config: &str, rest: &[&str]| -> Vec<std::ffi::OsString> {
        [cmd, "--deepspeed_config", config].iter().chain(rest).map(Into::into).collect()
    };
    let ds_chat = write(
        "step3.json",
        r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
            "zero_optimization": {"stage": 3}, "bf16": {"enabled": true}, "gradient_clipping": 0.5}"#,
    );
    let expanded =
        expand::<ppo::args::PpoArgs>(argv("ppo", &ds_chat, &["--per_device_generation_batch_size", "2"])).unwrap();
    let ppo = ppo::args::PpoArgs::try_parse_from(expanded).unwrap();
    assert_eq!((ppo.actor_zero_stage, ppo.critic_zero_stage), (3, 3));
    assert_eq!((ppo.per_device_training_batch_size, ppo.per_device_generation_batch_size), (4, 2));
    assert_eq!((ppo.gradient_accumulation_steps, ppo.gradient_clipping), (2, 0.5));
    assert_eq!(ppo.precision.dtype.name(), "bf16");
    let stderr = usage_error(dir.path(), "ppo", &["--deepspeed_config", &ds_chat, "--critic_zero_stage", "2"]);
    assert!(stderr.contains("zero_optimization.stage is 3, and --critic_zero_stage 2 says otherwise"), "{stderr}");
    let with_lr = write("lr.json", r#"{"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}"#);
    let stderr = usage_error(dir.path(), "ppo", &["--deepspeed_config", &with_lr]);
    assert!(stderr.contains("optimizer.params.lr: step 3 trains two models at their own rates"), "{stderr}");

    let megatron = write(
        "pretrain.json",
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.25,
            "optimizer": {"type": "Adam", "params": {"lr": 6e-4, "betas": [0.9, 0.999], "weight_decay": 0.05}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 7, "warmup_type": "linear"}}}"#,
    );
    let expanded =
        expand::<sft::pretrain::args::PretrainArgs>(argv("sft", &megatron, &["--from-scratch", "--train-iters", "9"]))
            .unwrap();
    let pretrain = sft::pretrain::args::PretrainArgs::try_parse_from(expanded).unwrap();
    assert_eq!((pretrain.micro_batch_size, pretrain.gradient_accumulation_steps, pretrain.lr_warmup_iters), (2, 3, 7));
    assert_eq!((pretrain.clip_grad, pretrain.lr, pretrain.weight_decay), (0.25, 6e-4, 0.05));
    assert_eq!((pretrain.adam_beta1, pretrain.adam_beta2), (0.9, 0.999));
    assert_eq!(pretrain.lr_decay_style, hybrid_engine::training::schedule::DecayStyle::Linear);
    // The fine-tuning steps keep DS-Chat's betas: another pair is one line, not a silent change.
    let stderr = usage_error(dir.path(), "sft", &["--deepspeed_config", &megatron]);
    assert!(stderr.contains("optimizer.params.betas: sft trains with DS-Chat's betas [0.9, 0.95]"), "{stderr}");
}

/// `--help` of every step groups its options under headings (data, model, training, optimizer,
/// ...; `hybrid_engine::cli::heading`) and describes each of them: none is left under clap's
/// bare "Options" but --help itself, none without a line of help.
#[test]
fn every_option_of_every_step_is_described_under_a_heading() {
    use clap::CommandFactory;
    let commands = [
        sft::args::SftArgs::command(),
        reward::args::RewardArgs::command(),
        ppo::PpoArgs::command(),
        sft::pretrain::args::PretrainArgs::command(),
        rlhf::launcher::TrainArgs::command(),
    ];
    let mut missing = Vec::new();
    for command in commands {
        let name = command.get_name().to_string();
        for arg in
            command.get_arguments().filter(|a| !a.is_hide_set() && a.get_id() != "help" && a.get_id() != "version")
        {
            let flag = arg.get_long().map_or_else(|| arg.get_id().to_string(), |l| format!("--{l}"));
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{name} {flag}: no description"));
            }
            if arg.get_help_heading().is_none() && name != "train" {
                missing.push(format!("{name} {flag}: under no heading"));
            }
        }
    }
    assert!(missing.is_empty(), "{} options:\n{}", missing.len(), missing.join("\n"));
    // `plot` and `wandb-sync` are train's subcommands, listed in its help.
    let train = rlhf::launcher::TrainArgs::command();
    let commands: Vec<&str> = train.get_subcommands().map(|c| c.get_name()).collect();
    assert_eq!(commands, ["plot", "wandb-sync"]);
    assert!(train.get_subcommands().all(|c| c.get_about().is_some()));
}
