//! The trainable parameters: one candle `Var` per HF tensor, in HF order, plus GPT-2's
//! initialisation. The model is built from these `Var`s' tensors, so gradients computed through
//! the model land on them and optimizer updates are seen by the model without a copy.
//!
//! LoRA (DS-Chat `convert_linear_layer_to_lora`, the `lora` crate): adapters are parameters of
//! the store too, `h.0.attn.c_attn.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), after
//! the trunk. `--only-optimize-lora` freezes the trunk (DS-Chat `only_optimize_lora_parameters`):
//! the model reads frozen weights detached, so no gradient is accumulated for them, and the
//! optimizer is given only [`ParamStore::trainable`]. A saved model always has LoRA merged
//! ([`ParamStore::merged`]).

use crate::model::gpt2::{Conv1D, Gpt2, Gpt2Config};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use lora::{Adapter, LoraConfig, LoraLinear};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

const GIB: f64 = (1u64 << 30) as f64;

/// The LoRA adapters `lora` puts on `cfg`'s linears, whole, as one rank draws them (seeded by
/// the linear's name), with the linears they go on; [`ParamStore::add_lora`] adds them, a model
/// built sharded (ZeRO-3) keeps its shard of them.
pub fn lora_adapters(
    cfg: &Gpt2Config,
    lora: &LoraConfig,
    seed: u64,
    device: &Device,
) -> Result<(Vec<String>, Vec<Adapter>)> {
    lora.validate()?;
    let linears = linear_shapes(cfg);
    let names: Vec<&str> = linears.iter().map(|(n, _, _)| n.as_str()).collect();
    let targets = lora.targets(&names);
    if targets.is_empty() {
        bail!(
            "--lora-module-name {:?} matches none of GPT-2's linears (h.N.attn.c_attn, h.N.attn.c_proj, h.N.mlp.c_fc, h.N.mlp.c_proj): try h. (all) or attn",
            lora.module_name
        );
    }
    let adapters = linears
        .iter()
        .filter(|(n, _, _)| targets.contains(n))
        .map(|(module, d_in, d_out)| lora::init_adapter(module, *d_in, *d_out, lora.dim, seed, device))
        .collect::<Result<_>>()?;
    Ok((targets, adapters))
}

/// Named parameters in a fixed order (the order of [`parameter_shapes`], then heads and adapters
/// in the order they were added).
#[derive(Default)]
pub struct ParamStore {
    pub names: Vec<String>,
    pub vars: Vec<Var>,
    /// One flag per parameter: frozen ones get no gradient and no update.
    frozen: Vec<bool>,
    /// LoRA's scaling when the store holds adapters.
    lora_scaling: Option<f64>,
}

impl ParamStore {
    /// Takes ownership of `tensors` (as f32 `Var`s) in the config's parameter order; every
    /// parameter must be present with its expected shape.
    pub fn from_tensors(cfg: &Gpt2Config, tensors: &HashMap<String, Tensor>, device: &Device) -> Result<Self> {
        check_weights_fit(cfg, device)?;
        let mut store = Self::default();
        for (name, shape) in parameter_shapes(cfg) {
            let Some(t) = tensors.get(&name) else {
                bail!("checkpoint is missing tensor {name} (is it a GPT-2 checkpoint matching its config.json?)");
            };
            if t.dims() != shape.as_slice() {
                bail!("tensor {name} has shape {:?} but config.json implies {shape:?}", t.dims());
            }
            store.push(&name, &t.to_device(device)?)?;
        }
        Ok(store)
    }

    /// A freshly initialised model, as HF `GPT2PreTrainedModel._init_weights` does: normal(0, 0.02)
    /// weights and embeddings, zero biases, unit LayerNorm gains, and the residual projections
    /// (`c_proj`) scaled by 1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3).
    pub fn init(cfg: &Gpt2Config, seed: u64, device: &Device) -> Result<Self> {
        Self::init_each(cfg, seed, device, |_, t| Ok(t))
    }

