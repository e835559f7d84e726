//! LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for GPT-2's
//! Conv1D linears, in DS-Chat's convention (`dschat/utils/module/lora.py`, `LinearLayer_LoRA`):
//! a selected linear computes `x W + b + scaling * (x A^T) B^T`, A (r, in) Kaiming-uniform, B
//! (out, r) zeros, so a fresh adapter changes nothing; `scaling` = 1/r (DS-Chat) or alpha/r
//! (PEFT's `lora_alpha`). The pure core: which linears to adapt, initialisation, the weight
//! update `delta`, `fuse`/`unfuse`, and the unfused forward; `peft` reads and writes adapters in
//! the layout of Hugging Face PEFT.
//!
//! Shapes: N rows, `in`/`out` the linear's widths, r the rank. GPT-2 stores its Conv1D weight
//! `(in, out)` (y = x W), so `delta` is returned in that layout: `scaling * A^T B^T`, which is
//! PEFT's `transpose(B @ A, fan_in_fan_out=True) * scaling`.
//!
//! Two deliberate differences from DS-Chat, both from PEFT:
//! - DS-Chat stores A transposed (`lora_right_weight`, (in, r)) and `kaiming_uniform_` then takes
//!   r as the fan-in, drawing A from U(-1/sqrt(r), 1/sqrt(r)); we draw A (r, in) as torch
//!   initialises a `Linear(in, r)`, U(-1/sqrt(in), 1/sqrt(in)), PEFT's `lora_A`. B = 0 either way,
//!   so only the speed at which the adapter starts to move differs.
//! - DS-Chat's `convert_linear_layer_to_lora` matches `nn.Linear` modules only, which misses HF
//!   GPT-2's Conv1D linears entirely; we adapt the Conv1D linears, as PEFT does.

pub mod peft;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Suffixes of an adapter's two tensors after the module name, as PEFT names them
/// (`h.0.attn.c_attn.lora_A.weight`).
pub const LORA_A: &str = "lora_A.weight";
pub const LORA_B: &str = "lora_B.weight";

/// How LoRA is applied (DS-Chat's `--lora-dim`, `--lora-module-name`, plus PEFT's `lora_alpha`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank r (DS-Chat `lora_dim`); at least 1.
    pub dim: usize,
    /// PEFT's `lora_alpha`: scaling alpha/r. `None` is DS-Chat's 1/r (alpha = 1).
    pub alpha: Option<f64>,
    /// A linear is adapted when its module name (`h.0.attn.c_attn`) contains this (DS-Chat
    /// `part_module_name in name`): `h.` selects every block's linears, `attn` attention only.
    pub module_name: String,
}

impl Default for LoraConfig {
    /// DS-Chat's `run_1.3b.sh` rank, every GPT-2 block, DS-Chat's scaling.
    fn default() -> Self {
        Self { dim: 128, alpha: None, module_name: "h.".into() }
    }
}

impl LoraConfig {
    /// The factor on `B(A x)`: alpha / r, with alpha = 1 in DS-Chat's convention.
    pub fn scaling(&self) -> f64 {
        self.alpha.unwrap_or(1.0) / self.dim as f64
    }

    /// The `lora_alpha` PEFT needs to reproduce [`Self::scaling`].
    pub fn peft_alpha(&self) -> f64 {
        self.alpha.unwrap_or(1.0)
    }

    /// Rejects a configuration that cannot be applied, naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.dim == 0 {
            bail!("--lora-dim must be at least 1 to enable LoRA (0 turns it off)");
        }
        if let Some(a) = self.alpha {
            if !(a > 0.0 && a.is_finite()) {
                bail!("--lora-alpha must be a positive number (got {a}); leave it out for DS-Chat's scaling 1/r");
            }
        }
        if self.module_name.is_empty() {
            bail!("--lora-module-name is empty: pass part of the linears' names, e.g. h. (all blocks) or attn");
        }
        Ok(())
    }

    /// The modules among `linears` (module names such as `h.0.attn.c_attn`) that get an adapter,
    /// in the given order.
    pub fn targets<S: AsRef<str>>(&self, linears: &[S]) -> Vec<String> {
        linears.iter().map(AsRef::as_ref).filter(|n| n.contains(&self.module_name)).map(str::to_string).collect()
    }
}

/// One adapted linear's pair, named by its module (`h.0.attn.c_attn`).
#[derive(Clone, Debug)]
pub struct Adapter {
    pub module: String,
    /// (r, in)
    pub a: Tensor,
    /// (out, r)
    pub b: Tensor,
}

impl Adapter {
    /// The parameter names of A and B: `<module>.lora_A.weight`, `<module>.lora_B.weight`.
    pub fn param_names(module: &str) -> (String, String) {
        (format!("{module}.{LORA_A}"), format!("{module}.{LORA_B}"))
    }
}

/// Whether a parameter name is one of an adapter's tensors.
pub fn is_adapter_name(name: &str) -> bool {
    name.ends_with(&format!(".{LORA_A}")) || name.ends_with(&format!(".{LORA_B}"))
}

