//! LoRA in the model (DS-Chat `LinearLayer_LoRA` semantics on GPT-2's Conv1D linears): a fresh
//! adapter changes nothing, the unfused training forward equals the merged weights, gradients
//! reach A and B (finite differences), `--only-optimize-lora` updates nothing but the adapters,
//! activation checkpointing gives the same adapter gradients, and a saved model (LoRA merged)
//! loads back with the unfused model's logits.

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use hybrid_engine::checkpoints::hf_io::load_model_dir;
use hybrid_engine::checkpoints::resume::save_model_dir;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::{add_score_head, SCORE_WEIGHT};
use hybrid_engine::training::optim::{AdamWConfig, GradAccumulator};
use hybrid_engine::training::schedule::LrSchedule;
use hybrid_engine::training::train_step::{lm_forward_backward, Backward};
use hybrid_engine::training::trainer::Trainer;
use hybrid_engine::ParamStore;
use lora::LoraConfig;

fn small() -> Gpt2Config {
    Gpt2Config { n_layer: 2, n_embd: 16, n_head: 2, n_positions: 16, vocab_size: 40, ..Gpt2Config::tiny() }
}

fn ids() -> Result<Tensor> {
    Ok(Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]], &Device::Cpu)?)
}

fn logits(params: &ParamStore, cfg: &Gpt2Config) -> Result<Tensor> {
    Ok(params.model(cfg)?.forward(&ids()?, &Positions::default(), None, None)?)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar()?)
}

/// Gives every B non-zero values, as after some training, so that the adapters matter.
fn perturb_b(params: &ParamStore, std: f32) -> Result<()> {
    for (i, (name, var)) in params.iter().enumerate() {
        if name.ends_with(lora::LORA_B) {
            let n = var.elem_count();
            let v: Vec<f32> = (0..n).map(|k| ((k * 37 + i * 11) % 23) as f32 / 23.0 - 0.5).collect();
            var.set(&(Tensor::from_vec(v, var.shape(), &Device::Cpu)? * (2.0 * std as f64))?)?;
        }
    }
    Ok(())
}

fn lora(dim: usize, module_name: &str) -> LoraConfig {
    LoraConfig { dim, alpha: None, module_name: module_name.into() }
}

#[test]
fn fresh_adapters_leave_the_outputs_unchanged() -> Result<()> {
    let cfg = small();
    let mut params = ParamStore::init(&cfg, 1, &Device::Cpu)?;
    let before = logits(&params, &cfg)?;
    let targets = params.add_lora(&cfg, &lora(4, "h."), 1)?;
    assert_eq!(targets.len(), 8, "four linears per block, two blocks");
    assert!(params.get("h.1.mlp.c_fc.lora_A.weight").is_some());
    assert_eq!(params.get("h.1.mlp.c_fc.lora_B.weight").map(|v| v.dims().to_vec()), Some(vec![64, 4]));
    assert_eq!(max_abs_diff(&before, &logits(&params, &cfg)?)?, 0.0, "B = 0: bit-identical outputs");
    Ok(())
}

#[test]
fn the_module_name_selects_the_linears() -> Result<()> {
    let cfg = small();
    let mut params = ParamStore::init(&cfg, 1, &Device::Cpu)?;
    assert_eq!(
        params.add_lora(&cfg, &lora(2, "attn"), 1)?,
        ["h.0.attn.c_attn", "h.0.attn.c_proj", "h.1.attn.c_attn", "h.1.attn.c_proj"]
    );
    let mut params = ParamStore::init(&cfg, 1, &Device::Cpu)?;
    let err = params.add_lora(&cfg, &lora(2, "decoder.layers."), 1).unwrap_err().to_string();
    assert!(err.contains("--lora-module-name") && err.contains("h."), "{err}");
    Ok(())
}

