//! End-to-end tests of `sft` (step 1, supervised fine-tuning): a short run on the demo data
//! lowers eval perplexity and saves a HF directory that generates; bad data input is one clear
//! error line with exit code 2.

use std::path::Path;
use std::process::{Command, Output};

fn sft(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sft"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn sft")
}

fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "want exit 2, got {:?}; stderr:\n{stderr}", out.status);
    assert!(!stderr.contains("panicked"), "panic instead of an error:\n{stderr}");
    // A phase's timing line (tokenizing slowed by a loaded machine) is the log's, not an error.
    let lines: Vec<&str> = stderr.lines().filter(|l| !hybrid_engine::telemetry::progress::is_phase_line(l)).collect();
    assert_eq!(lines.len(), 1, "want one error line, got:\n{stderr}");
    lines[0].to_string()
}

/// A small, fast configuration on the embedded demo data.
fn small<'a>(out: &'a str, cache: &'a str) -> Vec<&'a str> {
    vec![
        "--data-path",
        "demo",
        "--model-name-or-path",
        "tiny",
        "--max-seq-len",
        "48",
        "--per-device-train-batch-size",
        "16",
        "--per-device-eval-batch-size",
        "32",
        "--learning-rate",
        "2e-3",
        "--num-warmup-steps",
        "5",
        "--dropout",
        "0",
        "--output-dir",
        out,
        "--data-output-path",
        cache,
    ]
}

#[test]
fn one_epoch_on_the_demo_lowers_perplexity_and_saves_a_model_that_generates() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("actor");
    let cache = dir.path().join("data");
    let (out_s, cache_s) = (out.to_str().unwrap(), cache.to_str().unwrap());
    let mut args = small(out_s, cache_s);
    args.extend([
        "--num-train-epochs",
        "1",
        "--eval-prompts",
        "demo",
        "--num-eval-prompts",
        "2",
        "--max-new-tokens",
        "8",
    ]);
    let run = sft(&args, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "sft failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("data phase 1 (SFT): 800 train / 80 eval rows from demo"), "{stdout}");
    assert!(stdout.contains("==========baseline========") && stdout.contains("==========finetuned======="), "{stdout}");

    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let end: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let ppl: Vec<f64> = serde_json::from_value(end["summary"]["perplexity"].clone()).unwrap();
    assert_eq!(ppl.len(), 2, "before training and after the epoch: {ppl:?}");
    assert!(ppl[1] < ppl[0] / 100.0, "one epoch must cut perplexity a hundredfold from random init: {ppl:?}");
    for f in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "prompt_eval.jsonl"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");

    // A second run reads the tokenized data from the cache and replaces the model atomically.
    // The new directory holds exactly what the second run produced: its own metrics log (the
    // same run without --eval-prompts writes as many records), and no prompt_eval.jsonl of the
    // first run's model.
    let again = sft(&[small(out_s, cache_s), vec!["--num-train-epochs", "1", "--max-seq-len", "48"]].concat(), &[]);
    let stdout = String::from_utf8_lossy(&again.stdout).to_string();
    assert!(again.status.success(), "{stdout}");
    assert!(stdout.contains("cache hit"), "{stdout}");
    let second = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(second.lines().count(), metrics.lines().count(), "metrics.jsonl holds this run's records only");
    assert!(second.ends_with('\n') && second != metrics, "the second run's own, complete records");
    assert!(!out.join("prompt_eval.jsonl").exists(), "no file of the earlier run is carried over");
}