/// A fresh adapter for the linear `module` (in -> out): A (r, in) ~ U(-1/sqrt(in), 1/sqrt(in)),
/// torch's `kaiming_uniform_(a=sqrt(5))` on a `Linear(in, r)` weight (gain sqrt(2/(1+5)) times
/// sqrt(3/fan_in)); B (out, r) zeros, so the adapted linear starts equal to the original. Each
/// module draws from its own stream (the seed mixed with the module name), so adding or removing
/// targets does not change the other adapters.
pub fn init_adapter(module: &str, d_in: usize, d_out: usize, r: usize, seed: u64, device: &Device) -> Result<Adapter> {
    assert!(r > 0 && d_in > 0 && d_out > 0, "adapter {module}: rank {r}, in {d_in}, out {d_out} must be positive");
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ fnv1a64(module.as_bytes()));
    let bound = 1.0 / (d_in as f64).sqrt();
    let a: Vec<f32> = (0..r * d_in).map(|_| ((2.0 * rng.random::<f64>() - 1.0) * bound) as f32).collect();
    Ok(Adapter {
        module: module.to_string(),
        a: Tensor::from_vec(a, (r, d_in), device)?,
        b: Tensor::zeros((d_out, r), candle_core::DType::F32, device)?,
    })
}

/// The update LoRA makes to a Conv1D weight: `scaling * A^T B^T`, (in, out).
pub fn delta(a: &Tensor, b: &Tensor, scaling: f64) -> candle_core::Result<Tensor> {
    a.t()?.matmul(&b.t()?)? * scaling // (in, r) x (r, out) -> (in, out)
}

/// The weight (in, out) with the adapter merged in: `W + scaling * A^T B^T`.
pub fn fuse(weight: &Tensor, a: &Tensor, b: &Tensor, scaling: f64) -> candle_core::Result<Tensor> {
    weight + delta(a, b, scaling)?
}

/// The inverse of [`fuse`]: `W - scaling * A^T B^T` (exact up to f32 rounding).
pub fn unfuse(weight: &Tensor, a: &Tensor, b: &Tensor, scaling: f64) -> candle_core::Result<Tensor> {
    weight - delta(a, b, scaling)?
}

/// The adapter's branch of an unfused linear in training: gradients reach A and B.
#[derive(Clone, Debug)]
pub struct LoraLinear {
    /// (r, in)
    pub a: Tensor,
    /// (out, r)
    pub b: Tensor,
    pub scaling: f64,
}

impl LoraLinear {
    /// `scaling * (x A^T) B^T` for x (N, in) -> (N, out): two thin gemms through the rank,
    /// never the (in, out) product.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(&self.a.t()?)?; // (N, r)
        h.matmul(&self.b.t()?)? * self.scaling // (N, out)
    }
}

