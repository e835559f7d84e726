//! DeepSpeed's `--deepspeed_config FILE` (every step, and pretraining as Megatron-DeepSpeed reads
//! it): the JSON config's settings become the command's flags, placed before the command line's
//! own. A key that contradicts a flag given on the command line is one error; a value this engine
//! does not implement is one error that says what to use; a key with no meaning here (or none in
//! this command) is listed once, in one line, as ignored.
//!
//! Step 3 trains two models: the config's batch, ZeRO, precision and clipping settings apply to
//! both (DS-Chat builds both engines' configs from the same flags); a learning rate or weight
//! decay there is refused, as the two models have their own flags for them.
//!
//! The batch keys are checked as DeepSpeed checks them: `train_batch_size` =
//! `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps` x data-parallel ranks, the
//! missing one derived from the other two.

use crate::comm::RankEnv;
use crate::training::zero::ZeroStage;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::ffi::OsString;
use std::path::Path;

/// The flag's spellings on the command line.
pub const FLAGS: [&str; 4] = ["--deepspeed-config", "--deepspeed_config", "--deepscale-config", "--deepscale_config"];

/// Config files larger than this are refused before they are read: a DeepSpeed config is a few KiB.
const MAX_BYTES: u64 = 1 << 20;

/// `argv` (the program's name first) with the settings of the DeepSpeed config it names, if it
/// names one, put before its own flags under command `T`'s spellings; the file's ignored keys are
/// printed in one line, by the first rank. `tp` flags and the environment's world size give the data-parallel ranks
/// the batch keys divide by.
pub fn expand<T: clap::CommandFactory>(argv: Vec<OsString>) -> Result<Vec<OsString>> {
    let args: Vec<String> = argv.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let Some(path) = flag_value(&args, &FLAGS) else { return Ok(argv) };
    let ranks = RankEnv::from_process()?;
    let world = ranks.world;
    let tp =
        flag_value(&args, &["--tensor-model-parallel-size", "--tensor_model_parallel_size", "--tp-size", "--tp_size"])
            .or_else(|| std::env::var(crate::cli::dist_args::TP_SIZE_ENV).ok())
            .map(|t| t.parse::<usize>().map_err(|_| anyhow!("--tensor-model-parallel-size {t:?} is not a number")))
            .transpose()?
            .unwrap_or(1)
            .max(1);
    let settings = read(Path::new(&path), (world / tp).max(1))?;
    let settings = for_command(&T::command(), settings).map_err(|e| anyhow!("--deepspeed_config {path}: {e}"))?;
    for (flag, value, key) in &settings.flags {
        let spellings = spellings(&T::command(), flag);
        let given = spellings.iter().find_map(|s| flag_value(&args, &[s.as_str()]).map(|v| (s.clone(), v)));
        if let Some((spelling, v)) = given.filter(|(_, v)| !same(v, value)) {
            let value = value.as_deref().unwrap_or_default();
            bail!("--deepspeed_config {path}: {key} is {value}, and {spelling} {v} says otherwise: keep one of them");
        }
    }
    if !settings.ignored.is_empty() && ranks.rank == 0 {
        println!("--deepspeed_config {path}: ignored (no meaning here): {}", settings.ignored.join(", "));
    }
    let mut out = vec![argv[0].clone()];
    for (flag, value, _) in settings.flags {
        out.push(flag.into());
        if let Some(v) = value {
            out.push(v.into());
        }
    }
    out.extend(argv.into_iter().skip(1));
    Ok(out)
}