/// `sft --lora-dim 4 --only-optimize-lora` on the demo: perplexity falls with the trunk frozen;
/// the saved directory has LoRA merged (no adapter tensors, the untouched tensors bit-identical to
/// the starting model's) and `adapter/` applied to the starting model gives the saved logits.
#[test]
fn lora_only_run_lowers_perplexity_and_saves_a_merged_model_and_a_peft_adapter() {
    use candle_core::{Device, Tensor};
    use hybrid_engine::lora::peft::load_peft_adapter;
    use hybrid_engine::model::gpt2::Gpt2Config;
    use hybrid_engine::model::positions::Positions;
    use hybrid_engine::ParamStore;

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("actor");
    let cache = dir.path().join("data");
    let (out_s, cache_s) = (out.to_str().unwrap(), cache.to_str().unwrap());
    let mut args = small(out_s, cache_s);
    args.extend(["--num-train-epochs", "1", "--lora-dim", "4", "--only-optimize-lora", "--lora-learning-rate", "2e-3"]);
    let run = sft(&args, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "sft failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("only LoRA is optimized: 32768 of 7291776 parameters train"), "{stdout}");

    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let end: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let ppl: Vec<f64> = serde_json::from_value(end["summary"]["perplexity"].clone()).unwrap();
    println!("perplexity with only the adapters training: {ppl:?}");
    assert!(ppl[1] < 0.8 * ppl[0], "one epoch of LoRA alone must lower perplexity: {ppl:?}");

    let d = Device::Cpu;
    let files = hybrid_engine::checkpoints::hf_io::load_model_dir(&out, &d).unwrap();
    assert!(files.extra_tensors.is_empty(), "adapters are merged, never saved as tensors");
    let saved = ParamStore::from_tensors(&files.config, &files.tensors, &d).unwrap();
    let mut base = ParamStore::init(&Gpt2Config::tiny(), 1234, &d).unwrap(); // the preset at --seed 1234
    for (name, var) in base.iter() {
        let diff = (var.as_tensor() - saved.get(name).unwrap().as_tensor()).unwrap().abs().unwrap();
        let diff: f32 = diff.max_all().unwrap().to_scalar().unwrap();
        let adapted = name.starts_with("h.") && name.ends_with(".weight") && !name.contains(".ln_");
        assert_eq!(diff > 0.0, adapted, "{name}: changed by {diff}");
    }

    let adapter = load_peft_adapter(&out.join("adapter"), &d).unwrap();
    assert_eq!((adapter.rank, adapter.lora_alpha, adapter.adapters.len()), (4, 1.0, 16));
    assert_eq!(adapter.base_model_name_or_path, "tiny");
    base.add_adapters(adapter.scaling(), &adapter.adapters).unwrap();
    let ids = Tensor::new(&[[464u32, 3139, 286, 4881, 318]], &d).unwrap();
    let logits =
        |p: &ParamStore| p.model(&files.config).unwrap().forward(&ids, &Positions::default(), None, None).unwrap();
    let diff: f32 = (logits(&saved) - logits(&base)).unwrap().abs().unwrap().max_all().unwrap().to_scalar().unwrap();
    assert!(diff < 1e-4, "base + adapter logits differ from the saved (merged) model's by {diff}");
}

#[test]
fn bad_data_input_is_one_clear_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let (out, cache) = (d("out"), d("cache"));
    let run = |data: &[&str], env: &[(&str, &str)]| -> String {
        let mut args = vec![
            "--model-name-or-path",
            "tiny",
            "--max-seq-len",
            "48",
            "--output-dir",
            &out,
            "--data-output-path",
            &cache,
        ];
        args.extend_from_slice(data);
        error_line(&sft(&args, env))
    };

    let err = run(&["--data-path", "no-such-dataset"], &[]);
    assert!(err.contains("no-such-dataset") && err.contains("Dahoas/rm-static"), "{err}");

    std::fs::write(d("empty.jsonl"), "").unwrap();
    let err = run(&["--data-path", &d("empty.jsonl")], &[]);
    assert!(err.contains("empty.jsonl"), "{err}");

    std::fs::write(d("cols.jsonl"), "{\"question\": \"q\", \"answer\": \" a\"}\n".repeat(20)).unwrap();
    let err = run(&["--data-path", &d("cols.jsonl")], &[]);
    assert!(err.contains("prompt") && err.contains("--prompt-key"), "{err}");

    let err = run(&["--data-path", "demo", "--data-split", "0,5,5"], &[]);
    assert!(err.contains("--data-split") && err.contains("phase 1"), "{err}");

    let hub = tempfile::tempdir().unwrap();
    let env = [("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", hub.path().to_str().unwrap())];
    let err = run(&["--data-path", "Dahoas/rm-static"], &env);
    assert!(err.contains("Dahoas/rm-static") && err.contains("HF_HUB_OFFLINE"), "{err}");

    let err = run(&["--data-path", "demo", "--max-seq-len", "4096"], &[]);
    assert!(err.contains("--max-seq-len"), "{err}");
    assert!(!Path::new(&out).join("model.safetensors").exists(), "a failed run saves nothing");
}

/// `--dtype fp16`: the log line and metrics.jsonl carry the loss scale and the skipped steps, and
/// the saved model holds the fp32 master weights. A bad dtype is one error line.
#[test]
fn fp16_run_logs_its_loss_scale_and_saves_fp32_master_weights() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let rows: Vec<String> = (0..40)
        .map(|i| serde_json::json!({"prompt": format!("Human: {i}? Assistant:"), "chosen": " yes"}).to_string())
        .collect();
    std::fs::write(d("rows.jsonl"), rows.join("\n")).unwrap();
    let (out, cache, data) = (d("out"), d("cache"), d("rows.jsonl"));
    // Not `small()`: several --data-path flags would blend the demo in.
    let args = [
        "--data-path",
        &data,
        "--data-split",
        "1",
        "--max-seq-len",
        "48",
        "--per-device-train-batch-size",
        "8",
        "--dropout",
        "0",
        "--output-dir",
        &out,
        "--data-output-path",
        &cache,
        "--dtype",
        "fp16",
        "--log-interval",
        "1",
    ];
    let run = sft(&args, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "sft failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("| loss scale: ") && stdout.contains("| skipped steps: "), "{stdout}");
    let metrics = std::fs::read_to_string(Path::new(&out).join("metrics.jsonl")).unwrap();
    let step: serde_json::Value =
        serde_json::from_str(metrics.lines().find(|l| l.contains("\"lr\"")).unwrap()).unwrap();
    assert!(step["loss_scale"].as_f64().unwrap() <= 65536.0 && step.get("skipped_steps").is_some(), "{step}");
    let saved = std::fs::read(Path::new(&out).join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&saved).unwrap();
    assert!(tensors.tensors().iter().all(|(_, t)| t.dtype() == safetensors::Dtype::F32), "fp32 masters are saved");

    let bad = sft(&[small(&out, &cache), vec!["--dtype", "fp8"]].concat(), &[]);
    let err = error_line(&bad);
    assert!(err.contains("fp8") && err.contains("--dtype"), "{err}");
}