#[test]
fn fused_weights_give_the_unfused_logits() -> Result<()> {
    let cfg = small();
    for config in [lora(4, "h."), LoraConfig { dim: 2, alpha: Some(8.0), module_name: "mlp".into() }] {
        let mut params = ParamStore::init(&cfg, 2, &Device::Cpu)?;
        let base = logits(&params, &cfg)?;
        params.add_lora(&cfg, &config, 2)?;
        perturb_b(&params, 0.5)?;
        let unfused = logits(&params, &cfg)?;
        assert!(max_abs_diff(&base, &unfused)? > 1e-3, "the adapters must matter for this test");
        let merged = params.merged()?;
        assert!(merged.names.iter().all(|n| !n.contains("lora")), "merged weights carry no adapters");
        let d = max_abs_diff(&unfused, &logits(&merged, &cfg)?)?;
        println!("{config:?}: max |unfused - fused| = {d:e}");
        assert!(d < 1e-5, "fused and unfused logits differ by {d}");
        // Merging copies: the store's own weights are untouched.
        let w = params.get("h.0.mlp.c_fc.weight").expect("weight");
        assert!(max_abs_diff(w.as_tensor(), merged.get("h.0.mlp.c_fc.weight").expect("weight"))? > 0.0);
        assert_eq!(max_abs_diff(&unfused, &logits(&params, &cfg)?)?, 0.0);
    }
    Ok(())
}

#[test]
fn gradients_reach_a_and_b_and_match_finite_differences() -> Result<()> {
    let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..small() };
    let mut params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
    params.add_lora(&cfg, &LoraConfig { dim: 2, alpha: Some(4.0), module_name: "h.".into() }, 3)?;
    perturb_b(&params, 0.5)?;
    let model = params.model(&cfg)?;
    let ids = ids()?;
    let loss = || -> Result<f32> { Ok(model.lm_loss(&ids, &ids, None)?.to_scalar()?) };
    let grads = model.lm_loss(&ids, &ids, None)?.backward()?;
    for name in ["h.0.attn.c_attn.lora_A.weight", "h.1.mlp.c_proj.lora_B.weight", "h.0.mlp.c_fc.lora_B.weight"] {
        let var: &Var = params.get(name).expect("adapter");
        let g: Vec<f32> = grads.get(var.as_tensor()).expect("adapter has a gradient").flatten_all()?.to_vec1()?;
        assert!(g.iter().any(|x| x.abs() > 1e-6), "{name}: gradient is zero");
        let w0: Vec<f32> = var.flatten_all()?.to_vec1()?;
        let eps = 1e-2f32;
        for i in [0, w0.len() / 2, w0.len() - 1] {
            let set = |w: Vec<f32>| var.set(&Tensor::from_vec(w, var.shape(), &Device::Cpu)?);
            let mut w = w0.clone();
            w[i] += eps;
            set(w.clone())?;
            let up = loss()?;
            w[i] -= 2.0 * eps;
            set(w)?;
            let down = loss()?;
            set(w0.clone())?;
            let fd = (up - down) / (2.0 * eps);
            assert!((fd - g[i]).abs() < 2e-3 * (1.0 + fd.abs()), "{name}[{i}]: fd {fd} vs autograd {}", g[i]);
        }
    }
    Ok(())
}

#[test]
fn only_optimize_lora_changes_nothing_but_the_adapters_and_the_head() -> Result<()> {
    let cfg = small();
    let mut params = ParamStore::init(&cfg, 4, &Device::Cpu)?;
    add_score_head(&mut params, &cfg, 4, &Device::Cpu)?;
    params.add_lora(&cfg, &lora(4, "h."), 4)?;
    params.freeze_trunk();
    let trainable = params.trainable();
    let n_adapters = 16;
    assert_eq!(trainable.names.len(), n_adapters + 1, "adapters and score.weight: {:?}", trainable.names);
    assert!(trainable.get(SCORE_WEIGHT).is_some(), "DS-Chat's step 2 keeps optimizing the head");
    let before = params.copy()?;

    let model = params.model(&cfg)?;
    let ids = ids()?;
    let loss = model.lm_loss(&ids, &ids, None)?;
    let store = loss.backward()?;
    for (name, var) in params.iter() {
        let has = store.get(var.as_tensor()).is_some();
        assert_eq!(has, lora::is_adapter_name(name), "{name}: gradient only for adapters");
    }
    let schedule = LrSchedule::constant(1e-2);
    let adam = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() }; // decay would show on frozen weights
    let mut trainer = Trainer::new(&trainable, adam, schedule, 1, 1.0)?;
    trainer.set_lora_learning_rate(&trainable, 5e-3);
    // The head gets a gradient of its own through a second loss, as a reward loss would give.
    trainer.grads().add(&store)?;
    let score = params.get(SCORE_WEIGHT).expect("head").as_tensor().sqr()?.sum_all()?;
    trainer.grads().add(&score.backward()?)?;
    trainer.micro_batch_done(&trainable)?.expect("one micro-batch per step");

    for (name, var) in params.iter() {
        let d = max_abs_diff(var.as_tensor(), before.get(name).expect("same names"))?;
        if name.ends_with(lora::LORA_B) || name == SCORE_WEIGHT {
            assert!(d > 0.0, "{name} must have been updated");
        } else if !lora::is_adapter_name(name) {
            assert_eq!(d, 0.0, "{name} is frozen but changed by {d}");
        }
    }
    Ok(())
}

