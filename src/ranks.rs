//! Runs one node's ranks of a step (torchrun's `--nproc-per-node`) and supervises child
//! processes. The launcher sets [`NPROC_ENV`] for a `single_node` recipe; the step binary,
//! started by the recipe without `RANK`, then starts N copies of itself with torchrun's
//! variables and supervises them: rank 0's output goes to the terminal, every rank's to
//! `<dir>/rank-<r>.log`, and when one rank fails the others are stopped and the failure is
//! reported with that rank's last lines. A node of a `multi_node` job (src/nodes.rs) is the same
//! with [`FIRST_RANK_ENV`], [`WORLD_SIZE_ENV`] and rank 0's address also set: its ranks are
//! `first..first + N` of the job's world. A process that has `RANK` set is a rank, never a
//! launcher, so nothing spawns twice.

use anyhow::{anyhow, bail, Context, Result};
use hybrid_engine::telemetry::progress::{self, RelayedBar};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Ranks to start on this node (set by `train --deployment-type single_node`, and per node by
/// multi_node).
pub const NPROC_ENV: &str = "RLHF_NPROC_PER_NODE";
/// Where the rank logs go (the step's output directory).
pub const RANK_LOG_DIR_ENV: &str = "RLHF_RANK_LOG_DIR";
/// multi_node, per node: the global rank of this node's first rank.
pub const FIRST_RANK_ENV: &str = "RLHF_FIRST_RANK";
/// multi_node, per node: the ranks of the whole job.
pub const WORLD_SIZE_ENV: &str = "RLHF_WORLD_SIZE";
/// multi_node, per node: where rank 0 serves the rendezvous.
pub const MASTER_ADDR_ENV: &str = "RLHF_MASTER_ADDR";
pub const MASTER_PORT_ENV: &str = "RLHF_MASTER_PORT";

/// This node's share of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRanks {
    /// Ranks started on this node.
    pub local: usize,
    /// Global rank of this node's local rank 0.
    pub first_rank: usize,
    pub world: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// A node of a multi_node job: it was started over ssh and stops its ranks when its stdin
    /// closes, which is how it learns that the launching host stopped it or went away (sshd
    /// sends no signal to a command run without a terminal).
    pub remote: bool,
}

impl NodeRanks {
    /// single_node: `n` ranks on this machine, the whole job.
    pub fn single_node(n: usize, port: u16) -> Self {
        Self { local: n, first_rank: 0, world: n, master_addr: "127.0.0.1".into(), master_port: port, remote: false }
    }

    /// The ranks this process should start (see [`Self::from_lookup`]).
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// `None` when this process is a rank (`RANK` set), [`NPROC_ENV`] is unset, or the job is
    /// one rank; a multi_node node when [`WORLD_SIZE_ENV`] is set (its other variables then
    /// required), else single_node on a free port.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        if get("RANK").is_some() {
            return Ok(None);
        }
        let Some(local) = get(NPROC_ENV) else { return Ok(None) };
        let local = count(NPROC_ENV, &local, 1)?;
        let Some(world) = get(WORLD_SIZE_ENV) else {
            return (local > 1).then(|| free_port().map(|p| Self::single_node(local, p))).transpose();
        };
        let world = count(WORLD_SIZE_ENV, &world, 1)?;
        let need = |k: &str| {
            get(k).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
                anyhow!("{WORLD_SIZE_ENV} is set and {k} is not: a multi_node node needs both (train sets them)")
            })
        };
        let first_rank = count(FIRST_RANK_ENV, &need(FIRST_RANK_ENV)?, 0)?;
        let master_addr = need(MASTER_ADDR_ENV)?;
        let port = need(MASTER_PORT_ENV)?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| anyhow!("{MASTER_PORT_ENV}={port:?} is not a port number (1-65535)"))?;
        if first_rank + local > world {
            bail!("this node's ranks {first_rank}..{} do not fit a world of {world} ranks", first_rank + local);
        }
        let node = Self { local, first_rank, world, master_addr, master_port, remote: true };
        Ok((world > 1).then_some(node))
    }

    /// torchrun's environment for this node's local rank `local_rank`, and its share of the
    /// machine's cores as its thread count (unless the user chose one).
    pub fn rank_env(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("RANK", (self.first_rank + local_rank).to_string()),
            ("WORLD_SIZE", self.world.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.local.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ];
        if let Some(n) = hybrid_engine::runtime::threads_per_rank(self.local) {
            // Not "1": the rank keeps this count (runtime::init).
            env.extend([
                ("RAYON_NUM_THREADS", n.to_string()),
                (hybrid_engine::runtime::THREADS_DETECTED_ENV, "0".into()),
            ]);
        }
        env
    }
}