    /// [`Self::init`], keeping of each tensor what `keep` makes of it as soon as it is drawn (a
    /// tensor-parallel rank's slice: the whole model never exists at once). The same draws
    /// whatever is kept, so every rank's slices are those of the one-rank model.
    pub fn init_each(
        cfg: &Gpt2Config,
        seed: u64,
        device: &Device,
        mut keep: impl FnMut(&str, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        check_weights_fit(cfg, device)?;
        // Each tensor goes into its Var (a copy) as soon as it is made, so the peak holds the
        // weights once, not twice (gpt2-medium: 1.4 GB less).
        let mut store = Self::default();
        Self::draw_initial(cfg, seed, |name, shape, values| {
            store.push(name, &keep(name, Tensor::from_vec(values, shape, device)?)?)
        })?;
        Ok(store)
    }

    /// Draws the initial values of every parameter of [`parameter_shapes`], in its order, and
    /// hands each to `take` (name, shape, flat values) before drawing the next: what [`Self::init`]
    /// keeps whole, a tensor-parallel rank slices and a ZeRO-3 rank shards, all from the same
    /// draws.
    pub fn draw_initial(
        cfg: &Gpt2Config,
        seed: u64,
        mut take: impl FnMut(&str, &[usize], Vec<f32>) -> Result<()>,
    ) -> Result<()> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let std = cfg.initializer_range;
        let proj_std = std / (2.0 * cfg.n_layer as f64).sqrt();
        for (name, shape) in parameter_shapes(cfg) {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if name.contains("ln_") {
                vec![1.0; n]
            } else {
                let s = if name.ends_with("c_proj.weight") { proj_std } else { std };
                (0..n).map(|_| (normal(&mut rng) * s) as f32).collect()
            };
            take(&name, &shape, values)?;
        }
        Ok(())
    }

    /// Adds a parameter outside the GPT-2 trunk (a reward model's `score.weight`), after the
    /// trunk's. Create the optimizer after every push: it sizes its moments from the store.
    /// A store of `named` tensors as they are, in their dtype (a model's weights gathered in
    /// its compute dtype); `push` makes fp32 masters.
    pub fn of_tensors(named: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        let mut store = ParamStore::default();
        for (name, t) in named {
            store.names.push(name);
            store.vars.push(Var::from_tensor(&t)?);
            store.frozen.push(false);
        }
        Ok(store)
    }

    pub fn push(&mut self, name: &str, value: &Tensor) -> Result<()> {
        if self.get(name).is_some() {
            bail!("internal error: parameter {name} added twice");
        }
        self.names.push(name.to_string());
        self.vars.push(Var::from_tensor(&value.to_dtype(DType::F32)?)?);
        self.frozen.push(false);
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&Var> {
        self.names.iter().position(|n| n == name).map(|i| &self.vars[i])
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.names.iter().map(String::as_str).zip(&self.vars)
    }

    /// The current values, sharing storage with the `Var`s; frozen ones detached, so that no
    /// gradient is accumulated for them.
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        let value = |(v, frozen): (&Var, &bool)| if *frozen { v.as_tensor().detach() } else { v.as_tensor().clone() };
        self.names.iter().cloned().zip(self.vars.iter().zip(&self.frozen).map(value)).collect()
    }

    /// The model over these parameters (same storage: updates to the `Var`s are visible), with
    /// the LoRA adapters the store holds attached, unfused.
    pub fn model(&self, cfg: &Gpt2Config) -> Result<Gpt2> {
        let device = self.vars.first().map_or(Device::Cpu, |v| v.device().clone());
        let tensors = self.tensors();
        let mut model = Gpt2::load(VarBuilder::from_tensors(tensors.clone(), self.dtype(), &device), cfg)?;
        if let Some(scaling) = self.lora_scaling {
            attach_adapters(model.linears_mut(), &tensors, scaling);
        }
        Ok(model)
    }

