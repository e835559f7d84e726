//! AdamW with decoupled weight decay (Loshchilov & Hutter; `torch.optim.AdamW` arithmetic),
//! DS-Chat's parameter groups (`get_optimizer_grouped_parameters`: no decay on biases and
//! LayerNorm, as Megatron; LoRA adapters at their own learning rate; DS-Chat's name list misses
//! GPT-2's `ln_1`/`ln_2` weights, which it decays: docs/steps.md), gradient accumulation and
//! clipping by the global gradient norm. Moments are f32 whatever the compute dtype (candle's
//! AdamW in f16 diverges: g^2 underflows).

use crate::model::params::ParamStore;
use crate::storage::{contiguous_f32, contiguous_f32_mut};
use anyhow::{bail, Result};
use candle_core::{backprop::GradStore, CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// Megatron's defaults (pretraining's flags start from them).
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamWConfig {
    /// DS-Chat's optimizer in steps 1 to 3: betas (0.9, 0.95).
    pub fn ds_chat(eps: f64, weight_decay: f64) -> Self {
        Self { beta1: 0.9, beta2: 0.95, eps, weight_decay }
    }
}

/// Biases and LayerNorm parameters are not decayed.
pub fn no_weight_decay(name: &str) -> bool {
    name.ends_with(".bias") || name.starts_with("ln_") || name.contains(".ln_")
}

/// A parameter's first and second moments, borrowed from the host buffers or read from its device.
pub type Moments<'a> = (Cow<'a, [f32]>, Cow<'a, [f32]>);

/// The optimizer's checkpointable state: the step count and both moments per parameter, kept
/// as plain f32 buffers updated in place by one fused pass per parameter. Under ZeRO stages 1
/// and 2 a rank holds the moments of only its shard: `held[i]` is the range of parameter `i`'s
/// flattened values whose moments are here (all of them without sharding).
///
/// A parameter that is not f32 on the CPU (a GPU's) is updated on its device with its moments
/// kept there, both in one f32 tensor, m then v (`on_device[i]`, then the truth; the host
/// buffers are refreshed from it when read), so a step moves no parameter, gradient or moment
/// across the bus: an f32 parameter by the two in-place kernels of `cuda/adamw.cu`, any other
/// by candle ops. Those tensors are updated in place, so a copy of the optimizer copies them
/// ([`AdamW::try_clone`]) rather than sharing them.
pub struct AdamW {
    pub config: AdamWConfig,
    pub step: u64,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    on_device: Vec<Option<Tensor>>,
    held: Vec<Range<usize>>,
    decay: Vec<bool>,
    /// Each parameter's learning rate relative to the scheduled one (1 but for LoRA adapters).
    lr_scale: Vec<f64>,
}

/// AdamW's f32 coefficients of one step, shared by the in-place CPU update and the device one
/// so that both round alike: betas, `lr / bc1`, `sqrt(bc2)`, the decay factor `1 - lr*wd`, eps.
#[derive(Clone, Copy)]
struct StepCoefficients {
    b1: f32,
    b2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
    eps: f32,
}

impl StepCoefficients {
    fn new(lr: f64, wd: f64, step: u64, c: &AdamWConfig) -> Self {
        Self {
            b1: c.beta1 as f32,
            b2: c.beta2 as f32,
            step_size: (lr / (1.0 - c.beta1.powi(step as i32))) as f32,
            bc2_sqrt: (1.0 - c.beta2.powi(step as i32)).sqrt() as f32,
            decay: (1.0 - lr * wd) as f32,
            eps: c.eps as f32,
        }
    }

    /// `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2` (cuda/adamw.cu rounds in this order too).
    #[inline(always)]
    fn update_moments(&self, m: &mut f32, v: &mut f32, g: f32) {
        *m = self.b1 * *m + (1.0 - self.b1) * g;
        *v = self.b2 * *v + (1.0 - self.b2) * g * g;
    }

    /// The decayed parameter less `lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`.
    #[inline(always)]
    fn updated_param(&self, p: f32, m: f32, v: f32) -> f32 {
        let denom = v.sqrt() / self.bc2_sqrt + self.eps;
        p * self.decay - self.step_size * m / denom
    }
}

/// One AdamW update of a parameter in place (`torch.optim.AdamW` arithmetic): decoupled decay
/// `p *= 1 - lr*wd`, moments `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g^2`, then
/// `p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` with bias corrections `bc = 1 - beta^step`.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f64,
    wd: f64,
    step: u64,
    c: &AdamWConfig,
) {
    let k = StepCoefficients::new(lr, wd, step, c);
    let k = &k;
    // Split across threads for large tensors; one fused pass touches each value once.
    let threads = if p.len() < 1 << 16 { 1 } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    let chunk = p.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (((p, g), m), v) in
            p.chunks_mut(chunk).zip(g.chunks(chunk)).zip(m.chunks_mut(chunk)).zip(v.chunks_mut(chunk))
        {
            s.spawn(move || {
                for i in 0..p.len() {
                    k.update_moments(&mut m[i], &mut v[i], g[i]);
                    p[i] = k.updated_param(p[i], m[i], v[i]);
                }
            });
        }
    });
}

impl AdamW {
    pub fn new(config: AdamWConfig, params: &ParamStore) -> Result<Self> {
        Ok(Self::over_ranges(config, &params.names, params.vars.iter().map(|v| 0..v.elem_count()).collect()))
    }

    /// An optimizer holding the moments of `held[i]` of parameter `names[i]` only (ZeRO stage 3
    /// creates its shard's moments directly: the full ones never exist on any rank).
    pub fn over_ranges(config: AdamWConfig, names: &[String], held: Vec<Range<usize>>) -> Self {
        let zeros = || -> Vec<Vec<f32>> { held.iter().map(|r| vec![0f32; r.len()]).collect() };
        Self {
            config,
            step: 0,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            on_device: vec![None; held.len()],
            decay: names.iter().map(|n| !no_weight_decay(n)).collect(),
            lr_scale: vec![1.0; names.len()],
            held,
        }
    }

    /// Keeps only the moments of `ranges` (one per parameter, within the moments held now):
    /// ZeRO stages 1 and 2 give each rank the moments of its shard.
    pub fn keep_only(&mut self, ranges: &[Range<usize>]) {
        assert_eq!(ranges.len(), self.held.len(), "one range per parameter");
        for (i, r) in ranges.iter().enumerate() {
            assert!(self.on_device[i].is_none(), "ZeRO shards the optimizer before its first step");
            let held = &self.held[i];
            assert!(r.start >= held.start && r.end <= held.end, "range {r:?} outside the held {held:?}");
            let local = r.start - held.start..r.end - held.start;
            self.exp_avg[i] = self.exp_avg[i][local.clone()].to_vec();
            self.exp_avg_sq[i] = self.exp_avg_sq[i][local].to_vec();
            self.held[i] = r.clone();
        }
    }

    /// Makes the host buffers of parameter `i` the truth again: copies its on-device moments
    /// back (if any) and drops them (the next device step uploads the host buffers).
    fn pull_to_host(&mut self, i: usize) -> Result<()> {
        if let Some(mv) = self.on_device[i].take() {
            (self.exp_avg[i], self.exp_avg_sq[i]) = split_moments(&mv)?;
        }
        Ok(())
    }

