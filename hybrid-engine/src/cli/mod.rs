//! Command-line conventions shared by every binary: a usage mistake is one `error:` line and
//! exit code 2 (clap's multi-line usage block is left to `--help`); a repeated flag overrides
//! the earlier one, so scripts can append to a base command. Float flags are checked while
//! parsing ([`float_in`]), so a NaN, an infinity or an out-of-range value is a usage error that
//! names the flag and its range.

pub mod deepspeed_config;

use clap::Parser;
use std::ops::Bound::{self, Excluded, Included, Unbounded};

/// Parses the process arguments, or prints one error line (or the help) and exits.
pub fn parse_or_exit<T: Parser>() -> T {
    parse_from_or_exit(std::env::args_os())
}

/// [`parse_or_exit`] of `args` (the first is the program's name, as in the process arguments).
pub fn parse_from_or_exit<T: Parser, I: Into<std::ffi::OsString> + Clone>(args: impl IntoIterator<Item = I>) -> T {
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    // One parse: the flags, and from the same matches the run's configuration for wandb.
    let command = T::command();
    let parsed = command.clone().try_get_matches_from(&args).and_then(|mut matches| {
        let config = flags_config(&command, &matches, &args);
        let parsed = T::from_arg_matches_mut(&mut matches).map_err(|e| e.format(&mut command.clone()))?;
        Ok((parsed, config))
    });
    match parsed {
        Ok((parsed, config)) => {
            telemetry::wandb::set_flags_config(config);
            parsed
        }
        Err(e) => {
            use clap::error::ErrorKind::{
                DisplayHelp, DisplayHelpOnMissingArgumentOrSubcommand, DisplayVersion, UnknownArgument,
            };
            if matches!(e.kind(), DisplayHelp | DisplayVersion | DisplayHelpOnMissingArgumentOrSubcommand) {
                e.exit();
            }
            let unknown = if e.kind() == UnknownArgument { unknown_flags(&T::command(), &args) } else { None };
            match unknown {
                Some(line) => eprintln!("error: {line} (see --help)"),
                None => eprintln!("{} (see --help)", one_line(&e.to_string())),
            }
            std::process::exit(2);
        }
    }
}

/// Every argument of `cmd` as `matches` (the parse of the command line `args`) set it, given or
/// by default, as wandb's run config: the argument's name, its value (a number or true/false as
/// such, several values as a list, null when unset) and its help as the description; the whole
/// command line as `command`.
pub fn flags_config(
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    args: &[std::ffi::OsString],
) -> serde_json::Map<String, serde_json::Value> {
    use telemetry::wandb::{config_entry, config_value};
    let mut config = serde_json::Map::new();
    let line: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    config.insert("command".into(), config_entry(line.join(" ").into(), None));
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "version") {
            continue;
        }
        let values: Vec<serde_json::Value> = match matches.try_get_raw(id) {
            Ok(Some(raw)) => raw.map(|v| config_value(&v.to_string_lossy())).collect(),
            _ => Vec::new(),
        };
        let many = matches!(arg.get_action(), clap::ArgAction::Append)
            || arg.get_num_args().is_some_and(|range| range.max_values() > 1);
        let value = match <[_; 1]>::try_from(values) {
            Ok([one]) if !many => one,
            Ok([one]) => serde_json::Value::Array(vec![one]),
            Err(values) if values.is_empty() && !many => serde_json::Value::Null,
            Err(values) => serde_json::Value::Array(values),
        };
        config.insert(id.to_string(), config_entry(value, arg.get_help().map(|h| h.to_string())));
    }
    config
}

/// DeepSpeed's and DS-Chat's flags that no binary here accepts, and why (spelt with hyphens).
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "unpin-actor-parameters",
        "a ZeRO-3 actor is gathered once per rollout and freed before training, with no pinned mode to turn off: drop it",
    ),
    (
        "tp-gather-partition-size",
        "--inference-tp-size re-lays the actor out in one pass, not in partitions of layers: drop it",
    ),
    (
        "enable-mixed-precision-lora",
        "ZeRO++'s quantized LoRA base is not implemented (LoRA trains on the --dtype compute copy): drop it",
    ),
];