#[test]
fn checkpointed_backward_gives_the_adapters_the_same_gradients() -> Result<()> {
    let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..small() };
    let mut params = ParamStore::init(&cfg, 5, &Device::Cpu)?;
    params.add_lora(&cfg, &lora(2, "h."), 5)?;
    perturb_b(&params, 0.3)?;
    params.freeze_trunk();
    let trainable = params.trainable();
    let model = params.model(&cfg)?;
    let ids = ids()?;
    let mut grads = Vec::new();
    for checkpoint_activations in [false, true] {
        let mut acc = GradAccumulator::new(&trainable);
        let how = Backward { checkpoint_activations, loss_scale: 1.0 };
        lm_forward_backward(&model, &ids, &ids, None, how, &mut acc)?;
        grads.push(acc.finish()?);
    }
    for ((name, a), b) in trainable.names.iter().zip(&grads[0]).zip(&grads[1]) {
        let d = max_abs_diff(a, b)?;
        assert!(d < 1e-6, "{name}: checkpointed gradient differs by {d}");
    }
    Ok(())
}

#[test]
fn a_saved_model_has_lora_merged_and_gives_the_unfused_logits() -> Result<()> {
    let cfg = small();
    let mut params = ParamStore::init(&cfg, 6, &Device::Cpu)?;
    params.add_lora(&cfg, &LoraConfig { dim: 4, alpha: Some(2.0), module_name: "h.".into() }, 6)?;
    perturb_b(&params, 0.5)?;
    let unfused = logits(&params, &cfg)?;
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("actor");
    save_model_dir(&out, &cfg, &params, &|_| Ok(()))?;
    let files = load_model_dir(&out, &Device::Cpu)?;
    assert!(files.extra_tensors.is_empty(), "no adapter tensor is saved: {:?}", files.extra_tensors.keys());
    let raw = hybrid_engine::checkpoints::hf_io::read_safetensors(&out.join("model.safetensors"), &Device::Cpu)?;
    assert!(raw.keys().all(|k| !k.contains("lora")), "{:?}", raw.keys());
    let loaded = ParamStore::from_tensors(&files.config, &files.tensors, &Device::Cpu)?;
    let d = max_abs_diff(&unfused, &logits(&loaded, &files.config)?)?;
    println!("saved (merged) vs unfused logits: max |diff| = {d:e}");
    assert!(d < 1e-5, "the saved model's logits differ from the unfused model's by {d}");
    Ok(())
}

#[test]
fn peft_adapters_attach_to_a_base_model() -> Result<()> {
    let cfg = small();
    let mut trained = ParamStore::init(&cfg, 7, &Device::Cpu)?;
    let config = LoraConfig { dim: 2, alpha: Some(3.0), module_name: "c_proj".into() };
    trained.add_lora(&cfg, &config, 7)?;
    perturb_b(&trained, 0.4)?;
    let dir = tempfile::tempdir()?;
    let adapter = lora::peft::PeftAdapter::new(&config, "base", "CAUSAL_LM", trained.adapters());
    lora::peft::save_peft_adapter(dir.path(), &adapter)?;
    let back = lora::peft::load_peft_adapter(dir.path(), &Device::Cpu)?;
    let mut base = ParamStore::init(&cfg, 7, &Device::Cpu)?;
    base.add_adapters(back.scaling(), &back.adapters)?;
    assert_eq!(max_abs_diff(&logits(&trained, &cfg)?, &logits(&base, &cfg)?)?, 0.0, "same base, same adapters");
    Ok(())
}