/// `settings` (in steps 1 and 2's flags) as command `cmd` spells them: step 3's two models each get
/// the ZeRO stage and the micro-batch is its training batch; a setting `cmd` has no flag for is
/// ignored.
fn for_command(cmd: &clap::Command, settings: Settings) -> Result<Settings> {
    let mut out = Settings { flags: Vec::new(), ignored: settings.ignored };
    for (flag, value, key) in settings.flags {
        let names: Vec<&str> = match (cmd.get_name(), flag.as_str()) {
            ("ppo", "--zero-stage") => vec!["--actor-zero-stage", "--critic-zero-stage"],
            // Step 3's `--per-device-train-batch-size` is DS-Chat's old name of the generation batch.
            ("ppo", "--per-device-train-batch-size") => vec!["--per-device-training-batch-size"],
            ("ppo", "--learning-rate" | "--weight-decay") => bail!(
                "{key}: step 3 trains two models at their own rates: drop it and pass --actor_learning_rate, \
                 --critic_learning_rate (--actor_weight_decay, --critic_weight_decay)"
            ),
            _ => vec![flag.as_str()],
        };
        for name in names {
            let long = command_arg(cmd, name).and_then(clap::Arg::get_long);
            match long {
                Some(long) => out.flags.push((format!("--{long}"), value.clone(), key.clone())),
                // Only pretraining sets Adam's betas; the steps train with DS-Chat's.
                None if DS_CHAT_BETAS.iter().any(|(f, b)| *f == name && value.as_deref() == Some(b)) => {}
                None if DS_CHAT_BETAS.iter().any(|(f, _)| *f == name) => {
                    bail!("{key}: {} trains with DS-Chat's betas [0.9, 0.95]: use those", cmd.get_name())
                }
                None if !out.ignored.contains(&key) => out.ignored.push(key.clone()),
                None => {}
            }
        }
    }
    out.ignored.sort();
    Ok(out)
}

/// The fine-tuning steps' Adam betas (`AdamWConfig::ds_chat`), as the config's flags spell them.
const DS_CHAT_BETAS: [(&str, &str); 2] = [("--adam-beta1", "0.9"), ("--adam-beta2", "0.95")];

/// The argument of `cmd` whose long name or alias is `flag`.
fn command_arg<'c>(cmd: &'c clap::Command, flag: &str) -> Option<&'c clap::Arg> {
    let name = flag.trim_start_matches("--");
    cmd.get_arguments().find(|a| a.get_long() == Some(name) || a.get_all_aliases().unwrap_or_default().contains(&name))
}

/// What a config file says: each setting as a flag (with its value; `None` for a switch) and the
/// key it came from, and the keys with no meaning here.
#[derive(Debug, Default, PartialEq)]
pub struct Settings {
    pub flags: Vec<(String, Option<String>, String)>,
    pub ignored: Vec<String>,
}

/// Reads a DeepSpeed JSON config for `data_parallel` ranks (see the module's documentation).
pub fn read(path: &Path, data_parallel: usize) -> Result<Settings> {
    let what = || format!("--deepspeed_config {}", path.display());
    let size = std::fs::metadata(path).with_context(|| format!("{}: cannot read it", what()))?.len();
    if size > MAX_BYTES {
        bail!("{}: {size} bytes is not a DeepSpeed config (at most {MAX_BYTES})", what());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read it", what()))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: not JSON: {e}", what()))?;
    settings(&config, data_parallel).map_err(|e| anyhow!("{}: {e}", what()))
}

/// The settings of a parsed config (see [`read`]).
pub fn settings(config: &Value, data_parallel: usize) -> Result<Settings> {
    let Value::Object(top) = config else { bail!("the config is not a JSON object") };
    let mut s = Settings::default();
    let mut set = |flag: &str, value: Option<String>, key: &str| s.flags.push((flag.into(), value, key.into()));
    let mut ignored = Vec::new();
    batch_sizes(top, data_parallel, &mut set)?;
    for (key, value) in top {
        match key.as_str() {
            "train_batch_size" | "train_micro_batch_size_per_gpu" | "gradient_accumulation_steps" => {}
            "gradient_clipping" => set("--gradient-clipping", Some(number(value, key)?.to_string()), key),
            "steps_per_print" => set("--log-interval", Some(count(value, key)?.to_string()), key),
            "communication_data_type" => match value {
                Value::Null => {}
                Value::String(name) => set("--communication-data-type", Some(name.clone()), key),
                other => {
                    bail!("communication_data_type {other} is not a type name: use \"fp32\", \"fp16\" or \"bf16\"")
                }
            },
            "zero_optimization" => zero(value, &mut set, &mut ignored)?,
            "fp16" => fp16(value, &mut set, &mut ignored)?,
            "bf16" => {
                if enabled(value, key)? {
                    if top.get("fp16").map(|v| enabled(v, "fp16")).transpose()? == Some(true) {
                        bail!("fp16.enabled and bf16.enabled are both true: enable one of them");
                    }
                    set("--dtype", Some("bf16".into()), "bf16.enabled");
                }
            }
            "optimizer" => optimizer(value, &mut set)?,
            "scheduler" => scheduler(value, &mut set, &mut ignored)?,
            "tensorboard" => {
                if enabled(value, key)? {
                    set("--enable-tensorboard", None, "tensorboard.enabled");
                    if let Some(dir) = value.get("output_path").and_then(Value::as_str) {
                        set("--tensorboard-path", Some(dir.into()), "tensorboard.output_path");
                    }
                }
            }
            _ => ignored.push(key.clone()),
        }
    }
    s.ignored = ignored;
    Ok(s)
}