/// Every `--flag` of `args` (after the program's name) that `cmd` does not know, in one line,
/// each with the nearest known spelling when one is close: a script brought from DS-Chat learns
/// all its unknown flags in one run. `None` when there is none to list (clap's own message then
/// stands).
fn unknown_flags(cmd: &clap::Command, args: &[std::ffi::OsString]) -> Option<String> {
    let mut known: Vec<String> = vec!["help".into(), "version".into()];
    for arg in cmd.get_arguments() {
        known.extend(arg.get_long().map(str::to_string));
        known.extend(arg.get_all_aliases().unwrap_or_default().into_iter().map(str::to_string));
    }
    let mut unknown = Vec::new();
    for arg in args.iter().skip(1).filter_map(|a| a.to_str()) {
        if arg == "--" {
            break;
        }
        let Some(name) = arg.strip_prefix("--").map(|a| a.split_once('=').map_or(a, |(n, _)| n)) else { continue };
        if name.is_empty() || known.iter().any(|k| k == name) || unknown.iter().any(|(u, _)| u == name) {
            continue;
        }
        let normal = |s: &str| s.replace('_', "-").to_ascii_lowercase();
        let nearest = known
            .iter()
            .map(|k| (edit_distance(&normal(name), &normal(k)), k))
            .filter(|(d, k)| *d <= (k.len() / 4).max(2))
            .min();
        unknown.push((name.to_string(), nearest.map(|(_, k)| k.clone())));
    }
    if unknown.is_empty() {
        return None;
    }
    let why = |name: &str| UNSUPPORTED.iter().find(|(n, _)| *n == name.replace('_', "-")).map(|(_, why)| *why);
    let list: Vec<String> = unknown
        .iter()
        .map(|(name, near)| match (why(name), near) {
            (Some(why), _) => format!("--{name} ({why})"),
            (None, Some(k)) => format!("--{name} (did you mean --{k}?)"),
            (None, None) => format!("--{name}"),
        })
        .collect();
    let s = if list.len() == 1 { "" } else { "s" };
    let unsupported = unknown.iter().filter(|(name, _)| why(name).is_some()).count();
    let kind = match unsupported {
        0 => "unknown",
        n if n == unknown.len() => "unsupported",
        _ => "unknown or unsupported",
    };
    Some(format!("{kind} flag{s} {}", list.join(", ")))
}

/// Levenshtein's distance between two words.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substituted = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substituted.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// clap's error as one line: its first line, and when that ends in a colon, the list clap puts
/// on the following indented lines (missing flags) joined onto it, with clap's usage line, which
/// shows the flag that needs them (`ppo --do-sample --top-k <TOP_K>`).
fn one_line(rendered: &str) -> String {
    let mut lines = rendered.lines();
    let first = lines.next().unwrap_or("error: invalid arguments").trim_end();
    if !first.ends_with(':') {
        return first.to_string();
    }
    let items: Vec<&str> = lines.by_ref().take_while(|l| l.starts_with("  ")).map(str::trim).collect();
    let usage = lines.find_map(|l| l.strip_prefix("Usage: ")).map_or(String::new(), |u| format!(" (usage: {u})"));
    format!("{first} {}{usage}", items.join(", "))
}

/// Prints an error chain as one line and exits with code 2.
pub fn exit_with(err: anyhow::Error) -> ! {
    // One line whatever the error quotes from its input: control characters become spaces.
    let text: String = format!("{err:#}").chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    eprintln!("error: {text}");
    std::process::exit(2);
}

/// A clap value parser for a float flag: a finite number within `(low, high)`, each bound
/// inclusive, exclusive or absent. NaN and the infinities are refused even where a bound is
/// absent; clap's error names the flag and the message the range, e.g. `error: invalid value
/// 'nan' for '--top-p <TOP_P>': expected a number in (0, 1]`.
pub fn float_in(low: Bound<f64>, high: Bound<f64>) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    move |text| {
        let range = describe_range(low, high);
        let value: f64 = text.trim().parse().map_err(|_| format!("expected a number in {range}"))?;
        let above_low = match low {
            Included(l) => value >= l,
            Excluded(l) => value > l,
            Unbounded => true,
        };
        let below_high = match high {
            Included(h) => value <= h,
            Excluded(h) => value < h,
            Unbounded => true,
        };
        if value.is_finite() && above_low && below_high {
            Ok(value)
        } else {
            Err(format!("expected a number in {range}"))
        }
    }
}

/// A probability, or any other fraction: [0, 1].
pub fn unit_interval() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Included(0.0), Included(1.0))
}

/// A dropout probability: [0, 1) (dropping everything leaves nothing to train).
pub fn dropout() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Included(0.0), Excluded(1.0))
}

/// Nucleus sampling's top-p: (0, 1] (1 keeps every token).
pub fn top_p() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Excluded(0.0), Included(1.0))
}

/// Adam's beta1 and beta2: [0, 1).
pub fn adam_beta() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Included(0.0), Excluded(1.0))
}