    /// The model of one rank of the tensor-parallel group `tp` over these parameters, which
    /// are that rank's slices (`crate::training::tensor_parallel::TensorParallel::slice`), with
    /// their LoRA adapters' slices attached unfused.
    pub fn model_tensor_parallel(
        &self,
        cfg: &Gpt2Config,
        tp: &std::sync::Arc<crate::comm::ProcessGroup>,
    ) -> Result<Gpt2> {
        let device = self.vars.first().map_or(Device::Cpu, |v| v.device().clone());
        let tensors = self.tensors();
        let mut model =
            Gpt2::load_tensor_parallel(VarBuilder::from_tensors(tensors.clone(), self.dtype(), &device), cfg, tp)?;
        if let Some(scaling) = self.lora_scaling {
            attach_adapters(model.linears_mut(), &tensors, scaling);
        }
        Ok(model)
    }

    /// The dtype of the parameters: f32 for master weights, the compute dtype for a
    /// [`Self::compute_copy`].
    pub fn dtype(&self) -> DType {
        self.vars.first().map_or(DType::F32, |v| v.dtype())
    }

    /// The weights forward and backward run on, in `dtype`: for f32 the very same `Var`s, else
    /// a cast copy (same names, frozen flags and adapters) that [`Self::refresh_from`] brings up
    /// to date after each optimizer update of the fp32 masters.
    pub fn compute_copy(&self, dtype: DType) -> Result<ParamStore> {
        let vars = if dtype == self.dtype() {
            self.vars.clone()
        } else {
            self.vars.iter().map(|v| Var::from_tensor(&v.to_dtype(dtype)?)).collect::<candle_core::Result<_>>()?
        };
        Ok(ParamStore { names: self.names.clone(), vars, frozen: self.frozen.clone(), lora_scaling: self.lora_scaling })
    }

    /// The same parameters (names, dtype, frozen flags, adapters) copied onto `device`: a frozen
    /// model kept in host memory brought to the GPU for a forward (`--offload-reference-model`).
    pub fn to_device(&self, device: &Device) -> Result<ParamStore> {
        let vars =
            self.vars.iter().map(|v| Var::from_tensor(&v.to_device(device)?)).collect::<candle_core::Result<_>>()?;
        Ok(ParamStore { names: self.names.clone(), vars, frozen: self.frozen.clone(), lora_scaling: self.lora_scaling })
    }

    /// Copies `master`'s values (cast) into this compute copy's `Var`s, which hold the same
    /// parameters in the same order; a no-op for `Var`s that are the masters themselves.
    pub fn refresh_from(&self, master: &ParamStore) -> Result<()> {
        if self.names != master.names {
            bail!("internal error: the compute copy does not hold the masters' parameters");
        }
        for (c, m) in self.vars.iter().zip(&master.vars) {
            if c.as_tensor().id() != m.as_tensor().id() {
                crate::kernels::ops::cast_into(c, m.as_tensor())?;
            }
        }
        Ok(())
    }

