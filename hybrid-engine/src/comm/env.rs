//! Which rank this process is, read from the environment launchers set: torchrun's (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), which our own
//! launcher, DeepSpeed's and `torch.distributed.launch` also set; Open MPI's `mpirun`
//! (`OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`); SLURM's (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`/`SLURM_TASKS_PER_NODE`, the
//! allocation's first host as the master); or MPICH's and Intel MPI's (`PMI_RANK`, `PMI_SIZE`,
//! `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`). None of them set: one rank, no sockets.
//!
//! Rank 0 serves the rendezvous store on `MASTER_PORT`, but under torchrun's elastic agent
//! (`TORCHELASTIC_USE_AGENT_STORE=True`) the agent's own TCPStore already listens there: the
//! store then goes on the next port, which every rank derives alike. `RLHF_STORE_PORT` sets it
//! under any launcher.
//!
//! A pure function of a variable lookup, so every case is unit-tested without touching the
//! process environment.

use anyhow::{anyhow, bail, Result};

/// The default rendezvous port when only `MASTER_ADDR` (or SLURM) is given: torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// Rank among the processes of this machine (picks the GPU).
    pub local_rank: usize,
    pub local_world: usize,
    /// Rank 0's host, where the rendezvous store is served.
    pub master_addr: String,
    pub master_port: u16,
    /// The store's port: `master_port`, or the next one under torchrun's agent, or
    /// `RLHF_STORE_PORT`.
    pub store_port: u16,
    /// Which launcher's variables these came from, for messages.
    pub source: &'static str,
}

impl RankEnv {
    /// One process alone: rank 0 of 1, no rendezvous.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world: 1,
            local_rank: 0,
            local_world: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            store_port: DEFAULT_MASTER_PORT,
            source: "none",
        }
    }

    /// Reads the process environment (see [`Self::from_lookup`]).
    pub fn from_process() -> Result<Self> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// torchrun's variables if `RANK` or `WORLD_SIZE` is set, else Open MPI's, SLURM's, then
    /// MPICH's, else one rank. Every variable is checked: a rank outside the world, a world of 0
    /// or a port that is not a number is one error naming the variable.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let has = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
        let env = if has("RANK") || has("WORLD_SIZE") {
            torchrun(get)?
        } else if has("OMPI_COMM_WORLD_RANK") {
            mpi(
                get,
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
                "mpirun (Open MPI)",
            )?
        } else if has("SLURM_PROCID") && has("SLURM_NTASKS") {
            slurm(get)?
        } else if has("PMI_RANK") {
            mpi(get, ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"], "mpirun (MPICH)")?
        } else {
            return Ok(Self::single());
        };
        with_store_port(env, get)
    }

    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }
}

fn number(get: &dyn Fn(&str) -> Option<String>, key: &str) -> Result<Option<usize>> {
    match get(key).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v
            .parse::<usize>()
            .map(Some)
            .map_err(|_| anyhow!("environment variable {key}={v:?} is not a non-negative integer")),
    }
}

fn required(get: &dyn Fn(&str) -> Option<String>, key: &str, launcher: &str) -> Result<usize> {
    number(get, key)?
        .ok_or_else(|| anyhow!("{launcher}: {key} is not set; set it (or unset the others) to run one rank"))
}

fn port(get: &dyn Fn(&str) -> Option<String>) -> Result<u16> {
    match get("MASTER_PORT").map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
        None => Ok(DEFAULT_MASTER_PORT),
        Some(v) => match v.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => bail!("environment variable MASTER_PORT={v:?} is not a port number (1-65535)"),
        },
    }
}

/// The store's port (see the module's documentation).
fn with_store_port(mut env: RankEnv, get: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv> {
    let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    env.store_port = match get("RLHF_STORE_PORT").map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
        Some(v) => match v.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => bail!("environment variable RLHF_STORE_PORT={v:?} is not a port number (1-65535)"),
        },
        None if agent_store => env.master_port.checked_add(1).ok_or_else(|| {
            anyhow!("torchrun's agent serves its store on MASTER_PORT 65535 and the next port does not exist: set RLHF_STORE_PORT")
        })?,
        None => env.master_port,
    };
    Ok(env)
}

fn checked(env: RankEnv) -> Result<RankEnv> {
    let (r, w, lr, lw, src) = (env.rank, env.world, env.local_rank, env.local_world, env.source);
    if w == 0 {
        bail!("{src}: the world size is 0; it must be at least 1");
    }
    if r >= w {
        bail!("{src}: rank {r} is outside a world of {w} ranks (ranks are 0..{w})");
    }
    if lw == 0 || lr >= lw || lw > w {
        bail!("{src}: local rank {lr} of {lw} local ranks does not fit a world of {w}");
    }
    Ok(env)
}