type Set<'a> = dyn FnMut(&str, Option<String>, &str) + 'a;

/// DeepSpeed's batch triple, the missing member derived as DeepSpeed derives it.
fn batch_sizes(top: &serde_json::Map<String, Value>, dp: usize, set: &mut Set) -> Result<()> {
    let dp = dp as u64;
    let get = |k: &str| top.get(k).map(|v| count(v, k)).transpose();
    let (global, micro, accumulation) =
        (get("train_batch_size")?, get("train_micro_batch_size_per_gpu")?, get("gradient_accumulation_steps")?);
    let (micro, accumulation) = match (global, micro, accumulation) {
        (Some(g), Some(m), Some(a)) if g != m * a * dp => bail!(
            "train_batch_size {g} is not train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {a} x {dp} data-parallel ranks"
        ),
        (Some(g), Some(m), None) if g % (m * dp) != 0 => {
            bail!("train_batch_size {g} is not a multiple of train_micro_batch_size_per_gpu {m} x {dp} data-parallel ranks")
        }
        (Some(g), Some(m), None) => (Some(m), Some(g / (m * dp))),
        (Some(g), None, Some(a)) if g % (a * dp) != 0 => {
            bail!("train_batch_size {g} is not a multiple of gradient_accumulation_steps {a} x {dp} data-parallel ranks")
        }
        (Some(g), None, Some(a)) => (Some(g / (a * dp)), Some(a)),
        (Some(g), None, None) if g % dp != 0 => bail!("train_batch_size {g} does not split over {dp} data-parallel ranks"),
        (Some(g), None, None) => (Some(g / dp), Some(1)),
        (_, m, a) => (m, a),
    };
    if let Some(m) = micro {
        set("--per-device-train-batch-size", Some(m.to_string()), "train_micro_batch_size_per_gpu");
    }
    if let Some(a) = accumulation {
        set("--gradient-accumulation-steps", Some(a.to_string()), "gradient_accumulation_steps");
    }
    Ok(())
}

fn zero(value: &Value, set: &mut Set, ignored: &mut Vec<String>) -> Result<()> {
    let Value::Object(zero) = value else { bail!("zero_optimization is not an object") };
    // DeepSpeed reads allgather_bucket_size at stages 1 and 2 only (the gather after the step).
    let stage = zero.get("stage").map(|v| count(v, "zero_optimization.stage")).transpose()?;
    let gathers_after_the_step = stage.is_none_or(ZeroStage::number_gathers_after_the_step);
    for (key, v) in zero {
        let full = format!("zero_optimization.{key}");
        match key.as_str() {
            "stage" => set("--zero-stage", Some(count(v, &full)?.to_string()), &full),
            "reduce_bucket_size" => set("--reduce-bucket-size", Some(count(v, &full)?.to_string()), &full),
            "allgather_bucket_size" if !gathers_after_the_step => ignored.push(full),
            "allgather_bucket_size" => set("--allgather-bucket-size", Some(count(v, &full)?.to_string()), &full),
            "offload_optimizer" | "offload_param" => match v.get("device").and_then(Value::as_str) {
                None | Some("none") => {}
                Some("cpu") => set("--offload", None, &full),
                Some(device) => bail!("{full}.device {device:?} is not implemented: use \"cpu\" or \"none\""),
            },
            _ => ignored.push(full),
        }
    }
    Ok(())
}

