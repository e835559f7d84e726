//! Step 1 of the pipeline: supervised fine-tuning (DS-Chat `step1_supervised_finetuning`), and,
//! with `--from-scratch`, GPT-2 pretraining on a text corpus (Megatron's `pretrain_gpt2`).

pub mod args;
pub mod finetune;
pub mod pretrain;
pub mod prompt_eval;

pub use args::SftArgs;

/// Whether the command line asks for pretraining (`--from-scratch` or `--from_scratch`).
pub fn wants_pretraining<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> bool {
    args.iter().any(|a| matches!(a.as_ref().to_str(), Some("--from-scratch" | "--from_scratch")))
}

/// `sft` with the process arguments: pretraining or fine-tuning. Exits 2 on any error.
pub fn main_with_args() {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    use hybrid_engine::cli::{deepspeed_config, exit_with, parse_from_or_exit};
    let result = if wants_pretraining(&argv) {
        let argv = deepspeed_config::expand::<pretrain::args::PretrainArgs>(argv).unwrap_or_else(|e| exit_with(e));
        let args: pretrain::args::PretrainArgs = parse_from_or_exit(argv);
        pretrain::run(&args).map(|_| ())
    } else {
        let argv = deepspeed_config::expand::<SftArgs>(argv).unwrap_or_else(|e| exit_with(e));
        let args: SftArgs = parse_from_or_exit(argv);
        finetune::run(&args).map(|_| ())
    };
    if let Err(e) = result {
        hybrid_engine::cli::exit_with(e);
    }
}
