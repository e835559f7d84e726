//! End-to-end tests of the `chat` and `prompt_eval` binaries on a model pretrained in-process,
//! whole and split over 2 ranks.

use clap::Parser;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

/// A small model pretrained once for all tests here (a checkpoint root with `latest`).
fn model_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        // Under target/ (cargo's per-test scratch space), not the system temp dir.
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-e2e-model");
        let _ = std::fs::remove_dir_all(&dir);
        let args = sft::pretrain::args::PretrainArgs::parse_from([
            "sft",
            "--from-scratch",
            "--num-layers",
            "1",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "32",
            "--micro-batch-size",
            "2",
            "--train-iters",
            "10",
            "--eval-iters",
            "1",
            "--output-dir",
            dir.to_str().unwrap(),
        ]);
        sft::pretrain::run(&args).expect("pretraining the test model");
        dir
    })
}

fn chat(args: &[&str], stdin: &str) -> Output {
    run(env!("CARGO_BIN_EXE_chat"), args, stdin)
}

/// Runs `binary` with `stdin`, killed after two minutes: no test waits forever.
fn run(binary: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(binary)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the binary");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let watchdog = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            if std::time::Instant::now() > deadline {
                // SAFETY: kill sends a signal to our own child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watchdog.join().unwrap();
    out
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "chat failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).to_string()
}

#[test]
fn max_new_tokens_beyond_the_context_generates_up_to_the_context() {
    let root = model_root().to_str().unwrap();
    let one_shot = |n: &str| chat(&["--path", root, "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", n], "");
    // usize::MAX used to overflow the KV cache's size into a refusal.
    let huge = stdout(&one_shot(&usize::MAX.to_string()));
    assert_eq!(huge, stdout(&one_shot("100000")), "both stop at the model's context (or EOS)");
}

#[test]
fn one_shot_prompt_prints_the_greedy_completion_of_the_model() {
    let root = model_root().to_str().unwrap();
    let args = ["--path", root, "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "8"];
    let out = stdout(&chat(&args, ""));

    // The same completion computed through the library, independently of the binary.
    let (model, _) = rlhf::chat::ChatModel::load(root, &candle_core::Device::Cpu, 1).unwrap();
    let eos = model.tokenizer.eos_id();
    let sampling =
        hybrid_engine::generation::generate::SamplingConfig::greedy(8, Some(eos), eos, model.tokenizer.vocab_size());
    let ids = model.tokenizer.encode("ROMEO:").unwrap();
    let want = model.tokenizer.decode(&model.complete(&ids, &sampling).unwrap()).unwrap();
    assert!(!want.is_empty());
    assert_eq!(out, format!("{want}\n"), "prints only the completion");
    assert_eq!(stdout(&chat(&args, "")), out, "greedy is deterministic");
}

#[test]
fn interactive_chat_takes_turns_clears_and_quits() {
    let root = model_root().to_str().unwrap();
    let out = stdout(&chat(
        &["--path", root, "--max-new-tokens", "6"],
        "Hello there\nclear\nHow are you?\nquit\nnever read\n",
    ));
    assert_eq!(out.matches("Assistant:").count(), 2, "{out}");
    assert!(out.contains("[history cleared]"), "{out}");
}

#[test]
fn a_bad_model_path_is_a_one_line_error() {
    let o = chat(&["--path", "/no/such/model", "--prompt", "hi"], "");
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/no/such/model"), "{err}");
}

/// `--tensor-model-parallel-size 2`: the command starts a second rank and the two generate every
/// answer in lockstep from their slices of the model; what it prints is what one process prints
/// (greedy and sampled one-shot completions, an interactive session, prompt_eval's comparison),
/// and the second rank ends with it. A split the model cannot take is one line.
#[test]
fn chat_and_prompt_eval_split_over_2_ranks_print_what_one_process_prints() {
    let root = model_root().to_str().unwrap();
    let both = |args: &[&str], stdin: &str| {
        let split: Vec<&str> = args.iter().copied().chain(["--tensor-model-parallel-size", "2"]).collect();
        (stdout(&chat(args, stdin)), stdout(&chat(&split, stdin)))
    };
    for decoding in [&["--greedy"][..], &["--seed", "3", "--temperature", "1.0"]] {
        let args: Vec<&str> =
            ["--path", root, "--prompt", "ROMEO:", "--max-new-tokens", "16"].iter().chain(decoding).copied().collect();
        let (whole, split) = both(&args, "");
        assert!(whole.trim().len() > 4, "{whole:?}");
        assert_eq!(split, whole, "{decoding:?}");
    }
    let (whole, split) =
        both(&["--path", root, "--greedy", "--max-new-tokens", "8"], "Hello there\nclear\nHow are you?\nquit\n");
    assert_eq!(whole.matches("Assistant:").count(), 2, "{whole}");
    let banner = "Chatting with the model (split over 2 ranks).";
    assert_eq!(split.replace(banner, "Chatting with the model."), whole, "{split}");

    let eval = |extra: &[&str]| {
        let args: Vec<&str> = ["--model-name-or-path-baseline", root, "--model-name-or-path-finetune", root]
            .iter()
            .chain(["--num-prompts", "3", "--max-new-tokens", "8", "--device", "cpu"].iter())
            .chain(extra)
            .copied()
            .collect();
        run(env!("CARGO_BIN_EXE_prompt_eval"), &args, "")
    };
    let whole = stdout(&eval(&[]));
    assert_eq!(whole.matches("==========finetuned=======").count(), 3, "{whole}");
    assert_eq!(stdout(&eval(&["--tp-size", "2"])), whole);

    let bad = chat(&["--path", root, "--prompt", "hi", "--tp-size", "3"], "");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("does not divide the model's 2 attention heads"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}