fn torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv> {
    let src = "torchrun environment (RANK, WORLD_SIZE)";
    let rank = required(get, "RANK", src)?;
    let world = required(get, "WORLD_SIZE", src)?;
    let local_rank = number(get, "LOCAL_RANK")?.unwrap_or(rank);
    let local_world = number(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world);
    let master_addr = get("MASTER_ADDR").filter(|v| !v.trim().is_empty());
    if world > 1 && master_addr.is_none() {
        bail!("{src}: MASTER_ADDR is not set; set it to rank 0's host name or address");
    }
    checked(RankEnv {
        rank,
        world,
        local_rank,
        local_world,
        master_addr: master_addr.unwrap_or_else(|| "127.0.0.1".into()),
        master_port: port(get)?,
        store_port: 0,
        source: "torchrun",
    })
}

/// An MPI launcher's variables (`names`: rank, size, local rank, local size). MPI passes no
/// master: `MASTER_ADDR` names it, or with every rank on this machine it is this machine.
fn mpi(get: &dyn Fn(&str) -> Option<String>, names: [&str; 4], source: &'static str) -> Result<RankEnv> {
    let [rank_var, size_var, local_var, local_size_var] = names;
    let rank = required(get, rank_var, source)?;
    let world = required(get, size_var, source)?;
    let local_rank = number(get, local_var)?.unwrap_or(rank);
    let local_world = number(get, local_size_var)?.unwrap_or(world);
    let master_addr = match get("MASTER_ADDR").filter(|v| !v.trim().is_empty()) {
        Some(a) => a,
        None if local_world == world => "127.0.0.1".into(),
        None => bail!(
            "{source}: the ranks span several machines and MASTER_ADDR is not set: pass rank 0's host (mpirun -x MASTER_ADDR=<host>)"
        ),
    };
    checked(RankEnv {
        rank,
        world,
        local_rank,
        local_world,
        master_addr,
        master_port: port(get)?,
        store_port: 0,
        source,
    })
}

fn slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv> {
    let src = "SLURM environment (SLURM_PROCID, SLURM_NTASKS)";
    let rank = required(get, "SLURM_PROCID", src)?;
    let world = required(get, "SLURM_NTASKS", src)?;
    let local_rank = number(get, "SLURM_LOCALID")?.unwrap_or(0);
    let local_world = match number(get, "SLURM_NTASKS_PER_NODE")? {
        Some(n) => n,
        None => get("SLURM_TASKS_PER_NODE").and_then(|v| first_count(&v)).unwrap_or(world),
    };
    let master_addr = match get("MASTER_ADDR").filter(|v| !v.trim().is_empty()) {
        Some(a) => a,
        None => {
            let list = get("SLURM_STEP_NODELIST")
                .or_else(|| get("SLURM_JOB_NODELIST"))
                .or_else(|| get("SLURM_NODELIST"))
                .ok_or_else(|| anyhow!("{src}: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set"))?;
            first_host(&list)?
        }
    };
    let master_port = port(get)?;
    checked(RankEnv { rank, world, local_rank, local_world, master_addr, master_port, store_port: 0, source: "SLURM" })
}

/// `SLURM_TASKS_PER_NODE`'s first count: `4(x2),3` -> 4.
fn first_count(v: &str) -> Option<usize> {
    v.split([',', '(']).next()?.trim().parse().ok()
}

