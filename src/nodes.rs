//! multi_node: one step's ranks on the hosts of a DeepSpeed hostfile (DeepSpeed's `runner.py`
//! with its pdsh and slurm runners). `train` resolves the hosts (src/hostfile.rs) and passes the
//! plan to the step's recipe in [`NODES_ENV`]; the step binary, started by the recipe without
//! `RANK`, then launches the job from here:
//!
//! - `ssh`: per host one `ssh -o BatchMode=yes HOST COMMAND`, where COMMAND runs the same step
//!   binary with the same arguments, at the same path and in the same directory (DeepSpeed's
//!   same-filesystem assumption), as that host's node launcher (src/ranks.rs) with its ranks'
//!   global numbers, the world size and rank 0's address. ssh joins its words into one line
//!   that the remote shell parses, so every word is quoted for a POSIX shell ([`shell_quote`]):
//!   nothing in a path or an argument is ever executed. Node 0's output goes to the terminal,
//!   each node's to `<dir>/node-<host>.log` here; the first node to fail stops the others and is
//!   reported with its last lines.
//! - `srun` (inside a SLURM allocation): one `srun` over the hosts; SLURM starts every rank
//!   (the ranks read its variables, hybrid-engine's comm/env.rs) and stops them all when one
//!   fails (`--kill-on-bad-exit`); `--label` tells the ranks' lines apart, which go to
//!   `<dir>/rank-<r>.log`, rank 0's also to the terminal.

use crate::hostfile::Node;
use crate::ranks::{self, Ended, Watched};
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// The job's plan, JSON, set by `train --deployment-type multi_node` for the step's recipe.
pub const NODES_ENV: &str = "RLHF_NODES";

/// How the ranks on the other hosts are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    /// One ssh session per host (DeepSpeed's pdsh runner, without pdsh).
    Ssh,
    /// One srun over the hosts, inside a SLURM allocation (DeepSpeed's slurm runner).
    Srun,
}

/// A multi_node job: its hosts with their slots, rank 0's address and how to start it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodesPlan {
    pub nodes: Vec<Node>,
    pub launcher: Launcher,
    /// Rank 0's address; `None`: the first host (ssh), SLURM's first host of the step (srun).
    pub master_addr: Option<String>,
    pub master_port: u16,
    /// Where `train` linked the step binaries (`<output>/.bin`), the same path on every host.
    pub bin_dir: PathBuf,
}

impl NodesPlan {
    pub fn world(&self) -> usize {
        crate::hostfile::world_size(&self.nodes)
    }

    pub fn to_env(&self) -> Result<String> {
        serde_json::to_string(self).context("the multi_node plan cannot be written (a path that is not UTF-8?)")
    }

    /// The plan this process should launch: `None` for a rank (`RANK` set), a node of the job
    /// ([`ranks::WORLD_SIZE_ENV`] set) or a step run without multi_node.
    pub fn from_env() -> Result<Option<Self>> {
        if std::env::var_os("RANK").is_some() || std::env::var_os(ranks::WORLD_SIZE_ENV).is_some() {
            return Ok(None);
        }
        let Some(text) = std::env::var_os(NODES_ENV) else { return Ok(None) };
        let text = text.to_str().ok_or_else(|| anyhow!("{NODES_ENV} is not UTF-8"))?;
        let plan: Self = serde_json::from_str(text)
            .with_context(|| format!("{NODES_ENV} is not a multi_node plan written by train"))?;
        if plan.nodes.is_empty() || plan.nodes.iter().any(|n| n.slots.is_empty()) {
            bail!("{NODES_ENV} lists no host, or a host without a slot: train writes none such");
        }
        Ok(Some(plan))
    }

    /// Rank 0's address for ssh: the one given, else the first host.
    fn ssh_master(&self) -> &str {
        self.master_addr.as_deref().unwrap_or(&self.nodes[0].host)
    }
}