    /// A copy whose moments on a device are copies too (they are updated in place).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            config: self.config.clone(),
            step: self.step,
            exp_avg: self.exp_avg.clone(),
            exp_avg_sq: self.exp_avg_sq.clone(),
            on_device: self
                .on_device
                .iter()
                .map(|t| t.as_ref().map(Tensor::copy).transpose())
                .collect::<Result<_, _>>()?,
            held: self.held.clone(),
            decay: self.decay.clone(),
            lr_scale: self.lr_scale.clone(),
        })
    }

    /// The range of parameter `i` whose moments this optimizer holds.
    pub fn held(&self, i: usize) -> Range<usize> {
        self.held[i].clone()
    }

    /// Parameter `i`'s held moments (first, second): read from its device when they live there.
    pub fn held_moments(&self, i: usize) -> Result<Moments<'_>> {
        Ok(match &self.on_device[i] {
            Some(mv) => {
                let (m, v) = split_moments(mv)?;
                (Cow::Owned(m), Cow::Owned(v))
            }
            None => (Cow::Borrowed(&self.exp_avg[i]), Cow::Borrowed(&self.exp_avg_sq[i])),
        })
    }

    /// Copies the moments of `range` of parameter `i` (`m` and `v`, one value per index of
    /// `range`) where they overlap the held range; returns how many values were copied.
    pub fn fill_held(&mut self, i: usize, range: Range<usize>, m: &[f32], v: &[f32]) -> Result<usize> {
        let held = self.held[i].clone();
        let (lo, hi) = (range.start.max(held.start), range.end.min(held.end));
        if lo >= hi {
            return Ok(0);
        }
        self.pull_to_host(i)?;
        let (src, dst) = (lo - range.start..hi - range.start, lo - held.start..hi - held.start);
        self.exp_avg[i][dst.clone()].copy_from_slice(&m[src.clone()]);
        self.exp_avg_sq[i][dst].copy_from_slice(&v[src]);
        Ok(hi - lo)
    }

    /// This optimizer's configuration, step and groups with the full moments `exp_avg` and
    /// `exp_avg_sq` (a consolidated copy of a sharded one).
    pub fn with_full_moments(&self, exp_avg: Vec<Vec<f32>>, exp_avg_sq: Vec<Vec<f32>>) -> Self {
        Self {
            held: exp_avg.iter().map(|m| 0..m.len()).collect(),
            on_device: vec![None; exp_avg.len()],
            config: self.config.clone(),
            step: self.step,
            exp_avg,
            exp_avg_sq,
            decay: self.decay.clone(),
            lr_scale: self.lr_scale.clone(),
        }
    }

    /// Updates `p`, the held piece of parameter `i`, with its gradient `g`, in the current step
    /// (the caller has advanced `step`): ZeRO's per-shard update.
    pub fn update_held(&mut self, i: usize, p: &mut [f32], g: &[f32], lr: f64) {
        assert_eq!(p.len(), self.held[i].len(), "the piece is the held range");
        let wd = if self.decay[i] { self.config.weight_decay } else { 0.0 };
        let lr = lr * self.lr_scale[i];
        adamw_update(p, g, &mut self.exp_avg[i], &mut self.exp_avg_sq[i], lr, wd, self.step, &self.config);
    }

    /// [`Self::update_held`] where the piece lives: `p`, the held piece of parameter `i` (an f32
    /// view into a shard or a parameter, updated in place), from its gradient `g` (f32, as many
    /// values), in the current step. The moments stay on `p`'s device between steps (uploaded
    /// from the host at the first): on a GPU, ZeRO's shard steps there (cuda/adamw.cu's two
    /// passes); on the CPU the same arithmetic as [`Self::update_held`], bit for bit.
    pub fn update_held_in_place(&mut self, i: usize, p: &Tensor, g: &Tensor, lr: f64) -> Result<()> {
        if p.elem_count() != self.held[i].len() || g.elem_count() != p.elem_count() {
            bail!(
                "internal error: a shard's piece of {} values with {} gradients, where {} are held",
                p.elem_count(),
                g.elem_count(),
                self.held[i].len()
            );
        }
        let wd = if self.decay[i] { self.config.weight_decay } else { 0.0 };
        let k = StepCoefficients::new(lr * self.lr_scale[i], wd, self.step, &self.config);
        let mv = self.take_device_moments(i, p.device())?;
        let updated = adamw_update_in_place(p, g, &mv, &k);
        // Kept whether or not the passes ran: they are the moments' truth.
        self.on_device[i] = Some(mv);
        updated
    }

    /// Puts the LoRA adapters among the optimizer's parameters `names` in DS-Chat's LoRA group: learning rate `lora_lr` where
    /// the schedule peaks at `max_lr`. torch's `LambdaLR` multiplies every group's initial lr by
    /// the same factor, so the adapters run at `lr(step) * lora_lr / max_lr` throughout. Weight
    /// decay stays as for any weight: DS-Chat's LoRA group carries `weight_decay`.
    pub fn set_lora_lr(&mut self, names: &[String], lora_lr: f64, max_lr: f64) {
        for (scale, name) in self.lr_scale.iter_mut().zip(names) {
            if lora::is_adapter_name(name) {
                assert!(max_lr > 0.0, "the schedule's peak learning rate must be positive, got {max_lr}");
                *scale = lora_lr / max_lr;
            }
        }
    }

    /// One update of every parameter with its gradient (same order as `params`).
    pub fn step(&mut self, params: &ParamStore, grads: &[Tensor], lr: f64) -> Result<()> {
        assert_eq!(grads.len(), params.vars.len(), "one gradient per parameter");
        assert!(
            self.held.iter().zip(&params.vars).all(|(h, v)| h.start == 0 && h.end == v.elem_count()),
            "a sharded optimizer steps through training::zero"
        );
        self.step += 1;
        for (i, (var, g)) in params.vars.iter().zip(grads).enumerate() {
            let wd = if self.decay[i] { self.config.weight_decay } else { 0.0 };
            let lr = lr * self.lr_scale[i];
            if in_place_f32_cpu(var.as_tensor(), g) && !crate::kernels::ops::reference_ops() {
                // The parameter's own storage, updated in place: no copies in or out.
                let (m, v) = (&mut self.exp_avg[i], &mut self.exp_avg_sq[i]);
                let op = InPlaceAdamW { moments: RefCell::new((m, v)), lr, wd, step: self.step, config: &self.config };
                var.as_tensor().inplace_op2(g, &op)?;
            } else {
                // On the parameter's device, moments and all (uploaded from the host once).
                let mv = self.take_device_moments(i, var.device())?;
                let k = StepCoefficients::new(lr, wd, self.step, &self.config);
                let mv = if in_place_f32(var.as_tensor(), g) && !crate::kernels::ops::reference_ops() {
                    adamw_update_in_place(var.as_tensor(), g, &mv, &k)?;
                    mv
                } else {
                    let n = var.elem_count();
                    let (m, v) = (mv.narrow(0, 0, n)?.reshape(var.shape())?, mv.narrow(0, n, n)?.reshape(var.shape())?);
                    let (p, m, v) = adamw_update_tensors(var.as_tensor(), g, &m, &v, &k)?;
                    var.set(&p)?;
                    Tensor::cat(&[m.flatten_all()?, v.flatten_all()?], 0)?
                };
                self.on_device[i] = Some(mv);
            }
        }
        Ok(())
    }

    /// Parameter `i`'s moments on `device`, m then v in one f32 tensor: kept there since the last
    /// step, else uploaded from the host buffers.
    fn take_device_moments(&mut self, i: usize, device: &candle_core::Device) -> Result<Tensor> {
        Ok(match self.on_device[i].take() {
            Some(mv) => mv,
            None => {
                let both = [self.exp_avg[i].as_slice(), &self.exp_avg_sq[i]].concat();
                let n = both.len();
                Tensor::from_vec(both, n, device)?
            }
        })
    }

    /// Whether [`Self::step_fused`] takes this step: every master an f32 parameter on one CUDA
    /// device, every gradient f32, bf16 or f16 there, each compute-copy weight the master itself
    /// or a bf16/f16 tensor there, all contiguous, and the optimizer whole (not a ZeRO shard).
    pub fn fuses(&self, params: &ParamStore, grads: &[Tensor], compute: &ParamStore) -> bool {
        if !cfg!(feature = "cuda") || crate::kernels::ops::reference_ops() {
            return false;
        }
        let Some(first) = params.vars.first() else { return false };
        let on_gpu = |t: &Tensor| t.device().is_cuda() && t.device().same_device(first.device()) && t.is_contiguous();
        let half = |t: &Tensor| matches!(t.dtype(), DType::BF16 | DType::F16);
        grads.len() == params.vars.len()
            && compute.vars.len() == params.vars.len()
            && params.vars.iter().zip(&self.held).all(|(v, h)| h.start == 0 && h.end == v.elem_count())
            && params.vars.iter().zip(grads).zip(&compute.vars).all(|((p, g), c)| {
                on_gpu(p)
                    && p.dtype() == DType::F32
                    && on_gpu(g)
                    && (g.dtype() == DType::F32 || half(g))
                    && g.elem_count() == p.elem_count()
                    && (c.as_tensor().id() == p.as_tensor().id()
                        || (on_gpu(c) && half(c) && c.elem_count() == p.elem_count()))
            })
    }

    /// [`Self::step`] on a GPU in one launch for the whole model, with the work around it fused
    /// in (cuda/adamw.cu's `adamw_multi_tensor`): each gradient read in its own dtype and
    /// multiplied by `grad_scale` (the clipping coefficient, the accumulation and loss-scale
    /// correction), and each updated master rounded into its weight in `compute` where that is a
    /// bf16/f16 copy (what [`ParamStore::refresh_from`] does after [`Self::step`]). With
    /// `grad_scale` 1 the same bits as [`Self::step`] then `refresh_from`. Call only where
    /// [`Self::fuses`] says it takes the step.
    pub fn step_fused(
        &mut self,
        params: &ParamStore,
        grads: &[Tensor],
        lr: f64,
        grad_scale: f64,
        compute: &ParamStore,
    ) -> Result<()> {
        if !self.fuses(params, grads, compute) {
            bail!("internal error: the fused AdamW step was called where it does not apply");
        }
        self.step += 1;
        let device = params.vars[0].device().clone();
        let moments: Vec<Tensor> =
            (0..params.vars.len()).map(|i| self.take_device_moments(i, &device)).collect::<Result<_>>()?;
        let updated = self.launch_fused(params, grads, &moments, lr, grad_scale, compute);
        // Kept on the device whether or not the launch went: they are the moments' truth.
        self.on_device = moments.into_iter().map(Some).collect();
        updated
    }

    #[cfg(feature = "cuda")]
    fn launch_fused(
        &self,
        params: &ParamStore,
        grads: &[Tensor],
        moments: &[Tensor],
        lr: f64,
        grad_scale: f64,
        compute: &ParamStore,
    ) -> Result<()> {
        use crate::kernels::ops::adamw::{adamw_multi_tensor, AdamWShared, AdamWTensor};
        // The coefficients rounded to f32 as the per-parameter update rounds them.
        let shared = StepCoefficients::new(lr, 0.0, self.step, &self.config);
        let tensors: Vec<AdamWTensor> = (0..params.vars.len())
            .map(|i| {
                let wd = if self.decay[i] { self.config.weight_decay } else { 0.0 };
                let k = StepCoefficients::new(lr * self.lr_scale[i], wd, self.step, &self.config);
                let (param, copy) = (params.vars[i].as_tensor(), compute.vars[i].as_tensor());
                AdamWTensor {
                    param,
                    grad: &grads[i],
                    moments: &moments[i],
                    copy: (copy.id() != param.id()).then_some(copy),
                    decay: k.decay,
                    step_size: k.step_size,
                }
            })
            .collect();
        let shared = AdamWShared {
            grad_scale: grad_scale as f32,
            b1: shared.b1,
            one_minus_b1: 1.0 - shared.b1,
            b2: shared.b2,
            one_minus_b2: 1.0 - shared.b2,
            bc2_sqrt: shared.bc2_sqrt,
            eps: shared.eps,
        };
        Ok(adamw_multi_tensor(&tensors, shared)?)
    }

    #[cfg(not(feature = "cuda"))]
    fn launch_fused(&self, _: &ParamStore, _: &[Tensor], _: &[Tensor], _: f64, _: f64, _: &ParamStore) -> Result<()> {
        bail!("internal error: the fused AdamW step runs on CUDA, and this build has none")
    }

    /// Moments keyed `exp_avg.<param>` / `exp_avg_sq.<param>` for a checkpoint.
    pub fn state_tensors(&self, params: &ParamStore) -> Result<Vec<(String, Tensor)>> {
        if self.held.iter().zip(&params.vars).any(|(h, v)| h.start != 0 || h.end != v.elem_count()) {
            bail!("internal error: a sharded optimizer's state is saved after training::zero::consolidate");
        }
        let mut out = Vec::new();
        for (i, (name, var)) in params.iter().enumerate() {
            let dev = &candle_core::Device::Cpu;
            let (m, v) = self.held_moments(i)?;
            out.push((format!("exp_avg.{name}"), Tensor::from_slice(&m, var.shape(), dev)?));
            out.push((format!("exp_avg_sq.{name}"), Tensor::from_slice(&v, var.shape(), dev)?));
        }
        Ok(out)
    }

    /// Restores moments written by [`Self::state_tensors`], checking every shape.
    pub fn load_state(&mut self, params: &ParamStore, step: u64, tensors: &HashMap<String, Tensor>) -> Result<()> {
        for (i, (name, var)) in params.iter().enumerate() {
            for (key, slot) in [("exp_avg", &mut self.exp_avg[i]), ("exp_avg_sq", &mut self.exp_avg_sq[i])] {
                let k = format!("{key}.{name}");
                let Some(t) = tensors.get(&k) else {
                    bail!("optimizer state lacks {k}: the checkpoint does not match this model")
                };
                if t.dims() != var.dims() {
                    bail!("optimizer state {k} has shape {:?}, the model needs {:?}", t.dims(), var.dims());
                }
                // A sharded optimizer keeps its own pieces of the full moments.
                let held = self.held[i].clone();
                *slot =
                    t.to_dtype(candle_core::DType::F32)?.flatten_all()?.narrow(0, held.start, held.len())?.to_vec1()?;
            }
            // The loaded host buffers are the truth; the next device step uploads them.
            self.on_device[i] = None;
        }
        self.step = step;
        Ok(())
    }
}