/// The first host of a SLURM node list, as `scontrol show hostnames | head -1` gives it:
/// `node[003-005,007],gpu1` -> `node003`; `a1,b2` -> `a1`; `node7` -> `node7`.
pub fn first_host(list: &str) -> Result<String> {
    let list = list.trim();
    let bad = || anyhow!("cannot read the SLURM node list {list:?}; set MASTER_ADDR to the first host");
    // The first entry ends at a comma outside brackets.
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map_or(list.len(), |(i, _)| i);
    let entry = &list[..end];
    let Some(open) = entry.find('[') else {
        return if entry.is_empty() { Err(bad()) } else { Ok(entry.to_string()) };
    };
    let (prefix, rest) = entry.split_at(open);
    let close = rest.find(']').ok_or_else(bad)?;
    let first = rest[1..close].split(',').next().ok_or_else(bad)?;
    let low = first.split('-').next().ok_or_else(bad)?;
    if low.is_empty() || !low.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    Ok(format!("{prefix}{low}{}", &rest[close + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Result<RankEnv> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RankEnv::from_lookup(&|k| map.get(k).cloned())
    }

    #[test]
    fn nothing_set_is_one_rank_without_sockets() -> Result<()> {
        let e = env(&[])?;
        assert_eq!((e.rank, e.world, e.is_distributed()), (0, 1, false));
        Ok(())
    }

    #[test]
    fn torchrun_variables_are_read_and_checked() -> Result<()> {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ])?;
        assert_eq!((e.rank, e.world, e.local_rank, e.local_world, e.is_distributed()), (3, 4, 1, 2, true));
        assert_eq!((e.master_addr.as_str(), e.master_port, e.source), ("node0", 1234, "torchrun"));
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])?;
        assert_eq!((e.local_rank, e.local_world, e.master_port), (0, 2, DEFAULT_MASTER_PORT));
        for (vars, needle) in [
            (vec![("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")], "rank 2 is outside a world of 2"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_ADDR", "h")], "world size is 0"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")], "RANK=\"x\""),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_ADDR is not set"),
            (vec![("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")], "RANK is not set"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")], "MASTER_PORT"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "0")], "MASTER_PORT=\"0\""),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("LOCAL_RANK", "3"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "local rank 3 of 2",
            ),
        ] {
            let err = env(&vars).unwrap_err().to_string();
            assert!(err.contains(needle), "{vars:?}: {err}");
        }
        Ok(())
    }

    /// torchrun's elastic agent serves its own TCPStore on MASTER_PORT: ours takes the next
    /// port on every rank alike; `RLHF_STORE_PORT` sets it under any launcher.
    #[test]
    fn the_store_moves_off_torchruns_agent_store() -> Result<()> {
        let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "4000")];
        assert_eq!(env(&torchrun)?.store_port, 4000);
        let agent = [&torchrun[..], &[("TORCHELASTIC_USE_AGENT_STORE", "True")]].concat();
        assert_eq!((env(&agent)?.master_port, env(&agent)?.store_port), (4000, 4001));
        let chosen = [&agent[..], &[("RLHF_STORE_PORT", "5000")]].concat();
        assert_eq!(env(&chosen)?.store_port, 5000);
        let bad = [&torchrun[..], &[("RLHF_STORE_PORT", "0")]].concat();
        assert!(env(&bad).unwrap_err().to_string().contains("RLHF_STORE_PORT=\"0\""));
        let last = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "65535")];
        let last = [&last[..], &[("TORCHELASTIC_USE_AGENT_STORE", "True")]].concat();
        assert!(env(&last).unwrap_err().to_string().contains("set RLHF_STORE_PORT"));
        Ok(())
    }

    /// Open MPI's and MPICH's variables; with every rank on one machine the master is this one,
    /// across machines MASTER_ADDR must name it.
    #[test]
    fn mpi_launchers_variables_are_read() -> Result<()> {
        let ompi = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        let err = env(&ompi).unwrap_err().to_string();
        assert!(err.contains("mpirun (Open MPI)") && err.contains("MASTER_ADDR"), "{err}");
        let e = env(&[&ompi[..], &[("MASTER_ADDR", "node0")]].concat())?;
        assert_eq!((e.rank, e.world, e.local_rank, e.local_world), (3, 4, 1, 2));
        assert_eq!(
            (e.master_addr.as_str(), e.store_port, e.source),
            ("node0", DEFAULT_MASTER_PORT, "mpirun (Open MPI)")
        );
        // Open MPI's variables win over a SLURM allocation's (mpirun inside salloc).
        let e = env(&[&ompi[..], &[("MASTER_ADDR", "n"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]].concat())?;
        assert_eq!(e.rank, 3);
        let mpich = [("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")];
        let e = env(&mpich)?;
        assert_eq!((e.rank, e.world, e.master_addr.as_str(), e.source), (1, 2, "127.0.0.1", "mpirun (MPICH)"));
        let err = env(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]).unwrap_err().to_string();
        assert!(err.contains("rank 2 is outside a world of 2"), "{err}");
        Ok(())
    }

    #[test]
    fn slurm_variables_name_the_first_host_of_the_allocation() -> Result<()> {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[007-008]"),
        ])?;
        assert_eq!((e.rank, e.world, e.local_rank, e.local_world), (5, 8, 1, 4));
        assert_eq!((e.master_addr.as_str(), e.source), ("gpu007", "SLURM"));
        for (list, first) in [
            ("node[003-005,007],gpu1", "node003"),
            ("a1,b2", "a1"),
            ("node7", "node7"),
            ("rack[1-2]-n[3]", "rack1-n[3]"),
        ] {
            assert_eq!(first_host(list)?, first, "{list}");
        }
        assert!(first_host("node[x]").is_err() && first_host("").is_err());
        // MASTER_ADDR wins over the node list; torchrun's variables win over SLURM's.
        let e =
            env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("MASTER_ADDR", "m"), ("SLURM_JOB_NODELIST", "n1")])?;
        assert_eq!(e.master_addr, "m");
        let e = env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("RANK", "0"), ("WORLD_SIZE", "1")])?;
        assert_eq!((e.rank, e.world, e.source), (0, 1, "torchrun"));
        // SLURM_PROCID without SLURM_NTASKS gives no world to be a rank of: MPICH's variables
        // are read, or it is one rank.
        assert_eq!(env(&[("SLURM_PROCID", "1")])?, RankEnv::single());
        let e = env(&[("SLURM_PROCID", "0"), ("PMI_RANK", "1"), ("PMI_SIZE", "2")])?;
        assert_eq!((e.rank, e.world, e.source), (1, 2, "mpirun (MPICH)"));
        Ok(())
    }
}