/// DeepSpeed's dynamic loss scaling. Its config's defaults carry over where the commands' differ:
/// a window of 1000 steps (the steps' 100 is DS-Chat's, which writes it into its config), and a
/// first scale of 2^16 (pretraining's own default is Megatron's 2^32).
fn fp16(value: &Value, set: &mut Set, ignored: &mut Vec<String>) -> Result<()> {
    if !enabled(value, "fp16")? {
        return Ok(());
    }
    set("--dtype", Some("fp16".into()), "fp16.enabled");
    let Value::Object(fp16) = value else { unreachable!("enabled() read an object") };
    for (key, flag, default) in
        [("loss_scale_window", "--loss-scale-window", "1000"), ("initial_scale_power", "--initial-scale-power", "16")]
    {
        if !fp16.contains_key(key) {
            set(flag, Some(default.into()), &format!("fp16.{key} (absent: DeepSpeed's default)"));
        }
    }
    for (key, v) in fp16 {
        let full = format!("fp16.{key}");
        match key.as_str() {
            "enabled" | "auto_cast" => {}
            "loss_scale" if number(v, &full)? != 0.0 => {
                bail!("{full} {v}: a static loss scale is not implemented: use 0 (dynamic scaling)")
            }
            "loss_scale" => {}
            "initial_scale_power" => set("--initial-scale-power", Some(count(v, &full)?.to_string()), &full),
            "loss_scale_window" => set("--loss-scale-window", Some(count(v, &full)?.to_string()), &full),
            // The scaler's are DeepSpeed's defaults and fixed.
            "hysteresis" if count(v, &full)? != 2 => {
                bail!("{full} {v}: the scale halves after 2 overflows here: use 2")
            }
            "min_loss_scale" if number(v, &full)? != 1.0 => bail!("{full} {v}: the minimum scale is 1 here: use 1"),
            "consecutive_hysteresis" if v.as_bool() != Some(false) => bail!(
                "{full} {v}: the hysteresis refills only when the scale grows here (DeepSpeed's default): use false"
            ),
            "hysteresis" | "min_loss_scale" | "consecutive_hysteresis" => {}
            _ => ignored.push(full),
        }
    }
    Ok(())
}

fn optimizer(value: &Value, set: &mut Set) -> Result<()> {
    let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
    if !matches!(kind.to_ascii_lowercase().as_str(), "adam" | "adamw") {
        bail!("optimizer.type {kind:?} is not implemented: AdamW is (\"AdamW\")");
    }
    let Some(Value::Object(params)) = value.get("params") else { return Ok(()) };
    for (key, v) in params {
        let full = format!("optimizer.params.{key}");
        match key.as_str() {
            "lr" => set("--learning-rate", Some(number(v, &full)?.to_string()), &full),
            "eps" => set("--adam-eps", Some(number(v, &full)?.to_string()), &full),
            "weight_decay" => set("--weight-decay", Some(number(v, &full)?.to_string()), &full),
            "betas" => match v.as_array().map(|b| b.iter().filter_map(Value::as_f64).collect::<Vec<_>>()).as_deref() {
                Some(&[beta1, beta2]) => {
                    set("--adam-beta1", Some(beta1.to_string()), &full);
                    set("--adam-beta2", Some(beta2.to_string()), &full);
                }
                _ => bail!("{full} {v} is not two numbers"),
            },
            _ => bail!("{full} is not an AdamW setting here (lr, betas, eps, weight_decay)"),
        }
    }
    Ok(())
}