/// An optimizer a save writes: the trainer's own where it holds the whole state (one rank, or
/// stage 0), borrowed, not copied (a copy of both moments is 8 bytes a parameter: on a GPU the
/// whole model's moments again on the device), or one put together from the ranks' shards.
pub enum SavedOptimizer<'a> {
    Held(&'a AdamW),
    Gathered(AdamW),
}

impl std::ops::Deref for SavedOptimizer<'_> {
    type Target = AdamW;

    fn deref(&self) -> &AdamW {
        match self {
            Self::Held(optimizer) => optimizer,
            Self::Gathered(optimizer) => optimizer,
        }
    }
}

/// A device's moments buffer (m then v, f32) as host vectors.
fn split_moments(mv: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = mv.elem_count() / 2;
    Ok((mv.narrow(0, 0, n)?.to_vec1()?, mv.narrow(0, n, n)?.to_vec1()?))
}

/// [`adamw_update`] composed of candle ops on the parameter's device, in the same f32
/// arithmetic operation by operation (each product, quotient and sum rounded as there, so it is
/// bit-identical on the CPU): returns the new parameter and moments. For a parameter the
/// in-place kernels do not take (not f32), and the reference they are tested against.
fn adamw_update_tensors(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    k: &StepCoefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    let StepCoefficients { b1, b2, step_size, bc2_sqrt, decay, eps } = *k;
    let g = g.to_dtype(DType::F32)?;
    // `x * k + 0`: one rounded product, as `k * x` in adamw_update.
    let times = |t: &Tensor, k: f32| t.affine(f64::from(k), 0.0);
    let m = (times(m, b1)? + times(&g, 1.0 - b1)?)?;
    let v = (times(v, b2)? + times(&g, 1.0 - b2)?.mul(&g)?)?;
    let denom = v.sqrt()?.broadcast_div(&Tensor::new(bc2_sqrt, p.device())?)?.affine(1.0, f64::from(eps))?;
    let p = (times(p, decay)? - times(&m, step_size)?.div(&denom)?)?;
    Ok((p, m, v))
}

/// Whether AdamW can update `p` in place from `g`: both contiguous f32 of one shape.
fn in_place_f32(p: &Tensor, g: &Tensor) -> bool {
    [p, g].iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous()) && p.dims() == g.dims()
}

/// [`in_place_f32`] on the CPU: the fused update with the moments on the host.
fn in_place_f32_cpu(p: &Tensor, g: &Tensor) -> bool {
    in_place_f32(p, g) && p.device().is_cpu() && g.device().is_cpu()
}

/// [`adamw_update`] of `p` in place on its device, its moments `mv` (m then v, 2n f32 values,
/// contiguous) too: the moments pass, then the parameter pass. On a GPU these are the kernels of
/// cuda/adamw.cu (two launches a parameter instead of a dozen candle ops and their temporaries);
/// on the CPU the same arithmetic, so that the path is tested there against the fused update.
fn adamw_update_in_place(p: &Tensor, g: &Tensor, mv: &Tensor, k: &StepCoefficients) -> Result<()> {
    mv.inplace_op2(g, &InPlacePass::Moments(k))?;
    p.inplace_op2(mv, &InPlacePass::Param(k))?;
    Ok(())
}

/// What the in-place ops' errors call their operands.
const OPERAND: &str = "an in-place AdamW operand";

