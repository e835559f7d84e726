//! `train --deployment-type multi_node` end to end on this machine: two "hosts" on loopback
//! (`localhost` and `127.0.0.1`, two names so two nodes), reached through stand-ins put first
//! on PATH. The ssh stand-in runs its command the way sshd does (the words joined, parsed by
//! `bash -c`, in a fresh environment) and records each host it is asked for; the srun stand-in
//! starts the tasks with SLURM's variables and labels their lines as `srun --label`. Every run
//! has a deadline, runs in its own process group (killed whole after it), and leaves no process
//! behind. Paths hold a space, a quote and shell code that must never run.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A scratch directory with the stand-ins, a hostfile, a fast step-1 recipe and a small dataset.
struct Rig {
    dir: tempfile::TempDir,
    /// Where the ssh stand-in records the hosts it was asked for, one a line.
    ssh_calls: PathBuf,
    /// Where the srun stand-in records its words, one a line.
    srun_words: PathBuf,
}

impl Rig {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let ssh_calls = root.join("ssh-calls");
        let srun_words = root.join("srun-words");
        // ssh: options dropped, the host recorded, then what sshd does: the user's shell runs
        // the remaining words joined by spaces, in the environment of a fresh login.
        let ssh = format!(
            r#"#!/usr/bin/env bash
while [[ $# -gt 0 ]]; do case "$1" in -o) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1; shift
printf '%s\n' "$host" >> '{}'
if [[ $host == unreachable ]]; then echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255; fi
exec env -i HOME="$HOME" PATH="$PATH" bash -c "$*"
"#,
            ssh_calls.display()
        );
        // srun: its words recorded; --ntasks copies of the command with SLURM's variables, each
        // line prefixed with the task's number; 1 when any task fails.
        let srun = format!(
            r#"#!/usr/bin/env bash
printf '%s\n' "$@" > '{}'
while [[ $1 == --* ]]; do
  case $1 in --ntasks=*) n=${{1#*=}} ;; --ntasks-per-node=*) per=${{1#*=}} ;; --nodelist=*) nodes=${{1#*=}} ;; esac
  shift
done
pids=()
for ((t = 0; t < n; t++)); do
  SLURM_PROCID=$t SLURM_NTASKS=$n SLURM_LOCALID=$((t % per)) SLURM_NTASKS_PER_NODE=$per SLURM_STEP_NODELIST=$nodes \
    "$@" > >(sed -u "s/^/$t: /") 2> >(sed -u "s/^/$t: /" >&2) &
  pids+=($!)
done
status=0
for p in "${{pids[@]}}"; do wait "$p" || status=1; done
exit $status
"#,
            srun_words.display()
        );
        for (name, text) in [("ssh", ssh), ("srun", srun)] {
            let path = bin.join(name);
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
        // 64 training rows of the demo data: the run takes seconds.
        let data = root.join("data");
        std::fs::create_dir_all(&data).unwrap();
        for (file, rows) in [("train.jsonl", 64), ("eval.jsonl", 16)] {
            let text =
                std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo").join(file)).unwrap();
            let head: Vec<&str> = text.lines().take(rows).collect();
            std::fs::write(data.join(file), head.join("\n") + "\n").unwrap();
        }
        let recipes = root.join("recipes/step1_sft");
        std::fs::create_dir_all(&recipes).unwrap();
        std::fs::write(
            recipes.join("multi_node.sh"),
            format!(
                "exec sft --model-name-or-path=\"$3\" --zero-stage=\"${{2:-0}}\" --output-dir=\"$1\" --data-path '{}' \
                 --data-split 10,0,0 --max-seq-len 32 --per-device-train-batch-size 4 --num-train-epochs 1 --dropout 0 \
                 --dist-timeout 60 --data-output-path \"$1.cache\"\n",
                data.display()
            ),
        )
        .unwrap();
        Self { dir, ssh_calls, srun_words }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn hostfile(&self, text: &str) -> PathBuf {
        let path = self.path("hostfile");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// `train --step 1 --deployment-type multi_node` with the stand-ins first on PATH, `args`
    /// after, `env` set; killed with everything it started after `limit`.
    fn train(&self, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
        let path = std::env::join_paths(
            std::iter::once(self.path("bin")).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
        )
        .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
        cmd.args(["--step", "1", "--deployment-type", "multi_node", "--actor-model", "tiny", "--device", "cpu"])
            .arg("--recipe-dir")
            .arg(self.path("recipes"))
            .args(args)
            .env("PATH", path)
            .env("HF_HUB_OFFLINE", "1")
            .env_remove("SLURM_JOB_ID")
            .env_remove("WORLD_SIZE")
            .env_remove("RANK")
            .envs(env.iter().copied())
            .current_dir(self.dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        finish(cmd.spawn().unwrap(), limit)
    }

    /// Processes still running from this rig's directory (node launchers and ranks run the step
    /// binaries linked there).
    fn leftovers(&self) -> Vec<String> {
        let me = self.dir.path().to_string_lossy().into_owned();
        let t0 = Instant::now();
        loop {
            let found: Vec<String> = std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .filter(|c| c.contains(&me))
                .collect();
            if found.is_empty() || t0.elapsed() > Duration::from_secs(10) {
                return found;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Waits for `child`, started in a process group of its own, then kills that group: after
/// `limit`, or at once once it ended, so that nothing it started outlives the test.
fn finish(child: Child, limit: Duration) -> Output {
    let group = child.id() as i32;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let watchdog = std::thread::spawn(move || {
        let t0 = Instant::now();
        while !flag.load(std::sync::atomic::Ordering::Relaxed) && t0.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: kill signals the process group this test started.
        unsafe { libc::kill(-group, libc::SIGKILL) };
    });
    let out = child.wait_with_output().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watchdog.join().unwrap();
    out
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// An output directory whose name a shell would choke on or run: a space, a quote, `$(...)`
/// and backquotes that would create `marker` if any shell ever executed them.
fn hostile_output(rig: &Rig, marker: &Path) -> PathBuf {
    rig.path(&format!("out 'q' $(touch {}) `touch {}`", marker.display(), marker.display()))
}

#[test]
fn two_hosts_over_ssh_train_step_1_as_one_job() {
    let rig = Rig::new();
    let hostfile = rig.hostfile("# two names for this machine: two nodes\nlocalhost slots=1\n127.0.0.1 slots=1\n");
    let marker = rig.path("pwned");
    let out = hostile_output(&rig, &marker);
    let port = rlhf::ranks::free_port().unwrap().to_string();
    let run = rig.train(
        &["--hostfile", hostfile.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--master-port", &port],
        &[],
        Duration::from_secs(180),
    );
    let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
    assert!(!marker.exists(), "shell code in a path was executed");
    assert!(run.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("multi_node: each step runs as 2 ranks on 2 hosts"), "{stdout}");
    // Rank 0's lines on the terminal: it joined a job of two ranks and saved the model.
    assert!(stdout.contains("data parallel: 2 ranks") && stdout.contains("saved the fine-tuned model"), "{stdout}");
    // One ssh per host, with the hostfile's names.
    let mut calls: Vec<String> = std::fs::read_to_string(&rig.ssh_calls).unwrap().lines().map(String::from).collect();
    calls.sort();
    assert_eq!(calls, ["127.0.0.1", "localhost"]);
    // Each host started its own rank: rank 1's output is what the second host's session said.
    let actor = out.join("actor");
    for r in 0..2 {
        let log = std::fs::read_to_string(actor.join(format!("rank-{r}.log"))).unwrap();
        assert!(log.contains("data parallel: 2 ranks"), "rank {r}: {log}");
    }
    let sorted_lines = |name: &str| {
        let text = std::fs::read_to_string(actor.join(name)).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        lines.sort();
        lines
    };
    assert_eq!(sorted_lines("node-127.0.0.1.log"), sorted_lines("rank-1.log"));
    assert!(actor.join("node-localhost.log").is_file());
    assert!(actor.join("model.safetensors").is_file() && actor.join("config.json").is_file());
    assert_eq!(rig.leftovers(), Vec::<String>::new());
}

#[test]
fn an_unreachable_host_stops_the_job_with_one_line_naming_it() {
    let rig = Rig::new();
    let hostfile = rig.hostfile("localhost slots=1\nunreachable slots=1\n");
    let port = rlhf::ranks::free_port().unwrap().to_string();
    let out = rig.path("out");
    let t0 = Instant::now();
    let run = rig.train(
        &["--hostfile", hostfile.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--master-port", &port],
        &[],
        Duration::from_secs(60),
    );
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: step 1 failed: cannot start host unreachable's rank 1 over ssh")
            && last.contains("Connection refused")
            && last.contains("ssh -o BatchMode=yes unreachable true"),
        "{stderr}"
    );
    // localhost's rank, waiting for its partner, was stopped at once, not at the rendezvous timeout.
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
    assert_eq!(rig.leftovers(), Vec::<String>::new());
}

/// sshd sends no signal to a command run without a terminal when the client goes: a node sees
/// its stdin end, and must stop its ranks then rather than leave them waiting for the job.
#[test]
fn a_node_stops_its_ranks_when_its_ssh_session_closes() {
    let rig = Rig::new();
    let sft = rig.path("bin/sft");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_train"), &sft).unwrap();
    let logs = rig.path("logs");
    // Rank 0 of 2 on this node; rank 1 never comes, so rank 0 would wait 120 s for it.
    let port = rlhf::ranks::free_port().unwrap().to_string();
    let mut node = Command::new(&sft)
        .args(["--data-path", rig.path("data").to_str().unwrap(), "--max-seq-len", "32", "--device", "cpu"])
        .args(["--dist-timeout", "120", "--output-dir", rig.path("out").to_str().unwrap()])
        .envs([
            (rlhf::ranks::NPROC_ENV, "1"),
            (rlhf::ranks::FIRST_RANK_ENV, "0"),
            (rlhf::ranks::WORLD_SIZE_ENV, "2"),
            (rlhf::ranks::MASTER_ADDR_ENV, "127.0.0.1"),
            (rlhf::ranks::MASTER_PORT_ENV, &port),
            (rlhf::ranks::RANK_LOG_DIR_ENV, logs.to_str().unwrap()),
            ("HF_HUB_OFFLINE", "1"),
        ])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !logs.join("rank-0.log").exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let closed = Instant::now();
    drop(node.stdin.take());
    let out = finish(node, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("the launching host closed this node's session") && stderr.contains("stopped rank 0"),
        "{stderr}"
    );
    assert!(closed.elapsed() < Duration::from_secs(15), "stopped after {:?}", closed.elapsed());
    assert_eq!(rig.leftovers(), Vec::<String>::new());
}

#[test]
fn inside_slurm_one_srun_starts_every_rank() {
    let rig = Rig::new();
    let hostfile = rig.hostfile("localhost slots=1\n127.0.0.1 slots=1\n");
    let marker = rig.path("pwned");
    let out = hostile_output(&rig, &marker);
    let port = rlhf::ranks::free_port().unwrap().to_string();
    // No --launcher: SLURM_JOB_ID picks srun.
    let run = rig.train(
        &["--hostfile", hostfile.to_str().unwrap(), "--output-dir", out.to_str().unwrap(), "--master-port", &port],
        &[("SLURM_JOB_ID", "42")],
        Duration::from_secs(180),
    );
    let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
    assert!(!marker.exists(), "shell code in a path was executed");
    assert!(run.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("over srun") && stdout.contains("data parallel: 2 ranks"), "{stdout}");
    // The step binary and its arguments are srun's words as they are: no shell in between.
    let words: Vec<String> = std::fs::read_to_string(&rig.srun_words).unwrap().lines().map(String::from).collect();
    let actor = out.join("actor");
    let exe = std::fs::canonicalize(out.join(".bin")).unwrap().join("sft").display().to_string();
    assert_eq!(
        words[..7],
        [
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            "--nodelist=localhost,127.0.0.1",
            "--kill-on-bad-exit=1",
            "--label",
            exe.as_str()
        ]
    );
    assert!(words.contains(&format!("--output-dir={}", actor.display())), "{words:?}");
    for r in 0..2 {
        let log = std::fs::read_to_string(actor.join(format!("rank-{r}.log"))).unwrap();
        assert!(log.contains("data parallel: 2 ranks") && !log.starts_with(&format!("{r}: ")), "rank {r}: {log}");
    }
    assert!(actor.join("model.safetensors").is_file());
    assert_eq!(rig.leftovers(), Vec::<String>::new());
}

#[test]
fn bad_multi_node_requests_are_one_clear_line() {
    let rig = Rig::new();
    let hostfile = rig.hostfile("localhost slots=1\n127.0.0.1 slots=1\n");
    let hf = hostfile.to_str().unwrap();
    let out = rig.path("out");
    let check = |args: &[&str], env: &[(&str, &str)], want: &[&str]| {
        let mut all = vec!["--output-dir", out.to_str().unwrap()];
        all.extend_from_slice(args);
        let run = rig.train(&all, env, Duration::from_secs(30));
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line, got:\n{stderr}");
        for w in want {
            assert!(stderr.contains(w), "{args:?}: want {w:?} in {stderr}");
        }
    };
    check(
        &["--hostfile", hf],
        &[("WORLD_SIZE", "3")],
        &["WORLD_SIZE=\"3\"", "the 2 ranks of the hostfile", "unset WORLD_SIZE"],
    );
    check(&["--hostfile", hf], &[("RANK", "0")], &["RANK=\"0\"", "unset RANK"]);
    check(
        &["--hostfile", hf, "--include", "gpu7"],
        &[],
        &["host \"gpu7\" is not in the hostfile (its hosts: localhost, 127.0.0.1)"],
    );
    check(&["--hostfile", hf, "--include", "localhost", "--exclude", "127.0.0.1"], &[], &["cannot be used together"]);
    check(&["--hostfile", hf, "--include", "localhost", "--num-gpus", "1"], &[], &["--num-gpus cannot be combined"]);
    check(&["--hostfile", rig.path("none").to_str().unwrap()], &[], &["cannot read the hostfile", "--hostfile FILE"]);
    let bad = rig.path("bad-hosts");
    std::fs::write(&bad, "localhost slots=1\nlocalhost slots=2\n").unwrap();
    check(&["--hostfile", bad.to_str().unwrap()], &[], &["line 2", "listed twice"]);
    let uneven = rig.path("uneven");
    std::fs::write(&uneven, "localhost slots=2\n127.0.0.1 slots=1\n").unwrap();
    check(
        &["--hostfile", uneven.to_str().unwrap(), "--launcher", "srun"],
        &[],
        &["localhost: 2, 127.0.0.1: 1", "--launcher ssh"],
    );
    assert!(!out.join("actor").exists(), "a refused run creates no step output");
    assert!(!rig.ssh_calls.exists(), "a refused run reaches no host");
}
