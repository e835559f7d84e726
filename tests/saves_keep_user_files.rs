//! A save never deletes a file it did not write. Every step runs as DeepSpeed-Chat's scripts run
//! it, `--output_dir $OUT --tensorboard_path $OUT &> $OUT/training.log`, into a directory that
//! already holds a user's files, twice (the second save replaces the first one's model): the log
//! keeps everything both runs wrote, the event files and the user's files survive, and the model
//! is the second run's.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A step (`sft`, `reward`, `ppo`): the multi-call `train` binary under that name.
fn step_binary(dir: &Path, step: &str) -> PathBuf {
    let link = dir.join(step);
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_train"), &link).unwrap();
    }
    link
}

/// Runs `step` with `&> out/training.log` (appending, as a second `&>>` run would; the log is
/// opened before the step starts, as the shell opens it) and `--output-dir`/`--tensorboard-path`
/// set to `out`.
fn run_like_ds_chat(bin_dir: &Path, step: &str, out: &Path, args: &[&str]) {
    let log = OpenOptions::new().create(true).append(true).open(out.join("training.log")).unwrap();
    let o = out.to_str().unwrap();
    let status = Command::new(step_binary(bin_dir, step))
        .args(args)
        .args(["--output-dir", o, "--tensorboard-path", o])
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("RLHF_ENABLE_WANDB")
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .status()
        .unwrap();
    let log = std::fs::read_to_string(out.join("training.log")).unwrap_or_default();
    assert!(status.success(), "{step} failed ({status}); training.log:\n{log}");
}

/// The user's files in `dir` before a step: a note and a directory of their own.
fn put_user_files(dir: &Path) {
    std::fs::create_dir_all(dir.join("my-runs")).unwrap();
    std::fs::write(dir.join("notes.txt"), "lr sweep, run 3").unwrap();
    std::fs::write(dir.join("my-runs/events.out.tfevents.0.host"), "an older run's events").unwrap();
}

/// What every save into `dir` must have kept; `runs` is how many runs logged into it.
fn assert_user_files_survived(dir: &Path, runs: usize) {
    let log = std::fs::read_to_string(dir.join("training.log")).unwrap();
    let starts = log.matches("command: ").count();
    assert_eq!(starts, runs, "training.log holds every run's output ({runs} command lines):\n{log}");
    assert_eq!(std::fs::read_to_string(dir.join("notes.txt")).unwrap(), "lr sweep, run 3");
    assert_eq!(
        std::fs::read_to_string(dir.join("my-runs/events.out.tfevents.0.host")).unwrap(),
        "an older run's events"
    );
    let events = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("events.out.tfevents."))
        .count();
    assert_eq!(events, runs, "one TensorBoard event file a run in {}", dir.display());
}

fn preference_rows(path: &Path) {
    let rows: Vec<String> = (0..48)
        .map(|i| {
            let prompt = format!("\n\nHuman: What is {i} plus one?\n\nAssistant:");
            serde_json::json!({"prompt": prompt, "chosen": format!(" {}", i + 1), "rejected": " no"}).to_string()
        })
        .collect();
    std::fs::write(path, rows.join("\n")).unwrap();
}

#[test]
fn every_step_saving_into_a_directory_of_user_files_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let data = root.join("pairs.jsonl");
    preference_rows(&data);
    let data = data.to_str().unwrap();
    let cache = root.join("cache");
    let cache = cache.to_str().unwrap();
    let d = |name: &str| root.join(name);

    // Steps 1 and 2, each twice into the same directory; step 2 from step 1's model.
    let (step1, step2) = (d("step1"), d("step2"));
    let s1 = step1.to_str().unwrap();
    for (step, dir, model) in [("sft", &step1, "tiny"), ("reward", &step2, s1)] {
        put_user_files(dir);
        let args = [
            "--data-path",
            data,
            "--data-output-path",
            cache,
            "--model-name-or-path",
            model,
            "--max-seq-len",
            "32",
            "--per-device-train-batch-size",
            "16",
            "--num-train-epochs",
            "1",
            // Near the random start: a tiny model trained on these one-token answers answers
            // with EOS at once, and step 3 refuses a first rollout of empty answers.
            "--learning-rate",
            "1e-5",
        ];
        for _ in 0..2 {
            run_like_ds_chat(root, step, dir, &args);
        }
        assert_user_files_survived(dir, 2);
    }
    assert!(step1.join("model.safetensors").is_file());
    assert!(step2.join("reward_eval.json").is_file());

    // Step 3: the logs in $OUTPUT, the models in $OUTPUT/actor and $OUTPUT/critic, where the
    // user's files also survive.
    let step3 = d("step3");
    put_user_files(&step3);
    put_user_files(&step3.join("actor"));
    let s2 = step2.to_str().unwrap();
    let ppo = [
        "--data-path",
        data,
        "--data-split",
        "0,0,1",
        "--no-data-cache",
        "--actor-model-name-or-path",
        s1,
        "--critic-model-name-or-path",
        s2,
        "--max-prompt-seq-len",
        "24",
        "--max-answer-seq-len",
        "4",
        "--per-device-generation-batch-size",
        "8",
        "--per-device-training-batch-size",
        "8",
        "--num-train-epochs",
        "1",
    ];
    run_like_ds_chat(root, "ppo", &step3, &ppo);
    assert_user_files_survived(&step3, 1);
    let notes = std::fs::read_to_string(step3.join("actor/notes.txt")).unwrap();
    assert_eq!(notes, "lr sweep, run 3", "a user's file inside the saved actor survives");
    assert!(step3.join("actor/model.safetensors").is_file() && step3.join("critic/model.safetensors").is_file());

    // Pretraining: its checkpoints (each a model directory) and `latest` into the same directory.
    let pre = d("pretrain");
    put_user_files(&pre);
    let p = pre.to_str().unwrap();
    let pretrain = [
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
        "--train-iters",
        "4",
        "--eval-interval",
        "4",
        "--eval-iters",
        "1",
        "--save",
        p,
        "--save-interval",
        "2",
    ];
    run_like_ds_chat(root, "sft", &pre, &pretrain);
    assert_user_files_survived(&pre, 1);
    assert!(pre.join("iter_0000004/model.safetensors").is_file());
}