/// DeepSpeed's three warmup schedulers as Hugging Face's (which the steps implement, stepped as
/// DS-Chat steps them). Where DeepSpeed's default differs from what runs here (a log warmup; a
/// cosine ending at 1e-4 of the peak) the key must say what runs; DeepSpeed's default warmup of
/// 1000 steps, and at least 2, carries over.
fn scheduler(value: &Value, set: &mut Set, ignored: &mut Vec<String>) -> Result<()> {
    let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
    let hf = match kind {
        "WarmupLR" => "constant_with_warmup",
        "WarmupDecayLR" => "linear",
        "WarmupCosineLR" => "cosine",
        _ => bail!("scheduler.type {kind:?} is not implemented: WarmupLR, WarmupDecayLR or WarmupCosineLR"),
    };
    set("--lr-scheduler-type", Some(hf.into()), "scheduler.type");
    let no_params = serde_json::Map::new();
    let params = match value.get("params") {
        None => &no_params,
        Some(Value::Object(params)) => params,
        Some(other) => bail!("scheduler.params {other} is not an object"),
    };
    if params.get("warmup_type").and_then(Value::as_str) != Some("linear") {
        let given = params.get("warmup_type").map_or("absent (DeepSpeed's default: log)".into(), Value::to_string);
        bail!(
            "scheduler.params.warmup_type {given}: DeepSpeed's log warmup is not implemented, the warmup here is \
             linear: add \"warmup_type\": \"linear\""
        );
    }
    if kind == "WarmupCosineLR" && !params.contains_key("cos_min_ratio") {
        bail!("scheduler.params.cos_min_ratio absent (DeepSpeed's default: 0.0001): the cosine decays to 0 here: add \"cos_min_ratio\": 0");
    }
    let warmup = match params.get("warmup_num_steps") {
        Some(v) => (count(v, "scheduler.params.warmup_num_steps")?, "scheduler.params.warmup_num_steps"),
        None => (1000, "scheduler.params.warmup_num_steps (absent: DeepSpeed's default)"),
    };
    set("--num-warmup-steps", Some(warmup.0.max(2).to_string()), warmup.1);
    for (key, v) in params {
        let full = format!("scheduler.params.{key}");
        match key.as_str() {
            "warmup_type" | "warmup_num_steps" => {}
            "warmup_max_lr" => set("--learning-rate", Some(number(v, &full)?.to_string()), &full),
            "warmup_min_lr" | "warmup_min_ratio" if number(v, &full)? != 0.0 => {
                bail!("{full} {v}: the warmup starts at 0 here: use 0")
            }
            "cos_min_ratio" if number(v, &full)? != 0.0 => bail!("{full} {v}: the cosine decays to 0 here: use 0"),
            "warmup_min_lr" | "warmup_min_ratio" | "cos_min_ratio" => {}
            // The schedule spans the run's own steps.
            _ => ignored.push(full),
        }
    }
    Ok(())
}

/// Whether a block (`fp16`, `bf16`, `tensorboard`, named `key`) is enabled: off without
/// `enabled`; anything but a boolean (Hugging Face's `"auto"`, which its trainer fills in before
/// DeepSpeed reads it) is refused rather than read as off.
fn enabled(value: &Value, key: &str) -> Result<bool> {
    match value.get("enabled") {
        None => Ok(false),
        Some(Value::Bool(on)) => Ok(*on),
        Some(other) => bail!("{key}.enabled {other} is not true or false (\"auto\" is filled in by Hugging Face's trainer, not here): write true or false"),
    }
}

fn number(v: &Value, key: &str) -> Result<f64> {
    v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| anyhow!("{key} {v} is not a number"))
}

fn count(v: &Value, key: &str) -> Result<u64> {
    v.as_u64().ok_or_else(|| anyhow!("{key} {v} is not a non-negative integer"))
}

/// A flag's spellings on `cmd`'s command line: its long name and aliases, each also in snake case.
fn spellings(cmd: &clap::Command, flag: &str) -> Vec<String> {
    let snake = |f: &str| format!("--{}", f.replace('-', "_"));
    let mut names = vec![flag.trim_start_matches("--").to_string()];
    if let Some(arg) = command_arg(cmd, flag) {
        names.extend(arg.get_all_aliases().unwrap_or_default().into_iter().map(str::to_string));
    }
    names.iter().flat_map(|n| [format!("--{n}"), snake(n)]).collect()
}