/// One pass of [`adamw_update_in_place`], updating its first operand from its second: the
/// moments (m then v) from the gradient, or the parameter from the new moments.
#[derive(Clone, Copy)]
enum InPlacePass<'a> {
    Moments(&'a StepCoefficients),
    Param(&'a StepCoefficients),
}

impl InplaceOp2 for InPlacePass<'_> {
    fn name(&self) -> &'static str {
        match self {
            Self::Moments(_) => "adamw-moments",
            Self::Param(_) => "adamw-param",
        }
    }

    fn cpu_fwd(&self, out: &mut CpuStorage, lo: &Layout, input: &CpuStorage, li: &Layout) -> candle_core::Result<()> {
        let (out, input) = (contiguous_f32_mut(out, lo, OPERAND)?, contiguous_f32(input, li, OPERAND)?);
        match *self {
            Self::Moments(k) if out.len() == 2 * input.len() => {
                let (m, v) = out.split_at_mut(input.len());
                for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(input) {
                    k.update_moments(m, v, g);
                }
            }
            Self::Param(k) if input.len() == 2 * out.len() => {
                let (m, v) = input.split_at(out.len());
                for ((p, &m), &v) in out.iter_mut().zip(m).zip(v) {
                    *p = k.updated_param(*p, m, v);
                }
            }
            _ => candle_core::bail!("{}: {} values from {}", self.name(), out.len(), input.len()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        lo: &Layout,
        input: &candle_core::CudaStorage,
        li: &Layout,
    ) -> candle_core::Result<()> {
        let (pass, coefficients) = match *self {
            Self::Moments(k) => ("moments", [k.b1, 1.0 - k.b1, k.b2, 1.0 - k.b2]),
            Self::Param(k) => ("param", [k.decay, k.step_size, k.bc2_sqrt, k.eps]),
        };
        crate::kernels::ops::adamw::adamw_pass(pass, (out, lo), (input, li), coefficients)
    }
}

/// [`adamw_update`] as a candle in-place op on a CPU f32 parameter, its moments borrowed.
struct InPlaceAdamW<'a> {
    moments: RefCell<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
    lr: f64,
    wd: f64,
    step: u64,
    config: &'a AdamWConfig,
}

impl InplaceOp2 for InPlaceAdamW<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, p: &mut CpuStorage, lp: &Layout, g: &CpuStorage, lg: &Layout) -> candle_core::Result<()> {
        let (p, g) = (contiguous_f32_mut(p, lp, OPERAND)?, contiguous_f32(g, lg, OPERAND)?);
        let (m, v) = &mut *self.moments.borrow_mut();
        adamw_update(p, g, m, v, self.lr, self.wd, self.step, self.config);
        Ok(())
    }
}

/// Where `t`'s values live: tensors that share memory give the same address.
fn memory_of(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const candle_core::Storage as usize
}

/// Whether `held` can be added into `formed` in place: both contiguous f32 in host memory, of
/// one shape.
fn adds_in_place(formed: &Tensor, held: &Tensor) -> bool {
    let host_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous();
    host_f32(formed) && host_f32(held) && formed.shape() == held.shape()
}

/// `dst += src`, both contiguous f32 in host memory ([`GradAccumulator::add_formed`]).
struct AddInto;

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, d: &mut CpuStorage, ld: &Layout, s: &CpuStorage, ls: &Layout) -> candle_core::Result<()> {
        let what = "a gradient added in place";
        let (d, s) = (contiguous_f32_mut(d, ld, what)?, contiguous_f32(s, ls, what)?);
        d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
        Ok(())
    }
}

/// Sums gradients over micro-batches, one slot per parameter of the store the model was built
/// from (in mixed precision, the compute-dtype copy). A slot holds the first micro-batch's
/// gradient as backward made it (bf16/f16 in mixed precision: no copy, no cast) and the sum in
/// f32 from the second on. [`Self::finish`] hands out f32 (a bf16/f16 value is exact in f32, so
/// upcasting at the end is upcasting at once); [`Self::finish_in_compute_dtype`] hands them out
/// as held, for the GPU's fused optimizer step, which reads them in their dtype.
pub struct GradAccumulator {
    vars: Vec<Var>,
    names: Vec<String>,
    grads: Vec<Option<Tensor>>,
    /// Where complete gradients go instead of being held (ZeRO stage 2's buckets).
    sink: Option<Box<dyn GradientSink>>,
    /// The most gradient values held at once since this accumulator was made.
    peak_held: usize,
}

/// What takes gradients off an accumulator as backward completes them, instead of holding them
/// to the step: ZeRO stage 2 reduce-scatters them in buckets
/// ([`crate::training::zero::GradientBuckets`]) into this rank's shard of their sum.
pub trait GradientSink {
    /// Takes out of `grads` (one slot per accumulated parameter, the micro-batch's so far)
    /// what it hands on now; `last`: the micro-batch's backward is over, take them all.
    fn take(&mut self, grads: &mut [Option<Tensor>], last: bool) -> Result<()>;
    /// This rank's shard of the gradients handed on since the last call (summed over ranks
    /// and micro-batches), emptied.
    fn take_reduced(&mut self) -> Result<Tensor>;
    /// The same so far, left in place (for an overflow check).
    fn partial(&self) -> Result<Option<Tensor>>;
    /// How many reductions a micro-batch's gradients are handed on in.
    fn buckets(&self) -> usize;
}

impl GradAccumulator {
    pub fn new(params: &ParamStore) -> Self {
        Self::over(params.vars.clone(), params.names.clone())
    }

    fn over(vars: Vec<Var>, names: Vec<String>) -> Self {
        let grads = vec![None; vars.len()];
        Self { vars, names, grads, sink: None, peak_held: 0 }
    }