fn count(key: &str, value: &str, min: usize) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n >= min)
        .ok_or_else(|| anyhow!("{key}={value:?} is not a number of at least {min}"))
}

/// A free TCP port for the rendezvous, below the kernel's ephemeral range.
///
/// A port found by binding port 0 is an ephemeral one, and is released before rank 0 binds it
/// again: in between, any process's `bind(0)` or outgoing connection (the ranks' own peer
/// listeners among them) may be handed the same port, and rank 0 then fails with "address in
/// use". Below the ephemeral range the kernel hands out nothing on its own; a random candidate
/// there that binds now is taken only by someone choosing that very number.
pub fn free_port() -> Result<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Clear of the registered services below 10000 and of the launcher's default, 29500.
    free_port_in(10000..ephemeral_low.max(10001))
}

/// A random port of `candidates` (never the launcher's default) that binds now; an ephemeral
/// one if 64 tries find none (everything tried is taken, or the range is tiny).
fn free_port_in(candidates: std::ops::Range<u16>) -> Result<u16> {
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..64 {
        let port = rng.random_range(candidates.clone());
        if port != hybrid_engine::comm::env::DEFAULT_MASTER_PORT
            && std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
        {
            return Ok(port);
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The environment rank `rank` of a single_node job of `world` ranks gets.
pub fn rank_env(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
    NodeRanks::single_node(world, port).rank_env(rank)
}

/// Makes the child die with this process: no child outlives a killed launcher.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Starts this executable again as the node's ranks, with the same name and arguments, and
/// waits for them; returns the exit code to end with.
pub fn spawn_local_ranks(node: &NodeRanks) -> Result<i32> {
    let exe = std::env::current_exe().context("cannot find this executable to start the ranks")?;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_default();
    let args: Vec<_> = args.collect();
    let log_dir = std::env::var_os(RANK_LOG_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("cannot create {}", log_dir.display()))?;
    // The ranks read it too: rank 0's model save keeps the logs being written (durable.rs).
    let log_dir = std::fs::canonicalize(&log_dir)?;
    let closed = node.remote.then(stdin_closed_flag);
    let mut ranks = Vec::new();
    for local in 0..node.local {
        let rank = node.first_rank + local;
        let mut cmd = Command::new(&exe);
        cmd.arg0(&arg0).args(&args).envs(node.rank_env(local)).env(RANK_LOG_DIR_ENV, &log_dir);
        die_with_parent(&mut cmd);
        let log = log_dir.join(format!("rank-{rank}.log"));
        ranks.push(Watched::spawn(&mut cmd, &log, local == 0).with_context(|| format!("cannot start rank {rank}"))?);
    }
    match wait_all(&mut ranks, closed.as_deref())? {
        Ended::Succeeded => Ok(0),
        Ended::Abandoned => {
            let held = describe_ranks(node.first_rank, node.local);
            bail!("the launching host closed this node's session (stopped or gone): stopped {held}")
        }
        Ended::Failed { index, status } => {
            let (rank, p) = (node.first_rank + index, &ranks[index]);
            if index != 0 {
                // Local rank 0's lines are on this node's output already; show the failed rank's end too.
                for line in last_lines(&p.log, 5) {
                    eprintln!("[rank {rank}] {line}");
                }
            }
            bail!(
                "rank {rank} of {} failed ({status}); the others were stopped (its log: {})",
                node.world,
                p.log.display()
            )
        }
    }
}

/// `rank 3`, or `ranks 2-5` for `n` ranks from `first`.
pub fn describe_ranks(first: usize, n: usize) -> String {
    match n {
        1 => format!("rank {first}"),
        _ => format!("ranks {first}-{}", first + n - 1),
    }
}

/// A flag set once this process's stdin reaches its end.
fn stdin_closed_flag() -> Arc<AtomicBool> {
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut sink = [0u8; 4096];
        loop {
            match stdin.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        flag.store(true, Ordering::Relaxed);
    });
    closed
}

/// A child process whose output threads copy into its log and, when echoed, to this process's
/// stdout and stderr.
pub struct Watched {
    pub child: Child,
    pub log: PathBuf,
    copiers: Vec<JoinHandle<Option<String>>>,
    /// The last line the child wrote on stderr (its error line, when it failed), once it ended.
    pub last_error: Option<String>,
}

impl Watched {
    /// Starts `cmd` with its stdout and stderr piped into `log` (created, or emptied).
    pub fn spawn(cmd: &mut Command, log: &Path, echo: bool) -> Result<Self> {
        let file = std::fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let (to_out, to_err) = if echo { (Echo::Stdout, Echo::Stderr) } else { (Echo::None, Echo::None) };
        let copiers = vec![copy_lines(out, file.try_clone()?, to_out), copy_lines(err, file, to_err)];
        Ok(Self { child, log: log.to_path_buf(), copiers, last_error: None })
    }
}

/// How a group of children ended.
pub enum Ended {
    Succeeded,
    /// The child at `index` failed first; the others were stopped.
    Failed {
        index: usize,
        status: ExitStatus,
    },
    /// `abandoned` was set: every child was stopped.
    Abandoned,
}

/// Waits for every child; on the first failure, or once `abandoned` is set, stops the others
/// (SIGTERM, then SIGKILL after a grace period). Every child has ended and its output is copied
/// when this returns.
pub fn wait_all(children: &mut [Watched], abandoned: Option<&AtomicBool>) -> Result<Ended> {
    let mut ended = None;
    let mut done = vec![false; children.len()];
    while ended.is_none() && done.iter().any(|d| !d) {
        for (index, p) in children.iter_mut().enumerate() {
            if done[index] {
                continue;
            }
            if let Some(status) = p.child.try_wait()? {
                done[index] = true;
                if !status.success() {
                    ended = Some(Ended::Failed { index, status });
                    break;
                }
            }
        }
        if ended.is_none() && abandoned.is_some_and(|a| a.load(Ordering::Relaxed)) {
            ended = Some(Ended::Abandoned);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if ended.is_some() {
        stop_all(children, &done);
    }
    for p in children.iter_mut() {
        let _ = p.child.wait();
        let lasts: Vec<Option<String>> = p.copiers.drain(..).map(|c| c.join().ok().flatten()).collect();
        p.last_error = lasts.into_iter().nth(1).flatten();
    }
    Ok(ended.unwrap_or(Ended::Succeeded))
}

/// Where [`tee`] also prints the lines it logs.
#[derive(Clone, Copy)]
pub enum Echo {
    Stdout,
    Stderr,
    None,
}

/// Copies lines into `log` and to `echo`; returns the last line (for a failure message). A
/// progress bar's relayed frame (`telemetry::progress`'s relay) is never logged: `relay` shows
/// it (`train`, on a terminal), else a stderr echo passes it on (a step's rank 0, to `train`).
pub fn tee(
    reader: impl BufRead,
    mut log: std::fs::File,
    echo: Echo,
    relay: Option<&RelayedBar>,
) -> Result<Option<String>> {
    let mut last = None;
    for line in reader.lines() {
        let line = line?;
        if let Some(frame) = progress::relayed_line(&line) {
            match (relay, echo) {
                (Some(bar), _) => bar.show(frame),
                (None, Echo::Stderr) => eprintln!("{line}"),
                (None, _) => {}
            }
            continue;
        }
        let print = || match echo {
            Echo::Stdout => println!("{line}"),
            Echo::Stderr => eprintln!("{line}"),
            Echo::None => {}
        };
        match relay {
            Some(bar) => bar.suspend(print),
            None => print(),
        }
        // One write a line: a step's stdout and stderr are copied into the same log by two
        // threads, and `writeln!` may write a line and its newline apart, between the other's.
        log.write_all(format!("{line}\n").as_bytes())?;
        last = Some(line);
    }
    Ok(last)
}

/// Copies a child's lines into its log (and to `echo`) on a thread; the thread returns the
/// last line.
fn copy_lines(
    stream: impl std::io::Read + Send + 'static,
    log: std::fs::File,
    echo: Echo,
) -> JoinHandle<Option<String>> {
    std::thread::spawn(move || tee(BufReader::new(stream), log, echo, None).ok().flatten())
}

fn stop_all(children: &mut [Watched], done: &[bool]) {
    for (p, &d) in children.iter().zip(done) {
        if !d {
            // SAFETY: kill only sends a signal to a child we started and have not reaped.
            unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for p in children.iter_mut() {
        while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(p.child.try_wait(), Ok(None)) {
            let _ = p.child.kill();
        }
    }
}

/// The last `n` lines of a log.
pub fn last_lines(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| l.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn get<'a>(env: &'a [(&str, String)], k: &str) -> Option<&'a str> {
        env.iter().find(|(key, _)| *key == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn relayed_progress_frames_never_reach_the_log() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("training.log");
        let mark = progress::RELAY_MARK;
        let input = format!("step 1 | loss 2.5\n{mark}evaluating: 3/10 batches\nppl: 5.9\n{mark}\n");
        let last = tee(std::io::Cursor::new(input), std::fs::File::create(&path)?, Echo::None, None)?;
        assert_eq!(std::fs::read_to_string(&path)?, "step 1 | loss 2.5\nppl: 5.9\n");
        assert_eq!(last.as_deref(), Some("ppl: 5.9"), "a failure names the last log line, not a frame");
        Ok(())
    }

    fn node(vars: &[(&str, &str)]) -> Result<Option<NodeRanks>> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        NodeRanks::from_lookup(&|k| map.get(k).cloned())
    }

    #[test]
    fn ranks_get_torchruns_environment() {
        let env = rank_env(1, 3, 4242);
        assert_eq!(get(&env, "RANK"), Some("1"));
        assert_eq!(get(&env, "WORLD_SIZE"), Some("3"));
        assert_eq!(get(&env, "LOCAL_RANK"), Some("1"));
        assert_eq!(get(&env, "LOCAL_WORLD_SIZE"), Some("3"));
        assert_eq!(get(&env, "MASTER_PORT"), Some("4242"));
        assert_eq!(get(&env, "MASTER_ADDR"), Some("127.0.0.1"));
        // Three ranks share the cores (unless the user set a thread count, which they keep).
        let threads = hybrid_engine::runtime::threads_per_rank(3);
        assert_eq!(get(&env, "RAYON_NUM_THREADS"), threads.map(|n| n.to_string()).as_deref());
        if let Some(n) = threads {
            assert_eq!(n, (hybrid_engine::runtime::threads() / 3).max(1));
        }
    }

    #[test]
    fn a_multi_node_nodes_ranks_are_numbered_after_the_earlier_hosts() -> Result<()> {
        let n = node(&[
            (NPROC_ENV, "2"),
            (FIRST_RANK_ENV, "3"),
            (WORLD_SIZE_ENV, "5"),
            (MASTER_ADDR_ENV, "worker-0"),
            (MASTER_PORT_ENV, "29500"),
        ])?
        .expect("a node with ranks to start");
        assert!(n.remote);
        let env = n.rank_env(1);
        for (k, v) in [
            ("RANK", "4"),
            ("WORLD_SIZE", "5"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "worker-0"),
            ("MASTER_PORT", "29500"),
        ] {
            assert_eq!(get(&env, k), Some(v), "{k}");
        }
        // One slot on a node of a bigger job still starts its rank: it must join the others.
        let one = node(&[
            (NPROC_ENV, "1"),
            (FIRST_RANK_ENV, "1"),
            (WORLD_SIZE_ENV, "2"),
            (MASTER_ADDR_ENV, "h"),
            (MASTER_PORT_ENV, "1"),
        ])?;
        assert_eq!(one.map(|n| n.rank_env(0)[0].1.clone()).as_deref(), Some("1"));
        Ok(())
    }

    #[test]
    fn the_rendezvous_port_is_one_the_kernel_never_hands_out_on_its_own() -> Result<()> {
        // The ephemeral range is where every bind(0) and outgoing connection lands (the ranks'
        // peer listeners, other jobs' clients): a port from there can be taken between the
        // launcher's choice and rank 0's bind. Ours is below it. (That rank 0 can bind it is
        // free_port's own probe; binding it again here raced with something outside the test
        // in two CI runs, which no pick can prevent.)
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .expect("the ephemeral range's low end");
        for _ in 0..16 {
            let port = free_port()?;
            assert!((10000..low).contains(&port) && port != 29500, "port {port}");
        }
        Ok(())
    }

    #[test]
    fn a_taken_port_is_never_picked() -> Result<()> {
        // The only candidate is held: the pick falls back to a port the kernel hands out.
        let held = std::net::TcpListener::bind("0.0.0.0:0")?;
        let taken = held.local_addr()?.port();
        for _ in 0..4 {
            assert_ne!(free_port_in(taken..taken + 1)?, taken);
        }
        // Nor is the launcher's default, free or not.
        let default = hybrid_engine::comm::env::DEFAULT_MASTER_PORT;
        assert_ne!(free_port_in(default..default + 1)?, default);
        Ok(())
    }

    #[test]
    fn who_launches_what() -> Result<()> {
        // A rank never launches; one rank alone runs as itself; single_node picks a free port.
        assert_eq!(node(&[(NPROC_ENV, "2"), ("RANK", "0")])?, None);
        assert_eq!(node(&[])?, None);
        assert_eq!(node(&[(NPROC_ENV, "1")])?, None);
        let single = node(&[(NPROC_ENV, "3")])?.unwrap();
        assert_eq!((single.local, single.first_rank, single.world, single.remote), (3, 0, 3, false));
        let base = [(NPROC_ENV, "2"), (FIRST_RANK_ENV, "1"), (WORLD_SIZE_ENV, "3"), (MASTER_ADDR_ENV, "h")];
        for (vars, want) in [
            (vec![(NPROC_ENV, "0")], "RLHF_NPROC_PER_NODE=\"0\" is not a number of at least 1"),
            (base.to_vec(), "RLHF_MASTER_PORT is not"),
            ([&base[..], &[(MASTER_PORT_ENV, "0")]].concat(), "RLHF_MASTER_PORT=\"0\" is not a port number"),
            (
                [&base[..2], &[(WORLD_SIZE_ENV, "2"), (MASTER_ADDR_ENV, "h"), (MASTER_PORT_ENV, "9")]].concat(),
                "ranks 1..3 do not fit a world of 2",
            ),
        ] {
            let err = node(&vars).unwrap_err().to_string();
            assert!(err.contains(want), "{vars:?}: {err}");
        }
        Ok(())
    }
}
