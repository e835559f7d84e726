//! `chat` and `prompt_eval` with `--tensor-model-parallel-size T`: one model split over T ranks
//! (Megatron's layout, as training splits it) to generate with, for a model too large for one
//! device. The command the user runs is rank 0: it reads the terminal and prints, and starts the
//! other T - 1 ranks as copies of itself, which take no input, print nothing and follow rank 0's
//! prompts. Under a launcher (`RANK` set, torchrun-style) the launcher's ranks are the T ranks.
//! Every rank loads the whole model and keeps its slices; the ranks generate each answer in
//! lockstep and end with the same tokens (the logits are gathered before sampling).

use crate::ranks::{die_with_parent, free_port, rank_env};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use hybrid_engine::checkpoints::sharded_io::ModelSlices;
use hybrid_engine::comm::env::RankEnv;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::tensor_parallel::shard::check_divides;
use hybrid_engine::training::tensor_parallel::TensorParallel;
use hybrid_engine::{Gpt2, Gpt2Config};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What rank 0 sends to end the session instead of a prompt's length.
const END: u32 = u32::MAX;

/// The T ranks one model is split over.
pub struct InferenceRanks {
    tp: TensorParallel,
    /// The ranks rank 0 started (none under a launcher, or on the other ranks).
    workers: Vec<Child>,
}

impl InferenceRanks {
    /// The ranks of a `size`-way split of a model of config `cfg`, or `None` for 1. Rank 0 (the
    /// process the user started) checks that `size` divides the model's heads and MLP width
    /// before it starts the others. `timeout` bounds every wait for a rank: rank 0's next
    /// prompt included, so an interactive session passes a long one.
    pub fn join(size: usize, cfg: &Gpt2Config, timeout: Duration) -> Result<Option<Self>> {
        let env = RankEnv::from_process()?;
        if size <= 1 {
            if env.is_distributed() {
                bail!("{} ranks were started ({}), but without --tensor-model-parallel-size they have nothing to split: pass --tensor-model-parallel-size {} or start one process", env.world, env.source, env.world);
            }
            return Ok(None);
        }
        check_divides(cfg.num_heads(), cfg.inner_dim(), size)?;
        let flags: Vec<String> = std::env::args().skip(1).collect();
        let (env, workers) = match env.is_distributed() {
            true if env.world != size => bail!(
                "--tensor-model-parallel-size {size} splits one model over all the ranks, and {} were started ({}): start {size}",
                env.world,
                env.source
            ),
            true => (env, Vec::new()),
            false => start_workers(size)?,
        };
        let group = Arc::new(ProcessGroup::init(env, timeout, &flags.join("\0"))?);
        let tp = TensorParallel::new(&group, size)?.context("internal error: a split over one rank")?;
        Ok(Some(Self { tp, workers }))
    }

    /// The ranks the model is split over.
    pub fn size(&self) -> usize {
        self.tp.size()
    }

    /// The rank that reads the input and prints.
    pub fn is_first(&self) -> bool {
        self.tp.tp().is_first()
    }

    /// This rank's model: its slices of the weights in `dir`'s memory-mapped files, read
    /// tensor by tensor (a rank never holds the whole model).
    pub fn read_model(&self, dir: &ModelSlices, device: &Device) -> Result<Gpt2> {
        let slices = self.tp.read(&dir.config, device, |name, range| dir.read(name, range))?;
        self.tp.model(&slices, &dir.config)
    }

    /// Rank 0's next prompt on every rank: rank 0 passes it (`None` ends the session), the
    /// others pass `None` and get it.
    pub fn share_prompt(&self, prompt: Option<&[u32]>) -> Result<Option<Vec<u32>>> {
        let group = self.tp.tp();
        let len = prompt.map_or(END, |p| p.len() as u32);
        let mut head = len.to_le_bytes();
        group.broadcast_bytes(&mut head, 0)?;
        let len = u32::from_le_bytes(head);
        if len == END {
            return Ok(None);
        }
        let mut bytes: Vec<u8> = match prompt {
            Some(p) if self.is_first() => p.iter().flat_map(|t| t.to_le_bytes()).collect(),
            _ => vec![0; 4 * len as usize],
        };
        group.broadcast_bytes(&mut bytes, 0)?;
        Ok(Some(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
    }

    /// Rank 0, at the end of a session it ended with [`Self::share_prompt`]`(None)`: waits (up
    /// to a minute) for the ranks it started to exit.
    pub fn finish(mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        for (i, worker) in self.workers.iter_mut().enumerate() {
            loop {
                match worker.try_wait()? {
                    Some(status) if status.success() => break,
                    Some(status) => bail!("rank {} of the tensor-parallel split ended with {status}", i + 1),
                    None if Instant::now() > deadline => {
                        worker.kill()?;
                        bail!("rank {} of the tensor-parallel split did not end within a minute; stopped it", i + 1)
                    }
                    None => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        Ok(())
    }
}

/// Starts ranks 1..size as copies of this process (same arguments, no input, no output, ended
/// with it) and returns rank 0's environment.
fn start_workers(size: usize) -> Result<(RankEnv, Vec<Child>)> {
    let port = free_port()?;
    let exe = std::env::current_exe().context("cannot find this executable to start the ranks")?;
    let mut workers = Vec::new();
    for rank in 1..size {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1))
            .envs(rank_env(rank, size, port))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        die_with_parent(&mut cmd);
        workers.push(cmd.spawn().with_context(|| format!("cannot start rank {rank}"))?);
    }
    let env = rank_env(0, size, port);
    let rank0 = RankEnv::from_lookup(&|k| env.iter().find(|(key, _)| *key == k).map(|(_, v)| v.clone()))?;
    Ok((rank0, workers))
}