    /// Hands complete gradients to `sink` rather than holding them ([`Self::part_done`],
    /// [`Self::end_micro_batch`]).
    pub fn with_sink(mut self, sink: Box<dyn GradientSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Whether complete gradients go to a sink: backward then hands them over part by part.
    pub fn streams(&self) -> bool {
        self.sink.is_some()
    }

    /// How many reductions the sink hands a micro-batch's gradients on in, if there is one.
    pub fn sink_buckets(&self) -> Option<usize> {
        self.sink.as_ref().map(|s| s.buckets())
    }

    /// A part of backward ended (a block's, the embeddings'): the sink takes what is complete.
    pub fn part_done(&mut self) -> Result<()> {
        match &mut self.sink {
            Some(sink) => sink.take(&mut self.grads, false),
            None => Ok(()),
        }
    }

    /// The micro-batch's backward is over: the sink takes every gradient left.
    pub fn end_micro_batch(&mut self) -> Result<()> {
        match &mut self.sink {
            Some(sink) => sink.take(&mut self.grads, true),
            None => Ok(()),
        }
    }

    /// The sink's reduced gradients (see [`GradientSink::take_reduced`]).
    pub fn take_reduced(&mut self) -> Result<Tensor> {
        match &mut self.sink {
            Some(sink) => sink.take_reduced(),
            None => anyhow::bail!("internal error: no gradient sink"),
        }
    }

    /// Adds the gradients a backward pass produced for the accumulator's parameters.
    pub fn add(&mut self, store: &GradStore) -> Result<()> {
        for (slot, var) in self.grads.iter_mut().zip(&self.vars) {
            if let Some(g) = store.get(var.as_tensor()) {
                // candle does not detach the gradients of variables: a kept gradient would
                // hold the graph of its computation (the step's activations) alive.
                let g = g.detach();
                *slot = Some(match slot.take() {
                    Some(acc) => (acc.to_dtype(DType::F32)? + g.to_dtype(DType::F32)?)?,
                    None => g,
                });
            }
        }
        let held = self.grads.iter().flatten().map(Tensor::elem_count).sum();
        self.peak_held = self.peak_held.max(held);
        Ok(())
    }

    /// [`Self::add`] of gradients a backward formed afresh, the store consumed: where a slot
    /// already holds a gradient, that one is added into the new one in place (both f32 in host
    /// memory), the same bits as their sum in a third tensor. The tied embedding's gradient meets
    /// the LM head's so at the end of a backward run by parts (ZeRO-2's buckets, checkpointed
    /// activations): two (V, C) tensors at once instead of three. The caller makes sure no
    /// tensor outside the store shares a gradient's memory (an op's own backward output, as the
    /// embedding lookup's); within the store and against the held ones it is checked here.
    pub fn add_formed(&mut self, mut store: GradStore) -> Result<()> {
        let formed: Vec<(usize, Tensor)> = self
            .vars
            .iter()
            .enumerate()
            .filter_map(|(i, var)| store.remove(var.as_tensor()).map(|g| (i, g.detach())))
            .collect();
        drop(store);
        let memory: Vec<usize> = formed.iter().map(|(_, g)| memory_of(g)).collect();
        for (k, (i, g)) in formed.into_iter().enumerate() {
            let shared = |held: &Tensor| {
                let held = memory_of(held);
                memory.iter().enumerate().any(|(j, &m)| (j != k && m == memory[k]) || m == held)
            };
            let slot = &mut self.grads[i];
            *slot = Some(match slot.take() {
                Some(held) if adds_in_place(&g, &held) && !shared(&held) => {
                    g.inplace_op2(&held, &AddInto)?;
                    g
                }
                Some(held) => (held.to_dtype(DType::F32)? + g.to_dtype(DType::F32)?)?,
                None => g,
            });
        }
        let held = self.grads.iter().flatten().map(Tensor::elem_count).sum();
        self.peak_held = self.peak_held.max(held);
        Ok(())
    }

    /// The most gradient values this accumulator held at once (what ZeRO-2's buckets bound).
    pub fn peak_held_values(&self) -> usize {
        self.peak_held
    }

    /// The summed gradients in f32; a parameter that got none is an error in our code, not the
    /// user's.
    pub fn finish(self) -> Result<Vec<Tensor>> {
        self.finish_in_compute_dtype()?.iter().map(|g| Ok(g.to_dtype(DType::F32)?)).collect()
    }

    /// The summed gradients as held: the compute dtype after one micro-batch, else f32.
    pub fn finish_in_compute_dtype(self) -> Result<Vec<Tensor>> {
        self.grads
            .into_iter()
            .zip(&self.names)
            .map(|(g, name)| g.ok_or_else(|| anyhow::anyhow!("internal error: parameter {name} received no gradient")))
            .collect()
    }

    /// The gradients summed so far in f32 (parameters without one yet left out), and what a
    /// sink reduced of them.
    pub fn partial(&self) -> Result<Vec<Tensor>> {
        let mut out: Vec<Tensor> =
            self.grads.iter().flatten().map(|g| g.to_dtype(DType::F32)).collect::<candle_core::Result<_>>()?;
        if let Some(reduced) = self.sink.as_ref().map(|s| s.partial()).transpose()?.flatten() {
            out.push(reduced);
        }
        Ok(out)
    }

    /// A fresh, empty accumulator over the same parameters.
    pub fn emptied(&self) -> Self {
        Self::over(self.vars.clone(), self.names.clone())
    }
}

/// The L2 norm of all gradients together. On a GPU the sums of squares of all of them are one
/// launch and one copy to the host (`ops::grad_norm::sum_of_squares_on_device`), in f64 as on the CPU.
pub fn global_grad_norm(grads: &[Tensor]) -> Result<f64> {
    if let Some(sum) = crate::kernels::ops::grad_norm::sum_of_squares_on_device(grads)? {
        return Ok(sum.sqrt());
    }
    let mut sum = 0f64;
    for g in grads {
        sum += crate::kernels::ops::sum_of_squares(g)?;
    }
    Ok(sum.sqrt())
}

/// One optimizer step of a single process on whole gradients (as [`GradAccumulator`] hands
/// them out, in any float dtype): their global norm, clipping to `max_norm`, AdamW at `lr`, and
/// the compute copy refreshed from the masters. On a GPU two launches for the norm and one for
/// the rest ([`AdamW::step_fused`]); elsewhere on f32 gradients, one parameter at a time.
/// Returns the norm before clipping.
pub fn clip_and_step(
    opt: &mut AdamW,
    params: &ParamStore,
    compute: &ParamStore,
    grads: Vec<Tensor>,
    lr: f64,
    max_norm: f64,
) -> Result<f64> {
    if opt.fuses(params, &grads, compute) {
        let norm = global_grad_norm(&grads)?;
        opt.step_fused(params, &grads, lr, clip_coefficient(norm, max_norm), compute)?;
        return Ok(norm);
    }
    let mut grads: Vec<Tensor> = grads.iter().map(|g| g.to_dtype(DType::F32)).collect::<candle_core::Result<_>>()?;
    let norm = clip_grad_norm(&mut grads, max_norm)?;
    opt.step(params, &grads, lr)?;
    compute.refresh_from(params)?;
    Ok(norm)
}

/// Scales gradients so their global norm is at most `max_norm` (Megatron `clip_grad_norm`:
/// coefficient max_norm / (norm + 1e-6), applied only when below 1). Returns the norm before.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let norm = global_grad_norm(grads)?;
    clip_to_norm(grads, norm, max_norm)?;
    Ok(norm)
}

/// [`clip_grad_norm`] with the global `norm` already computed.
pub fn clip_to_norm(grads: &mut [Tensor], norm: f64, max_norm: f64) -> Result<()> {
    let coeff = clip_coefficient(norm, max_norm);
    if coeff < 1.0 {
        for g in grads.iter_mut() {
            *g = (&*g * coeff)?;
        }
    }
    Ok(())
}

