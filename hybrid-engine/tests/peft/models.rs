//! The small seeded models of the PEFT fixture, shared by `examples/write_peft_fixture.rs` (which
//! writes them for `scripts/fixtures/make_peft_fixture.py`) and `tests/peft_fixture.rs` (which
//! rebuilds the same bytes and compares our outputs with PEFT's): a GPT-2 of an unusual shape
//! saved as a causal LM (`base/`), a DS-Chat-convention adapter on every linear (`adapter_lm/`,
//! CAUSAL_LM, scaling 1/r) and a PEFT-convention adapter on the MLPs with a trained score head
//! (`adapter_rm/`, SEQ_CLS, scaling alpha/r, `score` in modules_to_save).

use anyhow::Result;
use candle_core::{Device, Tensor};
use hybrid_engine::checkpoints::resume::save_model_dir;
use hybrid_engine::lora::peft::{save_peft_adapter, PeftAdapter};
use hybrid_engine::lora::{Adapter, LoraConfig};
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::reward_model::{add_score_head, causal_lm_config, SCORE_WEIGHT};
use hybrid_engine::ParamStore;
use std::path::Path;

pub const EOS: u32 = 95;

pub struct PeftFixture {
    pub config: Gpt2Config,
    pub base: ParamStore,
    pub lm: PeftAdapter,
    pub rm: PeftAdapter,
}

/// Adapters as after training: B filled with a fixed pattern (a fresh B is zero and would hide
/// any mistake in B's layout or the scaling).
fn trained(params: &mut ParamStore, cfg: &Gpt2Config, lora: &LoraConfig, seed: u64) -> Result<Vec<Adapter>> {
    params.add_lora(cfg, lora, seed)?;
    let mut adapters = params.adapters();
    for (i, ad) in adapters.iter_mut().enumerate() {
        let n = ad.b.elem_count();
        let v: Vec<f32> = (0..n).map(|k| (((k * 13 + i * 7) % 19) as f32 / 19.0 - 0.45) * 0.6).collect();
        ad.b = Tensor::from_vec(v, ad.b.shape(), &Device::Cpu)?;
    }
    Ok(adapters)
}

pub fn peft_fixture() -> Result<PeftFixture> {
    let d = Device::Cpu;
    let config = Gpt2Config {
        n_layer: 2,
        n_embd: 48,
        n_head: 3,
        n_positions: 24,
        vocab_size: 96,
        bos_token_id: Some(EOS),
        eos_token_id: Some(EOS),
        ..Gpt2Config::tiny()
    };
    let base = ParamStore::init(&config, 21, &d)?;
    // Lift the zero biases and unit LayerNorm gains, so that nothing is trivially symmetric.
    for (i, (name, var)) in base.iter().enumerate() {
        if name.ends_with(".bias") || name.contains("ln_") {
            let bump: Vec<f32> =
                (0..var.elem_count()).map(|k| (((k * 7 + i * 13) % 17) as f64 * 0.01 - 0.08) as f32).collect();
            var.set(&(var.as_tensor() + Tensor::from_vec(bump, var.shape(), &d)?)?)?;
        }
    }

    let lm_cfg = LoraConfig { dim: 4, alpha: None, module_name: "h.".into() };
    let lm_adapters = trained(&mut base.copy()?, &config, &lm_cfg, 22)?;
    let lm = PeftAdapter::new(&lm_cfg, "base", "CAUSAL_LM", lm_adapters);

    let rm_cfg = LoraConfig { dim: 2, alpha: Some(8.0), module_name: "mlp".into() };
    let mut with_head = base.copy()?;
    add_score_head(&mut with_head, &config, 23, &d)?;
    let rm_adapters = trained(&mut with_head, &config, &rm_cfg, 23)?;
    let mut rm = PeftAdapter::new(&rm_cfg, "base", "SEQ_CLS", rm_adapters);
    let score = with_head.get(SCORE_WEIGHT).expect("score head").as_tensor().copy()?;
    rm.modules_to_save.push((SCORE_WEIGHT.to_string(), score));
    Ok(PeftFixture { config, base, lm, rm })
}

/// Writes `dir/base`, `dir/adapter_lm` and `dir/adapter_rm`.
pub fn save_peft_fixture(dir: &Path, fx: &PeftFixture) -> Result<()> {
    save_model_dir(&dir.join("base"), &causal_lm_config(&fx.config), &fx.base, &|_| Ok(()))?;
    save_peft_adapter(&dir.join("adapter_lm"), &fx.lm)?;
    save_peft_adapter(&dir.join("adapter_rm"), &fx.rm)
}