    pub fn numel(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// Adds fresh LoRA adapters (A Kaiming-uniform, B zero, seeded) to the linears `lora`
    /// selects; returns their module names. Errors when `--lora-module-name` selects none.
    pub fn add_lora(&mut self, cfg: &Gpt2Config, lora: &LoraConfig, seed: u64) -> Result<Vec<String>> {
        self.add_lora_cut(cfg, lora, seed, |_, t| Ok(t.clone()))
    }

    /// [`Self::add_lora`] on a store of slices (a tensor-parallel rank's): each adapter is drawn
    /// whole, as one rank draws it, then cut by `cut(name, tensor)` as its linear is cut.
    pub fn add_lora_cut(
        &mut self,
        cfg: &Gpt2Config,
        lora: &LoraConfig,
        seed: u64,
        cut: impl Fn(&str, &Tensor) -> Result<Tensor>,
    ) -> Result<Vec<String>> {
        let device = self.vars.first().map_or(Device::Cpu, |v| v.device().clone());
        let (targets, whole) = lora_adapters(cfg, lora, seed, &device)?;
        let mut adapters = Vec::with_capacity(whole.len());
        for whole in whole {
            let (a, b) = Adapter::param_names(&whole.module);
            adapters.push(Adapter { a: cut(&a, &whole.a)?, b: cut(&b, &whole.b)?, module: whole.module });
        }
        self.add_adapters(lora.scaling(), &adapters)?;
        Ok(targets)
    }

    /// Adds existing adapters (a PEFT adapter read from disk, say) with their scaling. Each must
    /// name a GPT-2 linear of this store with matching widths.
    pub fn add_adapters(&mut self, scaling: f64, adapters: &[Adapter]) -> Result<()> {
        if self.lora_scaling.is_some_and(|s| s != scaling) {
            bail!("internal error: adapters with two different scalings in one model");
        }
        for ad in adapters {
            let Some(w) = self.get(&format!("{}.weight", ad.module)) else {
                bail!("adapter {} names no linear of this GPT-2", ad.module);
            };
            let (&[d_in, d_out], &[_, a_in], &[b_out, _]) = (w.dims(), ad.a.dims(), ad.b.dims()) else {
                bail!("adapter {}: A {:?} and B {:?} are not matrices", ad.module, ad.a.dims(), ad.b.dims());
            };
            if (a_in, b_out) != (d_in, d_out) {
                bail!(
                    "adapter {}: A {:?} and B {:?} do not fit the linear ({d_in} -> {d_out})",
                    ad.module,
                    ad.a.dims(),
                    ad.b.dims()
                );
            }
            let (a, b) = Adapter::param_names(&ad.module);
            self.push(&a, &ad.a)?;
            self.push(&b, &ad.b)?;
        }
        self.lora_scaling = Some(scaling);
        Ok(())
    }

    pub fn lora_scaling(&self) -> Option<f64> {
        self.lora_scaling
    }

    /// The adapters the store holds, in order (sharing storage).
    pub fn adapters(&self) -> Vec<Adapter> {
        let mut out = Vec::new();
        for (name, var) in self.iter() {
            if let Some(module) = name.strip_suffix(&format!(".{}", lora::LORA_A)) {
                let (_, b) = Adapter::param_names(module);
                if let Some(b) = self.get(&b) {
                    out.push(Adapter {
                        module: module.to_string(),
                        a: var.as_tensor().clone(),
                        b: b.as_tensor().clone(),
                    });
                }
            }
        }
        out
    }

    /// Which parameters are frozen, one flag per parameter in order.
    pub fn frozen(&self) -> &[bool] {
        &self.frozen
    }

    /// Gives a store rebuilt from another's values (ZeRO stage 3 gathers the whole model from
    /// its shards) that store's frozen flags and LoRA scaling, so that it merges its adapters
    /// and names its trainable part as the original would.
    pub fn set_layout(&mut self, frozen: &[bool], lora_scaling: Option<f64>) -> Result<()> {
        if frozen.len() != self.names.len() {
            bail!("internal error: {} frozen flags for {} parameters", frozen.len(), self.names.len());
        }
        self.frozen = frozen.to_vec();
        self.lora_scaling = lora_scaling;
        Ok(())
    }

    /// Freezes the GPT-2 trunk (DS-Chat `only_optimize_lora_parameters`): adapters and heads (a
    /// reward model's `score.weight`, which DS-Chat's step 2 force-optimizes) keep training.
    pub fn freeze_trunk(&mut self) {
        for (frozen, name) in self.frozen.iter_mut().zip(&self.names) {
            *frozen = is_trunk_name(name);
        }
    }

    /// The parameters the optimizer updates, sharing their `Var`s with this store: all of them
    /// unless some are frozen (the LoRA scaling kept: a trained adapter is still one).
    pub fn trainable(&self) -> ParamStore {
        let mut out = ParamStore { lora_scaling: self.lora_scaling, ..Default::default() };
        for ((name, var), frozen) in self.iter().zip(&self.frozen) {
            if !frozen {
                out.names.push(name.to_string());
                out.vars.push(var.clone());
                out.frozen.push(false);
            }
        }
        out
    }

    /// A deep copy (independent `Var`s), adapters and frozen flags included.
    pub fn copy(&self) -> Result<ParamStore> {
        let mut out = ParamStore { lora_scaling: self.lora_scaling, ..Default::default() };
        for (name, var) in self.iter() {
            out.push(name, &var.as_tensor().copy()?)?;
        }
        out.frozen.clone_from(&self.frozen);
        Ok(out)
    }

    /// The parameters as saved: every adapter fused into its linear's weight (`W + scaling *
    /// A^T B^T`, into new tensors: the store itself is untouched) and the adapters dropped.
    /// Without adapters, the same `Var`s.
    pub fn merged(&self) -> Result<ParamStore> {
        let mut out = ParamStore::default();
        for (name, var) in self.iter() {
            if lora::is_adapter_name(name) {
                continue;
            }
            let fused = match (self.lora_scaling, name.strip_suffix(".weight")) {
                (Some(scaling), Some(module)) => {
                    let (a, b) = Adapter::param_names(module);
                    match (self.get(&a), self.get(&b)) {
                        (Some(a), Some(b)) => Some(lora::fuse(var.as_tensor(), a, b, scaling)?),
                        _ => None,
                    }
                }
                _ => None,
            };
            out.names.push(name.to_string());
            out.vars.push(match fused {
                Some(w) => Var::from_tensor(&w)?,
                None => var.clone(),
            });
            out.frozen.push(false);
        }
        Ok(out)
    }
}

/// Attaches, unfused, the adapters `tensors` holds (`<module>.lora_A.weight`, `...lora_B...`)
/// to the linears they belong to; linears without an adapter are left as they are.
pub fn attach_adapters<'a>(
    linears: impl IntoIterator<Item = (String, &'a mut Conv1D)>,
    tensors: &HashMap<String, Tensor>,
    scaling: f64,
) {
    for (module, linear) in linears {
        let (a, b) = Adapter::param_names(&module);
        if let (Some(a), Some(b)) = (tensors.get(&a), tensors.get(&b)) {
            linear.lora = Some(LoraLinear { a: a.clone(), b: b.clone(), scaling });
        }
    }
}

/// GPT-2's Conv1D linears, `(module, in, out)` in parameter order: what LoRA may adapt.
pub fn linear_shapes(cfg: &Gpt2Config) -> Vec<(String, usize, usize)> {
    parameter_shapes(cfg)
        .into_iter()
        .filter_map(|(name, shape)| {
            let module = name.strip_suffix(".weight")?;
            let linear =
                [".attn.c_attn", ".attn.c_proj", ".mlp.c_fc", ".mlp.c_proj"].iter().any(|s| module.ends_with(s));
            (linear && shape.len() == 2).then(|| (module.to_string(), shape[0], shape[1]))
        })
        .collect()
}

/// Every parameter of a GPT-2 with its shape, in HF order and naming (without `transformer.`).
/// The single inventory used for initialisation, loading checks and memory accounting.
pub fn parameter_shapes(cfg: &Gpt2Config) -> Vec<(String, Vec<usize>)> {
    let (c, inner) = (cfg.n_embd, cfg.inner_dim());
    let mut p =
        vec![("wte.weight".to_string(), vec![cfg.vocab_size, c]), ("wpe.weight".to_string(), vec![cfg.n_positions, c])];
    for i in 0..cfg.n_layer {
        let l = |s: &str| format!("h.{i}.{s}");
        p.extend([
            (l("ln_1.weight"), vec![c]),
            (l("ln_1.bias"), vec![c]),
            (l("attn.c_attn.weight"), vec![c, 3 * c]),
            (l("attn.c_attn.bias"), vec![3 * c]),
            (l("attn.c_proj.weight"), vec![c, c]),
            (l("attn.c_proj.bias"), vec![c]),
            (l("ln_2.weight"), vec![c]),
            (l("ln_2.bias"), vec![c]),
            (l("mlp.c_fc.weight"), vec![c, inner]),
            (l("mlp.c_fc.bias"), vec![inner]),
            (l("mlp.c_proj.weight"), vec![inner, c]),
            (l("mlp.c_proj.bias"), vec![c]),
        ]);
    }
    p.push(("ln_f.weight".into(), vec![c]));
    p.push(("ln_f.bias".into(), vec![c]));
    p
}

/// Whether `name` (without `transformer.`) is a GPT-2 trunk tensor rather than a head's or a
/// LoRA adapter's.
pub fn is_trunk_name(name: &str) -> bool {
    let trunk = name.starts_with("h.") || ["wte.", "wpe.", "ln_f."].iter().any(|p| name.starts_with(p));
    trunk && !lora::is_adapter_name(name)
}

/// The values of the named tensors beyond a GPT-2 trunk (heads, LoRA adapters), as held: under
/// tensor parallelism a rank's slices of them.
pub fn numel_beside_trunk<'a>(tensors: impl IntoIterator<Item = (&'a str, usize)>) -> usize {
    tensors.into_iter().filter(|(name, _)| !is_trunk_name(name)).map(|(_, n)| n).sum()
}