/// 64-bit FNV-1a, used to derive each adapter's random stream from its name.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn max_abs(t: &Tensor) -> f32 {
        t.abs().and_then(|t| t.max_all()).and_then(|t| t.to_scalar::<f32>()).expect("reduces")
    }

    #[test]
    fn scaling_is_ds_chat_one_over_r_unless_alpha_is_given() {
        let ds = LoraConfig { dim: 8, alpha: None, module_name: "h.".into() };
        assert_eq!(ds.scaling(), 0.125);
        assert_eq!(ds.peft_alpha(), 1.0);
        let peft = LoraConfig { alpha: Some(16.0), ..ds };
        assert_eq!(peft.scaling(), 2.0);
    }

    #[test]
    fn targets_are_the_linears_whose_names_contain_the_module_name() {
        let linears = ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj", "h.10.mlp.c_fc"];
        let pick = |m: &str| LoraConfig { dim: 2, alpha: None, module_name: m.into() }.targets(&linears);
        assert_eq!(pick("h.").len(), 5);
        assert_eq!(pick("attn"), ["h.0.attn.c_attn", "h.0.attn.c_proj"]);
        assert_eq!(pick("c_proj"), ["h.0.attn.c_proj", "h.0.mlp.c_proj"]);
        assert_eq!(pick("h.1"), ["h.10.mlp.c_fc"]);
        assert!(pick("decoder.layers.").is_empty(), "DS-Chat's OPT default matches nothing in GPT-2");
    }

    #[test]
    fn validation_names_the_flag() {
        let err = |c: LoraConfig| c.validate().unwrap_err().to_string();
        assert!(err(LoraConfig { dim: 0, ..Default::default() }).contains("--lora-dim"));
        assert!(err(LoraConfig { alpha: Some(-1.0), ..Default::default() }).contains("--lora-alpha"));
        assert!(err(LoraConfig { module_name: String::new(), ..Default::default() }).contains("--lora-module-name"));
        assert!(LoraConfig::default().validate().is_ok());
        for alpha in [0.0, -0.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = err(LoraConfig { alpha: Some(alpha), ..Default::default() });
            assert!(e.contains("--lora-alpha must be a positive number"), "{alpha}: {e}");
        }
        for alpha in [f64::MIN_POSITIVE, 0.5, 2.0, 16.0] {
            assert!(LoraConfig { alpha: Some(alpha), ..Default::default() }.validate().is_ok(), "{alpha}");
        }
    }

    #[test]
    fn adapter_names_are_pefts_and_only_they_count_as_adapters() {
        let (a, b) = Adapter::param_names("h.3.mlp.c_fc");
        assert_eq!((a.as_str(), b.as_str()), ("h.3.mlp.c_fc.lora_A.weight", "h.3.mlp.c_fc.lora_B.weight"));
        assert!(is_adapter_name(&a) && is_adapter_name(&b));
        for trunk in ["h.3.mlp.c_fc.weight", "h.3.mlp.c_fc.bias", "score.weight", "lora_A.weight", "h.0.lora_A.bias"] {
            assert!(!is_adapter_name(trunk), "{trunk} is not an adapter tensor");
        }
    }

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        // Fowler, Noll, Vo's FNV-1a 64-bit test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn init_is_kaiming_uniform_a_and_zero_b_seeded_per_module() -> Result<()> {
        let d = Device::Cpu;
        let ad = init_adapter("h.0.mlp.c_fc", 64, 256, 8, 3, &d)?;
        assert_eq!((ad.a.dims(), ad.b.dims()), (&[8, 64][..], &[256, 8][..]));
        assert_eq!(max_abs(&ad.b), 0.0);
        let bound = 1.0 / 8.0; // 1/sqrt(64)
        let a: Vec<f32> = ad.a.flatten_all()?.to_vec1()?;
        assert!(a.iter().all(|x| x.abs() <= bound), "A within the Kaiming bound");
        // U(-c, c) has variance c^2/3.
        let var = a.iter().map(|x| (x * x) as f64).sum::<f64>() / a.len() as f64;
        assert!((var - bound as f64 * bound as f64 / 3.0).abs() < 0.1 * bound as f64 * bound as f64 / 3.0, "{var}");
        let again = init_adapter("h.0.mlp.c_fc", 64, 256, 8, 3, &d)?;
        assert_eq!(max_abs(&(ad.a.clone() - again.a)?), 0.0, "same seed, same A");
        let other = init_adapter("h.1.mlp.c_fc", 64, 256, 8, 3, &d)?;
        assert!(max_abs(&(ad.a - other.a)?) > 0.0, "another module draws another A");
        Ok(())
    }

    #[test]
    fn every_seed_draws_another_a_for_every_module() -> Result<()> {
        // The seed is mixed with each module's hash, losing none of its bits: across gpt2's 48
        // linears, seeds 0..32 give 32 different A each (an A of 1 x 4 values is enough to tell).
        let d = Device::Cpu;
        for block in 0..12 {
            for linear in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
                let module = format!("h.{block}.{linear}");
                let mut firsts = std::collections::BTreeSet::new();
                for seed in 0..32 {
                    let a: Vec<f32> = init_adapter(&module, 4, 4, 1, seed, &d)?.a.flatten_all()?.to_vec1()?;
                    firsts.insert(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                }
                assert_eq!(firsts.len(), 32, "{module}: two seeds drew the same A");
            }
        }
        Ok(())
    }

    #[test]
    fn delta_is_the_unfused_branch_in_conv1d_layout() -> Result<()> {
        let d = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (3, 5), &d)?;
        let b = Tensor::randn(0f32, 1.0, (7, 3), &d)?;
        let x = Tensor::randn(0f32, 1.0, (4, 5), &d)?;
        let branch = LoraLinear { a: a.clone(), b: b.clone(), scaling: 0.5 }.forward(&x)?; // (4, 7)
        let via_delta = x.matmul(&delta(&a, &b, 0.5)?)?;
        assert_eq!(delta(&a, &b, 0.5)?.dims(), [5, 7]);
        assert!(max_abs(&(branch - via_delta)?) < 1e-5);
        Ok(())
    }

    #[test]
    fn unfuse_restores_the_fused_weight() -> Result<()> {
        let d = Device::Cpu;
        let w = (Tensor::randn(0f32, 1.0, (48, 144), &d)? * 0.02)?;
        let a = init_adapter("m", 48, 144, 4, 1, &d)?.a;
        let b = Tensor::randn(0f32, 0.1, (144, 4), &d)?;
        let fused = fuse(&w, &a, &b, 0.25)?;
        assert!(max_abs(&(&fused - &w)?) > 1e-3, "a non-zero B changes the weight");
        let back = unfuse(&fused, &a, &b, 0.25)?;
        // f32 rounding of W + D - D: at most an ulp of |W + D| (< 1) per entry.
        let err = max_abs(&(back - &w)?);
        assert!(err <= 2.0 * f32::EPSILON, "fuse then unfuse is off by {err}");
        assert_eq!(fused.dtype(), DType::F32);
        Ok(())
    }
}