/// Whether a flag's value on the command line and the config's are the same setting (numbers
/// compared as numbers: `1e-3` is `0.001`).
fn same(given: &str, config: &Option<String>) -> bool {
    match config {
        None => true,
        Some(c) => match (given.parse::<f64>(), c.parse::<f64>()) {
            (Ok(a), Ok(b)) => a == b,
            _ => given == c,
        },
    }
}

/// The value of the first of `names` in `args` (`--flag value` or `--flag=value`; a switch's is
/// "").
fn flag_value(args: &[String], names: &[&str]) -> Option<String> {
    let mut it = args.iter().skip(1).peekable();
    while let Some(arg) = it.next() {
        if arg == "--" {
            return None;
        }
        for name in names {
            if let Some(v) = arg.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')) {
                return Some(v.to_string());
            }
            if arg == name {
                return Some(it.peek().filter(|v| !v.starts_with("--")).map_or(String::new(), |v| v.to_string()));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn flags(s: &Settings) -> Vec<String> {
        s.flags
            .iter()
            .map(|(f, v, _)| format!("{f}{}", v.as_ref().map_or(String::new(), |v| format!("={v}"))))
            .collect()
    }

    /// DS-Chat's own config (`get_train_ds_config`) and DeepSpeed's usual keys map to the flags.
    #[test]
    fn a_deepspeed_config_becomes_the_steps_flags() -> Result<()> {
        let config = json!({
            "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8 as u64, "allgather_bucket_size": 2e8 as u64, "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 1e4 as u64},
            "fp16": {"enabled": true, "loss_scale_window": 100, "initial_scale_power": 12, "hysteresis": 2},
            "gradient_clipping": 1.0, "prescale_gradients": false, "wall_clock_breakdown": false,
            "communication_data_type": "bf16",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 1000, "warmup_type": "linear"}},
        });
        let s = settings(&config, 2)?;
        let f = flags(&s);
        for want in [
            "--per-device-train-batch-size=8",
            "--gradient-accumulation-steps=4",
            "--zero-stage=2",
            "--reduce-bucket-size=500000000",
            "--allgather-bucket-size=200000000",
            "--offload",
            "--dtype=fp16",
            "--loss-scale-window=100",
            "--initial-scale-power=12",
            "--gradient-clipping=1",
            "--learning-rate=0.001",
            "--adam-eps=0.00000001",
            "--weight-decay=0.1",
            "--lr-scheduler-type=linear",
            "--num-warmup-steps=10",
            "--log-interval=10",
            "--adam-beta1=0.9",
            "--adam-beta2=0.95",
            "--communication-data-type=bf16",
        ] {
            assert!(f.contains(&want.to_string()), "{want} in {f:?}");
        }
        let ignored = [
            "prescale_gradients",
            "scheduler.params.total_num_steps",
            "wall_clock_breakdown",
            "zero_optimization.stage3_param_persistence_threshold",
        ];
        let mut got = s.ignored.clone();
        got.sort();
        assert_eq!(got, ignored);
        Ok(())
    }

    /// DeepSpeed's batch arithmetic: the missing member is derived; an inconsistent triple, an
    /// indivisible one and what is not implemented are one line each.
    #[test]
    fn batch_keys_are_checked_and_unimplemented_values_refused() {
        let f = |c: Value, dp| settings(&c, dp).map(|s| flags(&s));
        assert_eq!(
            f(json!({"train_batch_size": 32, "gradient_accumulation_steps": 2}), 4).unwrap(),
            ["--per-device-train-batch-size=4", "--gradient-accumulation-steps=2"]
        );
        let err = |c: Value, dp| f(c, dp).unwrap_err().to_string();
        let inconsistent =
            json!({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2});
        assert!(err(inconsistent, 4)
            .contains("is not train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 4"));
        assert!(err(json!({"train_batch_size": 30}), 4).contains("does not split over 4"));
        assert!(err(json!({"fp16": {"enabled": true, "loss_scale": 128}}), 1).contains("static loss scale"));
        let refill = json!({"fp16": {"enabled": true, "consecutive_hysteresis": true}});
        assert!(err(refill, 1)
            .contains("fp16.consecutive_hysteresis true: the hysteresis refills only when the scale grows"));
        // DeepSpeed's own defaults where the config is silent: a window of 1000, not DS-Chat's 100,
        // and 2^16, not pretraining's Megatron 2^32.
        let defaults = json!({"fp16": {"enabled": true, "consecutive_hysteresis": false, "hysteresis": 2}});
        let want = ["--dtype=fp16", "--loss-scale-window=1000", "--initial-scale-power=16"];
        assert_eq!(f(defaults, 1).unwrap(), want);
        // The scaler's fixed settings: DeepSpeed's values accepted, others refused.
        let hysteresis = json!({"fp16": {"enabled": true, "hysteresis": 3}});
        assert!(err(hysteresis, 1).contains("fp16.hysteresis 3: the scale halves after 2 overflows here"));
        let floor = json!({"fp16": {"enabled": true, "min_loss_scale": 2}});
        assert!(err(floor, 1).contains("fp16.min_loss_scale 2: the minimum scale is 1 here"));
        // A loss scale of 0 is DeepSpeed's dynamic scaling: accepted, neither refused nor ignored,
        // as are the scaler's fixed settings at DeepSpeed's values.
        let dynamic = json!({"fp16": {"enabled": true, "loss_scale": 0, "hysteresis": 2, "min_loss_scale": 1}});
        let dynamic = settings(&dynamic, 1).unwrap();
        assert_eq!((flags(&dynamic), dynamic.ignored), (want.map(String::from).to_vec(), Vec::<String>::new()));
        assert!(err(json!({"optimizer": {"type": "Lamb"}}), 1).contains("AdamW is"));
        assert!(err(json!({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}), 1).contains("\"nvme\""));
        assert!(err(json!({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}), 1).contains("not two numbers"));
        assert!(err(json!([1, 2]), 1).contains("not a JSON object"));
        assert!(err(json!({"gradient_clipping": "big"}), 1).contains("gradient_clipping \"big\" is not a number"));
        // Half precision on or off, never both, never "auto" read as off.
        assert!(err(json!({"bf16": {"enabled": "auto"}}), 1).contains("bf16.enabled \"auto\" is not true or false"));
        assert!(err(json!({"fp16": {"enabled": "auto"}}), 1).contains("fp16.enabled"));
        let both = json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}});
        assert!(err(both, 1).contains("both true"));
        assert_eq!(f(json!({"fp16": {"enabled": false}, "bf16": {"enabled": true}}), 1).unwrap(), ["--dtype=bf16"]);
    }

    /// DeepSpeed's schedulers run here as Hugging Face's with a linear warmup: DeepSpeed's
    /// defaults that differ (its log warmup, a cosine's floor) are refused unless the config
    /// says what runs here; its default warmup (1000 steps, at least 2) carries over.
    #[test]
    fn schedulers_are_refused_where_deepspeeds_defaults_differ() -> Result<()> {
        let f = |scheduler: Value| settings(&json!({ "scheduler": scheduler }), 1).map(|s| flags(&s));
        let err = |scheduler: Value| f(scheduler).unwrap_err().to_string();
        assert!(err(json!({"type": "WarmupLR"})).contains("warmup_type absent (DeepSpeed's default: log)"));
        let log = json!({"type": "WarmupDecayLR", "params": {"warmup_type": "log"}});
        assert!(err(log).contains("add \"warmup_type\": \"linear\""));
        let linear = |kind: &str, params: Value| {
            let mut params = params;
            params["warmup_type"] = json!("linear");
            json!({"type": kind, "params": params})
        };
        assert_eq!(
            f(linear("WarmupLR", json!({})))?,
            ["--lr-scheduler-type=constant_with_warmup", "--num-warmup-steps=1000"]
        );
        assert_eq!(
            f(linear("WarmupDecayLR", json!({"warmup_num_steps": 0, "warmup_max_lr": 0.5})))?,
            ["--lr-scheduler-type=linear", "--num-warmup-steps=2", "--learning-rate=0.5"]
        );
        assert!(err(linear("WarmupCosineLR", json!({}))).contains("cos_min_ratio absent (DeepSpeed's default: 0.0001)"));
        assert!(err(linear("WarmupCosineLR", json!({"cos_min_ratio": 0.1}))).contains("decays to 0 here: use 0"));
        let ratio = linear("WarmupCosineLR", json!({"cos_min_ratio": 0, "warmup_min_ratio": 0.2}));
        assert!(err(ratio).contains("warmup_min_ratio 0.2: the warmup starts at 0 here"));
        assert!(err(linear("WarmupLR", json!({"warmup_min_lr": 1e-6}))).contains("warmup starts at 0"));
        assert_eq!(
            f(linear("WarmupCosineLR", json!({"cos_min_ratio": 0, "warmup_min_ratio": 0, "warmup_num_steps": 5})))?,
            ["--lr-scheduler-type=cosine", "--num-warmup-steps=5"]
        );
        assert!(err(json!({"type": "WarmupLR", "params": [1]})).contains("scheduler.params [1] is not an object"));
        Ok(())
    }

    /// DeepSpeed reads `allgather_bucket_size` at stages 1 and 2 only: at stages 0 and 3 it is
    /// listed as ignored rather than becoming a flag the command would refuse.
    #[test]
    fn the_gather_bucket_is_read_at_stages_1_and_2_only() -> Result<()> {
        for (stage, kept) in [(0, false), (1, true), (2, true), (3, false)] {
            let s = settings(&json!({"zero_optimization": {"stage": stage, "allgather_bucket_size": 1000}}), 1)?;
            assert_eq!(flags(&s).contains(&"--allgather-bucket-size=1000".to_string()), kept, "stage {stage}");
            assert_eq!(s.ignored.contains(&"zero_optimization.allgather_bucket_size".to_string()), !kept);
        }
        Ok(())
    }

    /// A command without a setting's flag lists its key as ignored; one without Adam's betas
    /// refuses a pair other than DS-Chat's; the command's own alias of a flag counts as it.
    #[test]
    fn settings_take_the_commands_spellings() -> Result<()> {
        use clap::Arg;
        let cmd = clap::Command::new("sft")
            .arg(Arg::new("lr").long("lr").alias("learning-rate"))
            .arg(Arg::new("clip").long("clip-grad").alias("gradient-clipping"));
        let s = |c: Value| for_command(&cmd, settings(&c, 1)?);
        let got = s(json!({"gradient_clipping": 0.5, "steps_per_print": 3,
                           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.95]}}}))?;
        assert_eq!(flags(&got), ["--clip-grad=0.5", "--lr=0.1"]);
        assert_eq!(got.ignored, ["steps_per_print"]);
        let err = s(json!({"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95]}}})).unwrap_err();
        assert!(err.to_string().contains("sft trains with DS-Chat's betas"), "{err}");
        assert_eq!(spellings(&cmd, "--lr"), ["--lr", "--lr", "--learning-rate", "--learning_rate"]);
        Ok(())
    }

    #[test]
    fn the_command_lines_flags_are_found_in_every_spelling() {
        let args: Vec<String> =
            ["sft", "--zero_stage", "3", "--learning-rate=0.5", "--offload"].iter().map(|s| s.to_string()).collect();
        assert_eq!(flag_value(&args, &["--zero_stage"]).as_deref(), Some("3"));
        assert_eq!(flag_value(&args, &["--learning-rate"]).as_deref(), Some("0.5"));
        assert_eq!(flag_value(&args, &["--offload"]).as_deref(), Some(""));
        assert_eq!(flag_value(&args, &["--dtype"]), None);
        assert!(same("1e-3", &Some("0.001".into())) && !same("2", &Some("3".into())));
    }
}
