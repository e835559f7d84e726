//! Runs one step as N rank processes on this machine (torchrun's `--nproc-per-node`). The
//! launcher sets [`NPROC_ENV`] for a `single_node` recipe; the step binary, started by the recipe
//! without `RANK`, then starts N copies of itself with torchrun's variables and supervises them:
//! rank 0's output goes to the terminal, every rank's to `<dir>/rank-<r>.log`, and when one rank
//! fails the others are stopped and the failure is reported with that rank's last lines. A
//! process that has `RANK` set is a rank, never a launcher, so nothing spawns twice.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Ranks per node to start (set by `train --deployment-type single_node`).
pub const NPROC_ENV: &str = "RLHF_NPROC_PER_NODE";
/// Where the rank logs go (the step's output directory).
pub const RANK_LOG_DIR_ENV: &str = hybrid_engine::durable::RANK_LOGS_ENV;

/// How many ranks this process should start: `Some(n)` when [`NPROC_ENV`] asks for more than one
/// and this process is not itself a rank.
pub fn ranks_to_spawn() -> Result<Option<usize>> {
    let Some(v) = std::env::var_os(NPROC_ENV) else { return Ok(None) };
    let n: usize = v
        .to_str()
        .and_then(|s| s.trim().parse().ok())
        .filter(|&n| n >= 1)
        .ok_or_else(|| anyhow!("{NPROC_ENV}={v:?} is not a positive number of processes"))?;
    Ok((n > 1 && std::env::var_os("RANK").is_none()).then_some(n))
}

/// A free TCP port for the rendezvous (bound and released: another process could take it in
/// between, in which case rank 0 fails saying the port is in use).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The environment rank `rank` of `world` ranks on this node gets.
pub fn rank_env(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Starts this executable again as `n` ranks with the same name and arguments and waits for
/// them; returns the exit code to end with.
pub fn spawn_local_ranks(n: usize) -> Result<i32> {
    let exe = std::env::current_exe().context("cannot find this executable to start the ranks")?;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_default();
    let args: Vec<_> = args.collect();
    let log_dir = std::env::var_os(RANK_LOG_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("cannot create {}", log_dir.display()))?;
    // The ranks read it too: rank 0's model save keeps the logs being written (durable.rs).
    let log_dir = std::fs::canonicalize(&log_dir)?;
    let port = free_port()?;
    let mut ranks = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.arg0(&arg0)
            .args(&args)
            .envs(rank_env(r, n, port))
            .env(RANK_LOG_DIR_ENV, &log_dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe. A rank dies with its launcher: no rank outlives
        // a killed launcher.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("cannot start rank {r}"))?;
        ranks.push(RankProcess::watch(r, child, &log_dir)?);
    }
    supervise(ranks)
}

/// One running rank and the threads copying its output.
struct RankProcess {
    rank: usize,
    child: Child,
    log: PathBuf,
    copiers: Vec<std::thread::JoinHandle<()>>,
}

impl RankProcess {
    fn watch(rank: usize, mut child: Child, dir: &Path) -> Result<Self> {
        let log = dir.join(format!("rank-{rank}.log"));
        let file = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let (to_out, to_err) = if rank == 0 { (Echo::Stdout, Echo::Stderr) } else { (Echo::None, Echo::None) };
        let copiers = vec![copy_lines(out, file.try_clone()?, to_out), copy_lines(err, file, to_err)];
        Ok(Self { rank, child, log, copiers })
    }
}

/// Where [`tee`] also prints the lines it logs.
#[derive(Clone, Copy)]
pub enum Echo {
    Stdout,
    Stderr,
    None,
}

/// Copies lines into `log` and to `echo`; returns the last line (for a failure message).
pub fn tee(reader: impl BufRead, mut log: std::fs::File, echo: Echo) -> Result<Option<String>> {
    let mut last = None;
    for line in reader.lines() {
        let line = line?;
        match echo {
            Echo::Stdout => println!("{line}"),
            Echo::Stderr => eprintln!("{line}"),
            Echo::None => {}
        }
        writeln!(log, "{line}")?;
        last = Some(line);
    }
    Ok(last)
}

/// Copies a rank's lines into its log (and, for rank 0, to the terminal) on a thread.
fn copy_lines(
    stream: impl std::io::Read + Send + 'static,
    log: std::fs::File,
    echo: Echo,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _ = tee(BufReader::new(stream), log, echo);
    })
}

/// Waits for every rank; on the first failure stops the others (SIGTERM, then SIGKILL after a
/// grace period) and reports the failed rank's last lines.
fn supervise(mut ranks: Vec<RankProcess>) -> Result<i32> {
    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut done = vec![false; ranks.len()];
    while failed.is_none() && done.iter().any(|d| !d) {
        for (i, p) in ranks.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Some(status) = p.child.try_wait()? {
                done[i] = true;
                if !status.success() {
                    failed = Some((p.rank, status));
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if failed.is_some() {
        stop_all(&mut ranks, &done);
    }
    for p in &mut ranks {
        let _ = p.child.wait();
        for c in p.copiers.drain(..) {
            let _ = c.join();
        }
    }
    let Some((rank, status)) = failed else { return Ok(0) };
    let p = &ranks[rank];
    if rank != 0 {
        // Rank 0's lines are on the terminal already; show the failed rank's end too.
        for line in last_lines(&p.log, 5) {
            eprintln!("[rank {rank}] {line}");
        }
    }
    bail!("rank {rank} of {} failed ({status}); the others were stopped (its log: {})", ranks.len(), p.log.display())
}

fn stop_all(ranks: &mut [RankProcess], done: &[bool]) {
    for (p, &d) in ranks.iter().zip(done) {
        if !d {
            // SAFETY: kill only sends a signal to a child we started and have not reaped.
            unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for p in ranks.iter_mut() {
        while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(p.child.try_wait(), Ok(None)) {
            let _ = p.child.kill();
        }
    }
}

fn last_lines(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| l.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_torchruns_environment() {
        let env = rank_env(1, 3, 4242);
        let get = |k: &str| env.iter().find(|(key, _)| *key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("1"));
        assert_eq!(get("WORLD_SIZE"), Some("3"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("MASTER_PORT"), Some("4242"));
        assert_eq!(get("MASTER_ADDR"), Some("127.0.0.1"));
    }
}