/// Total parameter count (the tied LM head counted once).
pub fn parameter_count(cfg: &Gpt2Config) -> usize {
    parameter_shapes(cfg).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
}

/// One standard normal sample (Box-Muller); `rand_distr` for one line is not worth a dependency.
pub(crate) fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Refuses, before anything is allocated, a model whose f32 weights alone exceed the machine's
/// memory (RAM and swap) when they are to live on the CPU: the allocation would otherwise abort
/// the process without a word of why. The memory plan, printed later, details the rest.
pub fn check_weights_fit(cfg: &Gpt2Config, device: &candle_core::Device) -> anyhow::Result<()> {
    let (Some(memory), true) = (crate::runtime::machine_memory_bytes(), device.is_cpu()) else { return Ok(()) };
    weights_fit(cfg, memory)
}

/// [`check_weights_fit`] against `memory` bytes.
fn weights_fit(cfg: &Gpt2Config, memory: u64) -> anyhow::Result<()> {
    let parameters = cfg.checked_parameter_count().unwrap_or(u64::MAX);
    let bytes = parameters.saturating_mul(4);
    if bytes > memory {
        anyhow::bail!(
            "the model has {:.2}B parameters, {:.1} GiB of f32 weights alone, more than this machine's {:.1} GiB of memory (RAM and swap): choose smaller dimensions (n_layer {}, n_embd {}, vocab_size {})",
            parameters as f64 / 1e9,
            bytes as f64 / GIB,
            memory as f64 / GIB,
            cfg.n_layer,
            cfg.n_embd,
            cfg.vocab_size
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_larger_than_the_machine_are_refused_before_allocation() {
        let gpt2 = Gpt2Config::from_preset("gpt2").unwrap();
        assert!(weights_fit(&gpt2, 4 * 124_439_808).is_ok(), "exactly enough");
        let err = weights_fit(&gpt2, 4 * 124_439_808 - 1).unwrap_err().to_string();
        assert!(err.contains("0.12B parameters") && err.contains("choose smaller dimensions"), "{err}");
        let deep = Gpt2Config { n_layer: 1_000_000_000, ..gpt2 };
        assert!(check_weights_fit(&deep, &candle_core::Device::Cpu).is_err(), "7 quadrillion parameters fit nowhere");
    }

    #[test]
    fn init_follows_hf_statistics_and_is_seeded() -> Result<()> {
        let cfg = Gpt2Config::tiny();
        let a = ParamStore::init(&cfg, 7, &Device::Cpu)?;
        let b = ParamStore::init(&cfg, 7, &Device::Cpu)?;
        let std_of = |p: &ParamStore, n: &str| -> Result<f32> {
            let t = p.get(n).unwrap().as_tensor();
            Ok(t.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?)
        };
        assert!((std_of(&a, "wte.weight")? - 0.02).abs() < 1e-3);
        let proj = 0.02 / (8f32).sqrt();
        assert!((std_of(&a, "h.1.mlp.c_proj.weight")? - proj).abs() < 1e-3);
        assert_eq!(std_of(&a, "h.0.attn.c_attn.bias")?, 0.0);
        assert_eq!(a.get("ln_f.weight").unwrap().as_tensor().sum_all()?.to_scalar::<f32>()?, 128.0);
        let d = a.get("wte.weight").unwrap().sub(b.get("wte.weight").unwrap())?.abs()?.sum_all()?;
        assert_eq!(d.to_scalar::<f32>()?, 0.0, "same seed, same weights");
        assert_eq!(a.numel(), parameter_count(&cfg));
        Ok(())
    }
}
