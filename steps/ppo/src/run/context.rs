//! What the stages of step 3's loop read: the flags, the ranks, the device, the actor's shape.

use crate::args::PpoArgs;
use candle_core::Device;
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::training::tensor_parallel::TensorParallel;
use std::sync::Arc;

/// What the stages of the loop read: the flags, the ranks, the device.
pub(super) struct Ctx<'a> {
    pub(super) args: &'a PpoArgs,
    pub(super) cfg: crate::PpoConfig,
    /// The ranks the rollouts and micro-batches are split over: every rank, or under tensor
    /// parallelism the data-parallel group.
    pub(super) group: &'a ProcessGroup,
    /// `--tensor-model-parallel-size`: the models are this rank's slices.
    pub(super) tp: Option<&'a TensorParallel>,
    pub(super) device: Device,
    pub(super) actor_cfg: Gpt2Config,
    pub(super) eos: u32,
    pub(super) vocab: usize,
    /// Rows of a PPO micro-batch over all ranks.
    pub(super) global_micro: usize,
    /// `--inference-tp-size`: the ranks this one generates rollouts with.
    pub(super) inference_tp: Option<Arc<ProcessGroup>>,
}