/// What clipping to `max_norm` multiplies gradients of global norm `norm` by (Megatron's
/// `max_norm / (norm + 1e-6)`, only when below 1; 1 without clipping, `max_norm` 0).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gpt2::Gpt2Config;
    use candle_core::Device;

    #[test]
    fn decay_groups_exclude_biases_and_layer_norms() {
        assert!(no_weight_decay("h.0.attn.c_attn.bias"));
        assert!(no_weight_decay("h.3.ln_1.weight"));
        assert!(no_weight_decay("ln_f.weight"));
        assert!(!no_weight_decay("h.0.mlp.c_fc.weight"));
        assert!(!no_weight_decay("wte.weight"));
    }

    #[test]
    fn adamw_matches_hand_computed_two_steps() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 4, n_head: 1, n_positions: 2, vocab_size: 3, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        let c = AdamWConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut opt = AdamW::new(c, &params)?;
        let w0: Vec<f32> = params.get("wte.weight").unwrap().flatten_all()?.to_vec1()?;
        let b0: Vec<f32> = params.get("ln_f.bias").unwrap().flatten_all()?.to_vec1()?;
        let grads_at =
            |g: f32| -> Result<Vec<Tensor>> { params.vars.iter().map(|v| Ok((v.ones_like()? * g as f64)?)).collect() };
        let lr = 0.01;
        opt.step(&params, &grads_at(0.5)?, lr)?;
        opt.step(&params, &grads_at(-1.0)?, lr)?;
        // By hand (f64): m1 = 0.05, v1 = 0.0025; m2 = 0.045 - 0.1 = -0.055, v2 = 0.002475 + 0.01.
        let (m1, v1) = (0.05f64, 0.0025f64);
        let (m2, v2) = (0.9 * m1 - 0.1, 0.99 * v1 + 0.01);
        let upd =
            |m: f64, v: f64, t: i32| lr * (m / (1.0 - 0.9f64.powi(t))) / ((v / (1.0 - 0.99f64.powi(t))).sqrt() + 1e-8);
        let decayed = |p: f64| (p * (1.0 - lr * 0.1) - upd(m1, v1, 1)) * (1.0 - lr * 0.1) - upd(m2, v2, 2);
        let plain = |p: f64| p - upd(m1, v1, 1) - upd(m2, v2, 2);
        let w2: Vec<f32> = params.get("wte.weight").unwrap().flatten_all()?.to_vec1()?;
        let b2: Vec<f32> = params.get("ln_f.bias").unwrap().flatten_all()?.to_vec1()?;
        for (a, b) in w0.iter().zip(&w2) {
            assert!((decayed(*a as f64) - *b as f64).abs() < 1e-6, "decayed weight {a} -> {b}");
        }
        for (a, b) in b0.iter().zip(&b2) {
            assert!((plain(*a as f64) - *b as f64).abs() < 1e-6, "bias {a} -> {b} (no decay)");
        }
        Ok(())
    }

    #[test]
    fn lora_adapters_run_at_their_own_learning_rate_on_the_same_schedule() -> Result<()> {
        let mut params = ParamStore::default();
        let zeros = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)?;
        for name in ["h.0.attn.c_attn.weight", "h.0.attn.c_attn.lora_A.weight", "h.0.attn.c_attn.lora_B.weight"] {
            params.push(name, &zeros)?;
        }
        // DS-Chat's LoRA group keeps weight_decay (`get_optimizer_grouped_parameters`).
        assert!(params.names.iter().all(|n| !no_weight_decay(n)));
        let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() }, &params)?;
        opt.set_lora_lr(&params.names, 5e-4, 1e-3);
        let grads: Vec<Tensor> = params.vars.iter().map(|v| v.ones_like()).collect::<candle_core::Result<_>>()?;
        // Halfway through a warmup the schedule gives half the peak; Adam's first step moves each
        // entry by its lr (|m / sqrt(v)| = 1): the base by 5e-4, the adapters by half of 5e-4.
        opt.step(&params, &grads, 0.5e-3)?;
        let moved: Vec<f32> = params
            .vars
            .iter()
            .map(|v| v.flatten_all()?.to_vec1::<f32>().map(|x| -x[0]))
            .collect::<candle_core::Result<_>>()?;
        for (got, want) in moved.iter().zip([0.5e-3f32, 0.25e-3, 0.25e-3]) {
            assert!((got - want).abs() < 1e-8, "moved {got}, want {want}");
        }
        Ok(())
    }

    #[test]
    fn ds_chat_runs_adam_with_its_betas_and_megatron_with_torchs() {
        // DS-Chat's `get_optimizer` passes betas=(0.9, 0.95); Megatron keeps torch's (0.9, 0.999).
        let ds = AdamWConfig::ds_chat(1e-6, 0.1);
        assert_eq!(ds, AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 });
        assert_eq!(AdamWConfig::default(), AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 });
    }

    /// One parameter's range (a literal one-range `vec!` reads as a mistake to clippy).
    fn only(range: Range<usize>) -> Vec<Range<usize>> {
        vec![range]
    }

    /// The moments of one parameter 0..10 after a step: m = (1-b1) g, v = (1-b2) g^2 with g = i.
    fn stepped_moments_0_to_10() -> AdamW {
        let names = vec!["h.0.mlp.c_fc.weight".to_string()];
        let mut opt = AdamW::over_ranges(AdamWConfig::default(), &names, only(0..10));
        opt.step = 1;
        let g: Vec<f32> = (0..10).map(|i| i as f32).collect();
        opt.update_held(0, &mut [0f32; 10], &g, 1e-3);
        opt
    }

    /// Keeping a range of a range already kept keeps those indices' moments, counted from the
    /// parameter's start, not from the held range's.
    #[test]
    fn keeping_part_of_a_kept_range_keeps_those_values() -> Result<()> {
        let mut opt = stepped_moments_0_to_10();
        let full = opt.held_moments(0)?.0.into_owned();
        opt.keep_only(&only(3..9));
        opt.keep_only(&only(5..8));
        assert_eq!(opt.held(0), 5..8);
        assert_eq!(opt.held_moments(0)?.0.as_ref(), &full[5..8]);
        Ok(())
    }

    /// Moments kept on a parameter's device since its last step (`update_held_in_place`) are
    /// brought back before a fill writes the host buffers: the fill lands, and the values it
    /// does not cover keep what the step made of them.
    #[test]
    fn filling_moments_kept_on_the_device_keeps_the_step_and_the_fill() -> Result<()> {
        let mut opt = stepped_moments_0_to_10();
        opt.step = 2;
        let (p, g) = (Tensor::zeros(10, DType::F32, &Device::Cpu)?, Tensor::ones(10, DType::F32, &Device::Cpu)?);
        opt.update_held_in_place(0, &p, &g, 1e-3)?;
        assert!(opt.on_device[0].is_some(), "the moments stay with the parameter");
        let (m_stepped, v_stepped) = {
            let (m, v) = opt.held_moments(0)?;
            (m.into_owned(), v.into_owned())
        };
        // A fill of 8..12 overlaps the held 0..10 in 8..10: two values copied.
        assert_eq!(opt.fill_held(0, 8..12, &[-1.0, -2.0, -3.0, -4.0], &[1.0, 2.0, 3.0, 4.0])?, 2);
        let (m, v) = opt.held_moments(0)?;
        assert_eq!(&m[..8], &m_stepped[..8], "the step's moments stay");
        assert_eq!(&v[..8], &v_stepped[..8]);
        assert_eq!((&m[8..], &v[8..]), (&[-1.0f32, -2.0][..], &[1.0f32, 2.0][..]), "the fill lands");
        assert_eq!(opt.fill_held(0, 10..12, &[0.0, 0.0], &[0.0, 0.0])?, 0, "no overlap, nothing copied");
        Ok(())
    }

    /// ZeRO's per-shard updates (`update_held` on host slices, `update_held_in_place` on a
    /// shard's tensor) run LoRA adapters at their own learning rate, as `step` does: Adam's
    /// first step moves each value by its learning rate.
    #[test]
    fn shard_updates_run_adapters_at_their_own_learning_rate() -> Result<()> {
        let names: Vec<String> =
            ["h.0.attn.c_attn.weight", "h.0.attn.c_attn.lora_A.weight", "h.0.attn.c_attn.lora_B.weight"]
                .map(String::from)
                .to_vec();
        let config = AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() };
        let mut opt = AdamW::over_ranges(config, &names, vec![2..5, 0..3, 0..3]);
        opt.set_lora_lr(&names, 2.5e-4, 1e-3);
        opt.step = 1;
        let (mut base, mut lora_a) = ([0f32; 3], [0f32; 3]);
        opt.update_held(0, &mut base, &[1.0; 3], 1e-3);
        opt.update_held(1, &mut lora_a, &[1.0; 3], 1e-3);
        let lora_b = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
        opt.update_held_in_place(2, &lora_b, &Tensor::ones(3, DType::F32, &Device::Cpu)?, 1e-3)?;
        // Within f32's rounding of `sqrt(v) / sqrt(bc2)` (about 1e-5 of the step).
        for (got, want) in [(base[0], -1e-3f32), (lora_a[0], -2.5e-4), (lora_b.to_vec1::<f32>()?[0], -2.5e-4)] {
            assert!((got / want - 1.0).abs() < 1e-4, "moved {got}, want {want}");
        }
        // A piece that is not the held range is refused, whichever side is wrong.
        let (two, three) = (Tensor::zeros(2, DType::F32, &Device::Cpu)?, Tensor::zeros(3, DType::F32, &Device::Cpu)?);
        for (p, g) in [(&two, &two), (&three, &two), (&two, &three)] {
            let err = opt.update_held_in_place(2, p, g, 1e-3).unwrap_err().to_string();
            assert!(err.contains("where 3 are held"), "{err}");
        }
        Ok(())
    }

    /// What the in-place update cannot take steps through candle's ops, to the same bits: a
    /// strided gradient, and a bf16 one (a half-precision compute copy's) of the same values.
    #[test]
    fn strided_and_half_gradients_step_as_contiguous_f32_ones() -> Result<()> {
        let start = Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))?;
        let grad = Tensor::new(&[[1f32, -2.0, 3.0], [0.5, 4.0, -1.0]], &Device::Cpu)?;
        let strided = grad.t()?.contiguous()?.t()?;
        assert!(!strided.is_contiguous());
        let mut moved = vec![];
        for g in [&grad, &strided, &grad.to_dtype(DType::BF16)?] {
            let mut params = ParamStore::default();
            params.push("h.0.mlp.c_fc.weight", &start)?;
            let mut opt = AdamW::new(AdamWConfig::default(), &params)?;
            for _ in 0..2 {
                opt.step(&params, std::slice::from_ref(g), 1e-2)?;
            }
            let (m, v) = opt.held_moments(0)?;
            moved.push((params.vars[0].flatten_all()?.to_vec1::<f32>()?, m.into_owned(), v.into_owned()));
        }
        assert_ne!(moved[0].0, start.flatten_all()?.to_vec1::<f32>()?, "the steps move the parameter");
        assert_eq!(moved[1], moved[0], "a strided gradient");
        assert_eq!(moved[2], moved[0], "a bf16 gradient");
        Ok(())
    }

    /// The in-place passes refuse moments that are not two values per parameter value, naming
    /// the pass, rather than update a part.
    #[test]
    fn in_place_passes_refuse_moments_of_another_size() -> Result<()> {
        let k = StepCoefficients::new(1e-3, 0.0, 1, &AdamWConfig::default());
        let (p, g) = (Tensor::zeros(3, DType::F32, &Device::Cpu)?, Tensor::ones(3, DType::F32, &Device::Cpu)?);
        let wrong = Tensor::zeros(8, DType::F32, &Device::Cpu)?;
        let err = adamw_update_in_place(&p, &g, &wrong, &k).unwrap_err().to_string();
        assert!(err.contains("adamw-moments: 8 values from 3"), "{err}");
        let err = p.inplace_op2(&wrong, &InPlacePass::Param(&k)).unwrap_err().to_string();
        assert!(err.contains("adamw-param: 3 values from 8"), "{err}");
        assert_eq!(wrong.to_vec1::<f32>()?, [0.0; 8], "nothing was written");
        Ok(())
    }

    /// A checkpoint's moments are whole: a ZeRO shard's optimizer is refused until consolidated,
    /// whether its range starts late or ends early.
    #[test]
    fn a_sharded_optimizers_state_is_refused() -> Result<()> {
        let mut params = ParamStore::default();
        params.push("h.0.mlp.c_fc.weight", &Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?)?;
        let whole = AdamW::over_ranges(AdamWConfig::default(), &params.names, only(0..6));
        assert_eq!(whole.state_tensors(&params)?.len(), 2);
        for held in [2..6, 0..4] {
            let err = AdamW::over_ranges(AdamWConfig::default(), &params.names, only(held))
                .state_tensors(&params)
                .unwrap_err()
                .to_string();
            assert!(err.contains("after training::zero::consolidate"), "{err}");
        }
        Ok(())
    }

    /// The device path (candle ops, moments kept as tensors: a GPU's), run on the CPU with the
    /// reference ops, against the fused in-place kernel: three steps, the saved state, a reload
    /// and one more step, all bit for bit.
    #[test]
    fn adamw_on_the_parameters_device_is_the_fused_update_bit_for_bit() -> Result<()> {
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 4, vocab_size: 11, ..Gpt2Config::tiny() };
        let (fused, device) = (ParamStore::init(&cfg, 3, &Device::Cpu)?, ParamStore::init(&cfg, 3, &Device::Cpu)?);
        let c = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let (mut fused_opt, mut device_opt) = (AdamW::new(c.clone(), &fused)?, AdamW::new(c.clone(), &device)?);
        let grads_at = |step: usize| -> Result<Vec<Tensor>> {
            fused.vars.iter().map(|v| Ok((v.as_tensor().sin()? * (step as f64 - 1.3))?)).collect()
        };
        let same = |a: &ParamStore, b: &ParamStore| -> Result<()> {
            for ((name, x), (_, y)) in a.iter().zip(b.iter()) {
                assert_eq!(x.flatten_all()?.to_vec1::<f32>()?, y.flatten_all()?.to_vec1::<f32>()?, "{name}");
            }
            Ok(())
        };
        for step in 0..3 {
            let grads = grads_at(step)?;
            fused_opt.step(&fused, &grads, 1e-2)?;
            crate::kernels::ops::with_reference_ops(|| device_opt.step(&device, &grads, 1e-2))?;
            same(&fused, &device)?;
        }
        assert!(device_opt.on_device.iter().all(Option::is_some), "the moments stay on the parameters' device");
        let (saved_fused, saved_device) = (fused_opt.state_tensors(&fused)?, device_opt.state_tensors(&device)?);
        for ((k, a), (l, b)) in saved_fused.iter().zip(&saved_device) {
            assert_eq!(k, l);
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{k}");
        }
        // Reloaded, the host buffers are uploaded again by the next step.
        let mut reloaded = AdamW::new(c, &device)?;
        reloaded.load_state(&device, device_opt.step, &saved_device.into_iter().collect())?;
        let grads = grads_at(3)?;
        fused_opt.step(&fused, &grads, 1e-2)?;
        crate::kernels::ops::with_reference_ops(|| reloaded.step(&device, &grads, 1e-2))?;
        same(&fused, &device)
    }

    /// The in-place passes a GPU runs (here their CPU arithmetic) against the fused update:
    /// four steps of 1000 values with decay, bit for bit, parameter and moments.
    #[test]
    fn adamw_in_place_passes_are_the_fused_update_bit_for_bit() -> Result<()> {
        let n = 1000;
        let start: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0).collect();
        let (mut p, mut m, mut v) = (start.clone(), vec![0f32; n], vec![0f32; n]);
        let c = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let pt = Tensor::new(start.as_slice(), &Device::Cpu)?;
        let mv = Tensor::zeros(2 * n, DType::F32, &Device::Cpu)?;
        for step in 1..=4u64 {
            let g: Vec<f32> = (0..n).map(|i| ((i * 13 + step as usize * 7) % 29) as f32 / 7.0 - 2.0).collect();
            adamw_update(&mut p, &g, &mut m, &mut v, 3e-3, 0.1, step, &c);
            let k = StepCoefficients::new(3e-3, 0.1, step, &c);
            adamw_update_in_place(&pt, &Tensor::new(g.as_slice(), &Device::Cpu)?, &mv, &k)?;
            assert_eq!(pt.to_vec1::<f32>()?, p, "parameter after step {step}");
            assert_eq!(split_moments(&mv)?, (m.clone(), v.clone()), "moments after step {step}");
        }
        Ok(())
    }

    /// On a GPU (the CUDA build's unit tests, run by `scripts/gpu-check.sh`): `AdamW::step` on
    /// CUDA parameters (the kernels of cuda/adamw.cu) against the fused CPU update, bit for bit:
    /// three steps, the saved moments, a reload and a fourth step.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn adamw_cuda_kernels_are_the_fused_cpu_update_bit_for_bit() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        // 131 x 300 values: more than a block of 256 and not a multiple of it.
        let cfg =
            Gpt2Config { n_layer: 1, n_embd: 32, n_head: 2, n_positions: 8, vocab_size: 300, ..Gpt2Config::tiny() };
        let cpu = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        let on_gpu = ParamStore::init(&cfg, 3, &gpu)?;
        let c = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let (mut cpu_opt, mut gpu_opt) = (AdamW::new(c.clone(), &cpu)?, AdamW::new(c.clone(), &on_gpu)?);
        let grads_at = |step: usize, device: &Device| -> Result<Vec<Tensor>> {
            cpu.vars.iter().map(|v| Ok((v.as_tensor().sin()? * (step as f64 - 1.3))?.to_device(device)?)).collect()
        };
        let same = |a: &ParamStore, b: &ParamStore| -> Result<()> {
            for ((name, x), (_, y)) in a.iter().zip(b.iter()) {
                assert_eq!(x.flatten_all()?.to_vec1::<f32>()?, y.flatten_all()?.to_vec1::<f32>()?, "{name}");
            }
            Ok(())
        };
        same(&cpu, &on_gpu)?;
        for step in 0..3 {
            // Both from the parameters before the step (the CPU's step changes them).
            let (g_cpu, g_gpu) = (grads_at(step, &Device::Cpu)?, grads_at(step, &gpu)?);
            cpu_opt.step(&cpu, &g_cpu, 1e-2)?;
            gpu_opt.step(&on_gpu, &g_gpu, 1e-2)?;
            same(&cpu, &on_gpu)?;
        }
        let (saved_cpu, saved_gpu) = (cpu_opt.state_tensors(&cpu)?, gpu_opt.state_tensors(&on_gpu)?);
        for ((k, a), (_, b)) in saved_cpu.iter().zip(&saved_gpu) {
            assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?, "{k}");
        }
        let mut reloaded = AdamW::new(c, &on_gpu)?;
        reloaded.load_state(&on_gpu, gpu_opt.step, &saved_gpu.into_iter().collect())?;
        let (g_cpu, g_gpu) = (grads_at(3, &Device::Cpu)?, grads_at(3, &gpu)?);
        cpu_opt.step(&cpu, &g_cpu, 1e-2)?;
        reloaded.step(&on_gpu, &g_gpu, 1e-2)?;
        same(&cpu, &on_gpu)
    }

    /// The fused GPU step (one launch for the model) against the per-parameter CPU update of the
    /// gradients scaled alike and the compute copy cast after it, bit for bit: gradients in f32,
    /// bf16 and f16, copies in bf16 and f16 or none (fp32), three steps at two scales, with a
    /// tensor of more than one chunk (wte, 600 x 32 values) and weight decay on some.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn fused_gpu_step_is_the_per_parameter_update_then_the_cast_bit_for_bit() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let cfg =
            Gpt2Config { n_layer: 1, n_embd: 32, n_head: 2, n_positions: 8, vocab_size: 600, ..Gpt2Config::tiny() };
        let c = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
        };
        for grad_dtype in [DType::F32, DType::BF16, DType::F16] {
            for copy_dtype in [DType::F32, DType::BF16, DType::F16] {
                let cpu = ParamStore::init(&cfg, 3, &Device::Cpu)?;
                let on_gpu = ParamStore::init(&cfg, 3, &gpu)?;
                let compute = on_gpu.compute_copy(copy_dtype)?;
                let (mut cpu_opt, mut gpu_opt) = (AdamW::new(c.clone(), &cpu)?, AdamW::new(c.clone(), &on_gpu)?);
                for (step, scale) in [(0usize, 0.37f64), (1, 1.0), (2, 2.5)] {
                    // Gradients of the parameters before the step, in the dtype backward makes.
                    let grads: Vec<Tensor> = cpu
                        .vars
                        .iter()
                        .map(|v| Ok((v.as_tensor().sin()? * (step as f64 - 1.3))?.to_dtype(grad_dtype)?))
                        .collect::<Result<_>>()?;
                    let scaled: Vec<Tensor> = grads
                        .iter()
                        .map(|g| Ok((g.to_dtype(DType::F32)? * f64::from(scale as f32))?))
                        .collect::<Result<_>>()?;
                    cpu_opt.step(&cpu, &scaled, 1e-2)?;
                    let on_device: Vec<Tensor> =
                        grads.iter().map(|g| g.to_device(&gpu)).collect::<candle_core::Result<_>>()?;
                    assert!(gpu_opt.fuses(&on_gpu, &on_device, &compute));
                    gpu_opt.step_fused(&on_gpu, &on_device, 1e-2, scale, &compute)?;
                    let what = format!("gradients {grad_dtype:?}, copy {copy_dtype:?}, step {step}");
                    for (((name, want), (_, got)), copy) in cpu.iter().zip(on_gpu.iter()).zip(&compute.vars) {
                        assert_eq!(bits(want)?, bits(got)?, "{name}, {what}");
                        assert_eq!(
                            bits(&want.to_dtype(copy_dtype)?)?,
                            bits(copy.as_tensor())?,
                            "{name}'s copy, {what}"
                        );
                    }
                }
                for ((k, a), (_, b)) in cpu_opt.state_tensors(&cpu)?.iter().zip(&gpu_opt.state_tensors(&on_gpu)?) {
                    assert_eq!(bits(a)?, bits(b)?, "{k}");
                }
            }
        }
        Ok(())
    }

    /// The first micro-batch's gradients are held as backward made them (bf16 here), handed out
    /// as such by `finish_in_compute_dtype` and exactly upcast by `finish`; a second micro-batch
    /// sums in f32.
    #[test]
    fn accumulator_holds_one_micro_batch_in_its_dtype_and_sums_in_f32() -> Result<()> {
        let store = ParamStore::init(&Gpt2Config::tiny(), 1, &Device::Cpu)?.compute_copy(DType::BF16)?;
        // The gradient of the sum of every weight / 3: 1/3 rounded to bf16, each value.
        let backward = || -> Result<GradStore> {
            let mut loss = Tensor::zeros((), DType::BF16, &Device::Cpu)?;
            for v in &store.vars {
                loss = (loss + v.as_tensor().affine(1.0 / 3.0, 0.0)?.sum_all()?)?;
            }
            Ok(loss.backward()?)
        };
        let third = half::bf16::from_f64(1.0 / 3.0).to_f32();
        let values = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?) };
        let mut one = GradAccumulator::new(&store);
        one.add(&backward()?)?;
        assert!(one.partial()?.iter().all(|g| g.dtype() == DType::F32));
        for g in one.finish_in_compute_dtype()? {
            assert_eq!(g.dtype(), DType::BF16);
            assert!(values(&g)?.iter().all(|&v| v == third));
        }
        let mut two = GradAccumulator::new(&store);
        two.add(&backward()?)?;
        two.add(&backward()?)?;
        for g in two.finish()? {
            assert_eq!(g.dtype(), DType::F32);
            assert!(values(&g)?.iter().all(|&v| v == 2.0 * third));
        }
        Ok(())
    }

    /// A gradient formed afresh takes the held one in place: the same bits as the sum, and no
    /// tensor that shares memory with another (here the held gradient itself) is written to.
    #[test]
    fn formed_gradients_take_the_held_ones_in_place_without_touching_shared_memory() -> Result<()> {
        let store = ParamStore::init(&Gpt2Config::tiny(), 1, &Device::Cpu)?;
        let backward = |scale: f64| -> Result<GradStore> {
            let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
            for v in &store.vars {
                loss = (loss + v.as_tensor().sqr()?.affine(scale, 0.0)?.sum_all()?)?;
            }
            Ok(loss.backward()?)
        };
        let values = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        let (first, second) = (backward(0.3)?, backward(0.7)?);
        let want: Vec<Vec<f32>> = store
            .vars
            .iter()
            .map(|v| values(&(first.get(v.as_tensor()).unwrap() + second.get(v.as_tensor()).unwrap())?))
            .collect::<Result<_>>()?;
        let formed: Vec<usize> = store.vars.iter().map(|v| memory_of(second.get(v.as_tensor()).unwrap())).collect();
        let mut acc = GradAccumulator::new(&store);
        acc.add(&first)?;
        acc.add_formed(second)?;
        let slots: Vec<usize> = acc.grads.iter().map(|g| memory_of(g.as_ref().unwrap())).collect();
        assert_eq!(slots, formed, "each sum is in the formed gradient's memory");
        let apart: std::collections::HashSet<usize> = formed.iter().copied().collect();
        assert_eq!(apart.len(), formed.len(), "each formed gradient has memory of its own");
        for (g, want) in acc.finish()?.iter().zip(&want) {
            assert_eq!(&values(g)?, want, "the in-place sum is the sum");
        }
        // The store's own gradients handed in again share the held ones' memory: summed apart.
        let again = backward(0.3)?;
        let before: Vec<Vec<f32>> =
            store.vars.iter().map(|v| values(again.get(v.as_tensor()).unwrap())).collect::<Result<_>>()?;
        let kept: Vec<Tensor> = store.vars.iter().map(|v| again.get(v.as_tensor()).unwrap().clone()).collect();
        let mut acc = GradAccumulator::new(&store);
        acc.add(&again)?;
        acc.add_formed(again)?;
        for ((t, before), g) in kept.iter().zip(&before).zip(acc.finish()?) {
            assert_eq!(&values(t)?, before, "memory the held gradient shares is left alone");
            assert_eq!(values(&g)?, before.iter().map(|x| x + x).collect::<Vec<_>>());
        }
        // Gradients of a bf16 compute copy are summed apart, in f32: onto a bf16 first
        // gradient, and onto an f32 sum of two.
        let half = store.compute_copy(DType::BF16)?;
        let backward = || -> Result<GradStore> {
            let mut loss = Tensor::zeros((), DType::BF16, &Device::Cpu)?;
            for v in &half.vars {
                loss = (loss + v.as_tensor().sum_all()?)?;
            }
            Ok(loss.backward()?)
        };
        for held in 1..=2 {
            let mut acc = GradAccumulator::new(&half);
            for _ in 0..held {
                acc.add(&backward()?)?;
            }
            acc.add_formed(backward()?)?;
            for g in acc.finish_in_compute_dtype()? {
                assert_eq!(g.dtype(), DType::F32);
                assert!(values(&g)?.iter().all(|&x| x == (held + 1) as f32), "{held} held");
            }
        }
        Ok(())
    }

    #[test]
    fn clipping_scales_to_the_max_norm_only_when_above() -> Result<()> {
        let mut g = vec![Tensor::new(&[3f32, 0.0], &Device::Cpu)?, Tensor::new(&[4f32], &Device::Cpu)?];
        let norm = clip_grad_norm(&mut g, 1.0)?;
        assert!((norm - 5.0).abs() < 1e-9);
        assert!((global_grad_norm(&g)? - 1.0).abs() < 1e-5);
        let mut small = vec![Tensor::new(&[0.3f32], &Device::Cpu)?];
        clip_grad_norm(&mut small, 1.0)?;
        assert_eq!(small[0].to_vec1::<f32>()?, [0.3]);
        // `max_norm` 0 turns clipping off (DS-Chat's `gradient_clipping: 0`), it does not zero.
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
        assert_eq!(clip_coefficient(5.0, 1.0), 1.0 / (5.0 + 1e-6));
        Ok(())
    }

    /// A single process's step: the norm before clipping returned, AdamW on the clipped f32
    /// gradients (from bf16 ones), the bf16 compute copy refreshed from the masters.
    #[test]
    fn clip_and_step_returns_the_norm_and_refreshes_the_compute_copy() -> Result<()> {
        let mut params = ParamStore::default();
        params.push("h.0.mlp.c_fc.weight", &Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu)?)?;
        let compute = params.compute_copy(DType::BF16)?;
        let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() }, &params)?;
        let grads = vec![Tensor::new(&[[3f32, 0.0], [0.0, -4.0]], &Device::Cpu)?.to_dtype(DType::BF16)?];
        let norm = clip_and_step(&mut opt, &params, &compute, grads, 0.5, 1.0)?;
        assert_eq!(norm, 5.0);
        // Adam's first step moves by the learning rate where the gradient is not zero (its sign
        // survives the clipping), and the clipped gradient is in the first moment.
        let masters = params.vars[0].flatten_all()?.to_vec1::<f32>()?;
        for (got, want) in masters.iter().zip([0.5f32, 2.0, 3.0, 4.5]) {
            assert!((got - want).abs() < 1e-5, "{masters:?}");
        }
        let m = opt.held_moments(0)?.0.into_owned();
        assert!((m[0] - 0.1 * 3.0 / 5.0).abs() < 1e-6, "{m:?}");
        let copy = compute.vars[0].to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(copy, masters.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect::<Vec<_>>());
        Ok(())
    }
}