/// Runs this step as the plan's job; returns the exit code to end with.
pub fn launch(plan: &NodesPlan) -> Result<i32> {
    let mut argv = std::env::args_os();
    let arg0 = argv.next().unwrap_or_default();
    let name = Path::new(&arg0).file_name().ok_or_else(|| anyhow!("cannot tell which step this is from {arg0:?}"))?;
    let exe = plan.bin_dir.join(name);
    let args: Vec<OsString> = argv.collect();
    let log_dir = std::env::var_os(ranks::RANK_LOG_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("cannot create {}", log_dir.display()))?;
    let log_dir = std::fs::canonicalize(&log_dir)?;
    match plan.launcher {
        Launcher::Ssh => {
            let cwd = std::env::current_dir().context("cannot read the current directory")?;
            let forwarded = forwarded_env(std::env::vars_os());
            launch_over_ssh(plan, &exe, &args, &cwd, &log_dir, &forwarded)
        }
        Launcher::Srun => launch_with_srun(plan, &exe, &args, &log_dir),
    }
}

/// Variables every node gets from this host, by prefix: the steps' own (`RLHF_DEVICE`,
/// `RLHF_DTYPE`, the live logs), the Hugging Face cache and offline switches, NCCL's, candle's,
/// Rust's and wandb's. A name holding `TOKEN` or `KEY` stays here: on the command line it would
/// show in the remote host's process list; the nodes read their own token file (and `wandb
/// login`'s ~/.netrc).
const FORWARDED_PREFIXES: [&str; 7] = ["RLHF_", "HF_", "NCCL_", "CANDLE_", "RAYON_", "RUST_", "WANDB_"];