/// A strictly positive finite number (learning rates, clip ranges, temperatures).
pub fn positive() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Excluded(0.0), Unbounded)
}

/// A finite number >= 0 (weight decay, coefficients where 0 switches a term off).
pub fn non_negative() -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    float_in(Included(0.0), Unbounded)
}

/// `[0, 1)`, `(0, inf)` and so on: the interval as the error message shows it.
fn describe_range(low: Bound<f64>, high: Bound<f64>) -> String {
    let low = match low {
        Included(l) => format!("[{l}"),
        Excluded(l) => format!("({l}"),
        Unbounded => "(-inf".to_string(),
    };
    let high = match high {
        Included(h) => format!("{h}]"),
        Excluded(h) => format!("{h})"),
        Unbounded => "inf)".to_string(),
    };
    format!("{low}, {high} (finite)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clap_error_is_its_first_line_with_any_list_it_announces() {
        let missing = "error: the following required arguments were not provided:\n  --do-sample\n  --x <X>\n\nUsage: ppo --do-sample --top-k <TOP_K>\n\nFor more information, try '--help'.\n";
        assert_eq!(
            one_line(missing),
            "error: the following required arguments were not provided: --do-sample, --x <X> (usage: ppo --do-sample --top-k <TOP_K>)"
        );
        let plain = "error: unexpected argument '--nope' found\n\nUsage: ppo [OPTIONS]\n";
        assert_eq!(one_line(plain), "error: unexpected argument '--nope' found");
    }

    #[test]
    fn float_in_accepts_the_interval_and_refuses_nan_infinities_and_the_outside() {
        let top_p = float_in(Excluded(0.0), Included(1.0));
        assert_eq!(top_p("1"), Ok(1.0));
        assert_eq!(top_p("0.5"), Ok(0.5));
        for bad in ["0", "1.01", "-0.5", "nan", "NaN", "inf", "-inf", "infinity", "", "x"] {
            assert_eq!(top_p(bad), Err("expected a number in (0, 1] (finite)".to_string()), "{bad:?}");
        }
        let any = float_in(Unbounded, Unbounded);
        assert_eq!(any("-1e300"), Ok(-1e300));
        assert!(any("inf").is_err() && any("nan").is_err() && any("1e400").is_err(), "1e400 parses as inf");
        assert_eq!(dropout()("0"), Ok(0.0));
        assert!(dropout()("1").is_err());
        assert_eq!(unit_interval()("1"), Ok(1.0));
        assert!(positive()("0").is_err() && positive()("1e-9").is_ok());
        assert!(non_negative()("0").is_ok() && non_negative()("-1e-9").is_err());
    }

    #[test]
    fn the_config_is_every_flag_as_parsed_with_its_default() {
        #[derive(clap::Parser)]
        struct Flags {
            /// Discount factor.
            #[arg(long, default_value_t = 1.0)]
            gamma: f64,
            #[arg(long)]
            do_sample: bool,
            #[arg(long, num_args = 1..)]
            data_path: Vec<String>,
            #[arg(long)]
            seed: Option<u64>,
            #[arg(long, default_value = "fp32")]
            dtype: String,
        }
        let args: Vec<std::ffi::OsString> =
            ["ppo", "--data-path", "a", "b", "--dtype", "bf16"].iter().map(Into::into).collect();
        let config_of = |args: &[std::ffi::OsString]| {
            let command = <Flags as clap::CommandFactory>::command();
            flags_config(&command, &command.clone().try_get_matches_from(args).unwrap(), args)
        };
        let config = config_of(&args);
        let value = |k: &str| config[k]["value"].clone();
        assert_eq!(value("command"), "ppo --data-path a b --dtype bf16");
        assert_eq!(value("gamma"), 1.0, "a default");
        assert_eq!(config["gamma"]["desc"], "Discount factor"); // clap drops the doc comment's full stop
        assert_eq!(value("do_sample"), false);
        assert_eq!(value("data_path"), serde_json::json!(["a", "b"]), "every value of a multi-value flag");
        assert_eq!(value("seed"), serde_json::Value::Null);
        assert_eq!(value("dtype"), "bf16");
        assert!(!config.contains_key("help"));
        let one: Vec<std::ffi::OsString> = ["ppo", "--data-path", "a"].iter().map(Into::into).collect();
        let config = config_of(&one);
        assert_eq!(config["data_path"]["value"], serde_json::json!(["a"]), "a list, even of one");
    }
}
pub mod dist_args;
pub mod heading;
pub mod log_args;
pub mod precision_args;
pub mod step_args;