/// The variables of `env` a node gets, sorted by name, without those that say what this
/// process is (the plan, the per-node ones set by [`node_command`]).
fn forwarded_env(env: impl Iterator<Item = (OsString, OsString)>) -> Vec<(String, OsString)> {
    let own = [
        NODES_ENV,
        ranks::NPROC_ENV,
        ranks::FIRST_RANK_ENV,
        ranks::WORLD_SIZE_ENV,
        ranks::MASTER_ADDR_ENV,
        ranks::MASTER_PORT_ENV,
        ranks::RANK_LOG_DIR_ENV,
    ];
    let mut vars: Vec<(String, OsString)> = env
        .filter_map(|(k, v)| k.into_string().ok().map(|k| (k, v)))
        .filter(|(k, _)| FORWARDED_PREFIXES.iter().any(|p| k.starts_with(p)))
        // The name goes unquoted before `=`: only a shell variable name may.
        .filter(|(k, _)| k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .filter(|(k, _)| !k.contains("TOKEN") && !k.contains("KEY") && !own.contains(&k.as_str()))
        .collect();
    vars.sort();
    vars
}

/// `s` as one word for a POSIX shell: single-quoted, each `'` written as `'\''`. Inside
/// single quotes the shell expands nothing (`$`, backquotes, `\`, newlines are literal).
pub fn shell_quote(s: &OsStr) -> OsString {
    let mut out = b"'".to_vec();
    for &b in s.as_bytes() {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    OsString::from_vec(out)
}

/// The shell line that starts host `index`'s node launcher: into `cwd`, the node's variables
/// exported, then the step binary in place of the shell. `export` rather than `env`: env takes
/// any word holding `=` for an assignment, and a path may hold one.
fn node_command(
    plan: &NodesPlan,
    index: usize,
    cwd: &Path,
    exe: &Path,
    args: &[OsString],
    log_dir: &Path,
    forwarded: &[(String, OsString)],
) -> OsString {
    let node = &plan.nodes[index];
    let first_rank: usize = plan.nodes[..index].iter().map(|n| n.slots.len()).sum();
    let slots: Vec<String> = node.slots.iter().map(|s| s.to_string()).collect();
    let mut vars: Vec<(String, OsString)> = forwarded.to_vec();
    vars.extend(
        [
            (ranks::NPROC_ENV, node.slots.len().to_string()),
            (ranks::FIRST_RANK_ENV, first_rank.to_string()),
            (ranks::WORLD_SIZE_ENV, plan.world().to_string()),
            (ranks::MASTER_ADDR_ENV, plan.ssh_master().to_string()),
            (ranks::MASTER_PORT_ENV, plan.master_port.to_string()),
            // DeepSpeed's launch.py: a node's ranks see its slots as devices 0, 1, ...
            ("CUDA_VISIBLE_DEVICES", slots.join(",")),
        ]
        .map(|(k, v)| (k.to_string(), OsString::from(v))),
    );
    vars.push((ranks::RANK_LOG_DIR_ENV.to_string(), log_dir.as_os_str().to_owned()));
    let mut line = OsString::from("cd ");
    line.push(shell_quote(cwd.as_os_str()));
    line.push(" && export");
    for (k, v) in &vars {
        line.push(format!(" {k}="));
        line.push(shell_quote(v));
    }
    line.push(" && exec ");
    line.push(shell_quote(exe.as_os_str()));
    for a in args {
        line.push(" ");
        line.push(shell_quote(a));
    }
    line
}

/// ssh's words for host `index`: no password prompt (a job must not hang on one), the host,
/// the node's shell line as one word.
fn ssh_command(plan: &NodesPlan, index: usize, node_line: OsString) -> Vec<OsString> {
    let host = &plan.nodes[index].host;
    ["ssh", "-o", "BatchMode=yes", host.as_str()].into_iter().map(OsString::from).chain([node_line]).collect()
}

fn launch_over_ssh(
    plan: &NodesPlan,
    exe: &Path,
    args: &[OsString],
    cwd: &Path,
    log_dir: &Path,
    forwarded: &[(String, OsString)],
) -> Result<i32> {
    let mut nodes = Vec::new();
    for (index, node) in plan.nodes.iter().enumerate() {
        let words = ssh_command(plan, index, node_command(plan, index, cwd, exe, args, log_dir, forwarded));
        let mut cmd = Command::new(&words[0]);
        // Never written to: the node launcher stops its ranks when it closes (src/ranks.rs).
        cmd.args(&words[1..]).stdin(Stdio::piped());
        ranks::die_with_parent(&mut cmd);
        let log = log_dir.join(node_log_name(&node.host));
        let started = Watched::spawn(&mut cmd, &log, index == 0)
            .with_context(|| format!("cannot run ssh to start host {}'s ranks (is ssh installed?)", node.host))?;
        nodes.push(started);
    }
    let (index, status) = match ranks::wait_all(&mut nodes, None)? {
        Ended::Succeeded => return Ok(0),
        Ended::Failed { index, status } => (index, status),
        Ended::Abandoned => bail!("the ssh sessions were stopped"),
    };
    let (node, p) = (&plan.nodes[index], &nodes[index]);
    let first: usize = plan.nodes[..index].iter().map(|n| n.slots.len()).sum();
    let ranks_held = ranks::describe_ranks(first, node.slots.len());
    let reason =
        p.last_error.as_deref().map_or_else(|| status.to_string(), |l| l.trim_start_matches("error: ").to_string());
    if index != 0 {
        // Node 0's lines are on the terminal already; show the failed node's end too.
        let lines = last_lines_before_error(&p.log, 5);
        for line in lines {
            eprintln!("[{}] {line}", node.host);
        }
    }
    if status.code() == Some(255) {
        bail!(
            "cannot start host {}'s {ranks_held} over ssh ({reason}): check that `ssh -o BatchMode=yes {} true` \
             works without a password; the other hosts were stopped",
            node.host,
            node.host
        );
    }
    bail!("on host {} ({ranks_held}): {reason}; the other hosts were stopped", node.host)
}

/// A node's log name: `node-<host>.log`, with anything but letters, digits, `.`, `-` and `_`
/// in the host name as `_`.
pub fn node_log_name(host: &str) -> String {
    let safe: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect();
    format!("node-{safe}.log")
}

/// The last `n` lines of a log without its last line (the error line the message repeats).
fn last_lines_before_error(path: &Path, n: usize) -> Vec<String> {
    let mut lines = ranks::last_lines(path, n + 1);
    lines.pop();
    lines
}

/// srun's words: every host, the same ranks on each (srun starts `--ntasks-per-node` on
/// every node), the step binary and its arguments as separate words (srun runs no shell).
fn srun_command(plan: &NodesPlan, exe: &Path, args: &[OsString]) -> Result<Vec<OsString>> {
    check_srun_layout(&plan.nodes)?;
    let per_node = plan.nodes[0].slots.len();
    let hosts: Vec<&str> = plan.nodes.iter().map(|n| n.host.as_str()).collect();
    let mut words: Vec<OsString> = [
        "srun".to_string(),
        format!("--nodes={}", plan.nodes.len()),
        format!("--ntasks={}", plan.world()),
        format!("--ntasks-per-node={per_node}"),
        format!("--nodelist={}", hosts.join(",")),
        "--kill-on-bad-exit=1".into(),
        "--label".into(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    words.push(exe.as_os_str().to_owned());
    words.extend(args.iter().cloned());
    Ok(words)
}

/// srun starts `--ntasks-per-node` ranks on every host and SLURM picks their devices: the
/// hosts must have the same slots, 0..N.
pub fn check_srun_layout(nodes: &[Node]) -> Result<()> {
    let per_node = nodes.first().map_or(0, |n| n.slots.len());
    if nodes.iter().any(|n| n.slots != (0..per_node).collect::<Vec<_>>()) {
        bail!(
            "--launcher srun starts the same ranks on every host, on slots 0..N, and the hosts have {}: \
             give every host the same slots, or use --launcher ssh",
            crate::hostfile::describe(nodes)
        );
    }
    Ok(())
}

/// A line of `srun --label`'s output: the rank it came from and the rank's own text
/// (`" 3: text"` -> (3, "text")); `None` for srun's own lines.
fn srun_label(line: &str) -> Option<(usize, &str)> {
    let (rank, text) = line.trim_start().split_once(':')?;
    let rank = rank.parse().ok()?;
    Some((rank, text.strip_prefix(' ').unwrap_or(text)))
}

fn launch_with_srun(plan: &NodesPlan, exe: &Path, args: &[OsString], log_dir: &Path) -> Result<i32> {
    let words = srun_command(plan, exe, args)?;
    let mut cmd = Command::new(&words[0]);
    cmd.args(&words[1..]);
    // The ranks take their place from SLURM's variables: nothing may say otherwise.
    for k in [NODES_ENV, ranks::NPROC_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"] {
        cmd.env_remove(k);
    }
    if let Some(addr) = &plan.master_addr {
        cmd.env("MASTER_ADDR", addr);
    }
    cmd.env("MASTER_PORT", plan.master_port.to_string()).env(ranks::RANK_LOG_DIR_ENV, log_dir);
    let mut logs = Vec::new();
    for r in 0..plan.world() {
        let path = log_dir.join(format!("rank-{r}.log"));
        logs.push(std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?);
    }
    let logs = Mutex::new(logs);
    ranks::die_with_parent(&mut cmd);
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run srun (--launcher srun needs SLURM's srun on PATH, inside an allocation)")?;
    let out = child.stdout.take().expect("piped stdout");
    let err = child.stderr.take().expect("piped stderr");
    let srun_last = std::thread::scope(|s| {
        s.spawn(|| demux_srun(BufReader::new(out), &logs, false));
        s.spawn(|| demux_srun(BufReader::new(err), &logs, true)).join().ok().flatten()
    });
    let status = child.wait()?;
    if status.success() {
        return Ok(0);
    }
    bail!(
        "srun failed ({}); SLURM stopped every rank (rank logs: {}/rank-<r>.log)",
        srun_last.unwrap_or_else(|| status.to_string()),
        log_dir.display()
    )
}

/// Sends each labelled line to its rank's log (rank 0's also to the terminal) and srun's own
/// lines to stderr; returns srun's last own line (its error, when it failed).
fn demux_srun(reader: impl BufRead, logs: &Mutex<Vec<std::fs::File>>, is_stderr: bool) -> Option<String> {
    let mut last = None;
    for line in reader.lines().map_while(Result::ok) {
        match srun_label(&line) {
            Some((rank, text)) if rank < logs.lock().map_or(0, |l| l.len()) => {
                if rank == 0 {
                    if is_stderr {
                        eprintln!("{text}");
                    } else {
                        println!("{text}");
                    }
                }
                if let Ok(mut logs) = logs.lock() {
                    let _ = writeln!(logs[rank], "{text}");
                }
            }
            _ => {
                eprintln!("{line}");
                last = Some(line);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(nodes: &[(&str, &[usize])], launcher: Launcher) -> NodesPlan {
        NodesPlan {
            nodes: nodes.iter().map(|(h, s)| Node { host: h.to_string(), slots: s.to_vec() }).collect(),
            launcher,
            master_addr: None,
            master_port: 29500,
            bin_dir: "/out/.bin".into(),
        }
    }

    fn words(w: &[OsString]) -> Vec<String> {
        w.iter().map(|s| s.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn shell_quote_survives_a_posix_shell_byte_for_byte() {
        let nasty = [
            "",
            "plain",
            "with space",
            "it's",
            "''",
            "\"double\"",
            "$(touch /tmp/pwned)",
            "`touch /tmp/pwned`",
            "$HOME ${PATH}",
            "a\nb\n",
            "back\\slash\\",
            "semi; rm -rf x && y || z | w > f < g & h",
            "*?[a-z]~",
            "tab\there",
            "\u{e9}t\u{e9}",
        ];
        let mut script = OsString::from("printf '%s\\0'");
        for s in nasty {
            script.push(" ");
            script.push(shell_quote(OsStr::new(s)));
        }
        // A byte that is not UTF-8 too.
        script.push(" ");
        script.push(shell_quote(OsStr::from_bytes(b"\xff\xfe")));
        for shell in ["bash", "sh"] {
            let out = Command::new(shell).arg("-c").arg(&script).output().unwrap();
            assert!(out.status.success(), "{shell}");
            let mut want: Vec<u8> = nasty.iter().flat_map(|s| [s.as_bytes(), b"\0"].concat()).collect();
            want.extend_from_slice(b"\xff\xfe\0");
            assert_eq!(out.stdout, want, "{shell}");
        }
        assert_eq!(shell_quote(OsStr::new("it's")), "'it'\\''s'");
    }

    #[test]
    fn the_ssh_command_runs_the_step_as_the_hosts_node_with_every_word_quoted() {
        let p = plan(&[("worker-0", &[0, 1]), ("worker-1", &[1, 3])], Launcher::Ssh);
        let forwarded = vec![("RLHF_DEVICE".to_string(), OsString::from("cpu"))];
        let args = [OsString::from("--output-dir=out 'x' $(y)"), OsString::from("--zero-stage=2")];
        let line = node_command(
            &p,
            1,
            Path::new("/work dir"),
            Path::new("/out/.bin/sft"),
            &args,
            Path::new("/out/actor"),
            &forwarded,
        );
        assert_eq!(
            words(&ssh_command(&p, 1, line)),
            [
                "ssh",
                "-o",
                "BatchMode=yes",
                "worker-1",
                "cd '/work dir' && export RLHF_DEVICE='cpu' RLHF_NPROC_PER_NODE='2' RLHF_FIRST_RANK='2' \
                 RLHF_WORLD_SIZE='4' RLHF_MASTER_ADDR='worker-0' RLHF_MASTER_PORT='29500' CUDA_VISIBLE_DEVICES='1,3' \
                 RLHF_RANK_LOG_DIR='/out/actor' && exec '/out/.bin/sft' '--output-dir=out '\\''x'\\'' $(y)' '--zero-stage=2'"
            ]
        );
        // An explicit master address wins over the first host.
        let mut q = p.clone();
        q.master_addr = Some("10.0.0.1".into());
        let line = node_command(&q, 0, Path::new("/"), Path::new("/e"), &[], Path::new("/l"), &[]);
        assert!(line.to_string_lossy().contains("RLHF_FIRST_RANK='0' RLHF_WORLD_SIZE='4' RLHF_MASTER_ADDR='10.0.0.1'"));
    }

    #[test]
    fn nodes_get_the_steps_variables_but_no_secret_and_nothing_saying_what_this_process_is() {
        let env = [
            ("RLHF_DTYPE", "bf16"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_TOKEN", "secret"),
            ("HUGGING_FACE_HUB_TOKEN", "secret"),
            ("NCCL_DEBUG", "INFO"),
            ("RLHF_DEVICE", "cpu"),
            ("RLHF_$(touch x)", "1"),
            ("RLHF_NODES", "{}"),
            ("RLHF_NPROC_PER_NODE", "2"),
            ("RLHF_RANK_LOG_DIR", "x"),
            ("HOME", "/home/me"),
            ("PATH", "/bin"),
            ("WANDB_PROJECT", "p"),
            ("WANDB_API_KEY", "secret"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let got: Vec<String> = forwarded_env(env.into_iter()).into_iter().map(|(k, _)| k).collect();
        assert_eq!(got, ["HF_HUB_OFFLINE", "NCCL_DEBUG", "RLHF_DEVICE", "RLHF_DTYPE", "WANDB_PROJECT"]);
    }

    #[test]
    fn the_srun_command_asks_for_every_host_and_rank_and_runs_no_shell() -> Result<()> {
        let mut p = plan(&[("gpu1", &[0, 1]), ("gpu2", &[0, 1])], Launcher::Srun);
        let args = [OsString::from("--output-dir=a b $(c)")];
        assert_eq!(
            words(&srun_command(&p, Path::new("/out/.bin/sft"), &args)?),
            [
                "srun",
                "--nodes=2",
                "--ntasks=4",
                "--ntasks-per-node=2",
                "--nodelist=gpu1,gpu2",
                "--kill-on-bad-exit=1",
                "--label",
                "/out/.bin/sft",
                "--output-dir=a b $(c)"
            ]
        );
        p.nodes[1].slots = vec![0];
        let err = srun_command(&p, Path::new("/e"), &[]).unwrap_err().to_string();
        assert!(err.contains("gpu1: 2, gpu2: 1") && err.contains("--launcher ssh"), "{err}");
        p.nodes[1].slots = vec![1, 2];
        assert!(srun_command(&p, Path::new("/e"), &[]).is_err(), "slots other than 0..N");
        Ok(())
    }

    #[test]
    fn srun_labels_tell_the_ranks_lines_apart() {
        assert_eq!(srun_label("0: step 10 loss 2.5"), Some((0, "step 10 loss 2.5")));
        assert_eq!(srun_label(" 12: a: b"), Some((12, "a: b")));
        assert_eq!(srun_label("3: "), Some((3, "")));
        assert_eq!(srun_label("srun: error: gpu2: task 3: Exited with exit code 2"), None);
        assert_eq!(srun_label("no label"), None);
    }

    #[test]
    fn the_plan_travels_through_the_environment_unchanged_and_names_node_logs_safely() -> Result<()> {
        let mut p = plan(&[("a", &[0]), ("b", &[2, 0])], Launcher::Ssh);
        p.master_addr = Some("a".into());
        assert_eq!(serde_json::from_str::<NodesPlan>(&p.to_env()?)?, p);
        assert_eq!(p.world(), 3);
        assert_eq!(node_log_name("worker-0.cluster"), "node-worker-0.cluster.log");
        assert_eq!(node_log_name("me@h/../x"), "node-me_h_.._x.log");
        Ok(())
    }
}
