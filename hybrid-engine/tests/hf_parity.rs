//! Parity with Hugging Face transformers on a committed fixture (see
//! `tests/fixtures/gpt2_parity/README.md`, made by `scripts/fixtures/make_gpt2_parity.py`):
//! a random GPT-2 of unusual shape (3 layers, n_embd 96, 6 heads, 64 positions, vocab 211).
//! Tolerances: logits 1e-5 max abs, loss 1e-6 relative, gradients 1e-4 relative, greedy tokens
//! identical. Also checks that the KV cache and activation checkpointing change nothing.

use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor};
use hybrid_engine::checkpoints::hf_io::{load_model_dir, read_safetensors};
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::{Dropout, Gpt2Cache};
use hybrid_engine::model::positions::Positions;
use hybrid_engine::training::optim::GradAccumulator;
use hybrid_engine::training::train_step::{lm_forward_backward, Backward};
use hybrid_engine::{Gpt2, ParamStore};
use std::collections::HashMap;
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2_parity")
}

struct Fixture {
    params: ParamStore,
    model: Gpt2,
    expected: HashMap<String, Tensor>,
}

fn load() -> Result<Fixture> {
    let files = load_model_dir(&fixture_dir().join("model"), &Device::Cpu)?;
    let params = ParamStore::from_tensors(&files.config, &files.tensors, &Device::Cpu)?;
    let model = params.model(&files.config)?;
    let expected = read_safetensors(&fixture_dir().join("expected.safetensors"), &Device::Cpu)?;
    Ok(Fixture { params, model, expected })
}

fn ids(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::U32)?)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(a.sub(b)?.abs()?.flatten_all()?.max(0)?.to_scalar()?)
}

#[test]
fn logits_and_loss_match_transformers() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let logits = f.model.forward(&input, &Positions::default(), None, None)?;
    let d = max_abs_diff(&logits, &f.expected["logits"])?;
    println!("logits max abs diff {d:e}");
    assert!(d < 1e-5, "logits differ from transformers by {d}");

    let (b, t) = input.dims2()?;
    let loss = f.model.lm_loss(&input.narrow(1, 0, t - 1)?, &input.narrow(1, 1, t - 1)?, None)?;
    let (ours, theirs) = (loss.to_scalar::<f32>()?, f.expected["loss"].to_vec1::<f32>()?[0]);
    println!("loss ours {ours} transformers {theirs} (B={b})");
    assert!(((ours - theirs) / theirs).abs() < 1e-6, "loss {ours} vs {theirs}");
    Ok(())
}

/// Every trainable parameter gets the gradient transformers computes, with and without
/// activation checkpointing.
#[test]
fn every_parameter_gradient_matches_transformers() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let t = input.dim(1)?;
    let (x, y) = (input.narrow(1, 0, t - 1)?, input.narrow(1, 1, t - 1)?);
    for checkpoint in [false, true] {
        let mut acc = GradAccumulator::new(&f.params);
        lm_forward_backward(
            &f.model,
            &x,
            &y,
            None,
            Backward { checkpoint_activations: checkpoint, loss_scale: 1.0 },
            &mut acc,
        )?;
        let grads = acc.finish()?;
        let mut worst = 0f32;
        for (name, g) in f.params.names.iter().zip(&grads) {
            let want = &f.expected[&format!("grad.transformer.{name}")];
            let scale: f32 = want.abs()?.flatten_all()?.max(0)?.to_scalar()?;
            // Regression: gradients kept across micro-batches must not hold the graph (and with it
            // the step's activations) alive; candle leaves variables' gradients attached.
            assert!(!g.track_op(), "gradient of {name} still carries its backward graph");
            let rel = max_abs_diff(g, want)? / scale;
            assert!(rel < 1e-4, "gradient of {name} (checkpoint {checkpoint}) off by {rel} relative");
            worst = worst.max(rel);
        }
        println!(
            "checkpoint_activations={checkpoint}: worst gradient relative diff {worst:e} over {} tensors",
            grads.len()
        );
    }
    Ok(())
}

#[test]
fn left_padded_batch_matches_transformers_on_real_positions() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["padded_input_ids"])?;
    let mask = &f.expected["padded_attention_mask"].to_dtype(DType::U32)?;
    let pos = ids(&f.expected["padded_position_ids"])?;
    let logits =
        f.model.forward(&input, &Positions { position_ids: Some(&pos), attention_mask: Some(mask) }, None, None)?;
    let want = &f.expected["padded_logits"];
    let m: Vec<Vec<u32>> = mask.to_vec2()?;
    for (r, row) in m.iter().enumerate() {
        for (i, real) in row.iter().enumerate() {
            if *real == 1 {
                let d = max_abs_diff(&logits.i((r, i))?, &want.i((r, i))?)?;
                assert!(d < 1e-5, "row {r} position {i}: {d}");
            }
        }
    }
    Ok(())
}

#[test]
fn greedy_generation_matches_transformers_single_and_left_padded_batch() -> Result<()> {
    let f = load()?;
    let to_rows = |t: &Tensor| -> Result<Vec<Vec<u32>>> { Ok(ids(t)?.to_vec2()?) };
    let prompt = to_rows(&f.expected["greedy_prompt"])?;
    let want = to_rows(&f.expected["greedy_tokens"])?;
    let cfg = SamplingConfig::greedy(20, None, 210, 211);
    let got = generate(&f.model, &prompt, &cfg, &Device::Cpu)?;
    assert_eq!(got[0], want[0][prompt[0].len()..], "single-prompt greedy continuation");

    let padded = to_rows(&f.expected["batch_greedy_prompt"])?;
    let mask = to_rows(&f.expected["batch_greedy_attention_mask"])?;
    let prompts: Vec<Vec<u32>> = padded
        .iter()
        .zip(&mask)
        .map(|(p, m)| p.iter().zip(m).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect())
        .collect();
    let want = to_rows(&f.expected["batch_greedy_tokens"])?;
    let got = generate(&f.model, &prompts, &SamplingConfig::greedy(12, None, 210, 211), &Device::Cpu)?;
    for r in 0..2 {
        assert_eq!(got[r], want[r][padded[r].len()..], "batch row {r}");
    }
    Ok(())
}

/// Decoding token by token with the KV cache gives the logits of one full forward.
#[test]
fn kv_cache_decoding_equals_full_forward() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let full = f.model.forward(&input, &Positions::default(), None, None)?;
    let mut cache = Gpt2Cache::new(&f.model.cfg, 16);
    let prefill = f.model.forward(&input.narrow(1, 0, 5)?, &Positions::default(), Some(&mut cache), None)?;
    let mut worst = max_abs_diff(&prefill, &full.narrow(1, 0, 5)?)?;
    for t in 5..16 {
        let step = f.model.forward(&input.narrow(1, t, 1)?, &Positions::default(), Some(&mut cache), None)?;
        worst = worst.max(max_abs_diff(&step, &full.narrow(1, t, 1)?)?);
    }
    println!("cached vs full max abs diff {worst:e}");
    assert!(worst < 1e-5, "KV-cache logits differ by {worst}");
    Ok(())
}

/// With dropout on, checkpointing recomputes each block with the same masks: same loss and
/// gradients as keeping the activations.
#[test]
fn activation_checkpointing_with_dropout_gives_identical_gradients() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let t = input.dim(1)?;
    let (x, y) = (input.narrow(1, 0, t - 1)?, input.narrow(1, 1, t - 1)?);
    let drop = Dropout::from_config(&f.model.cfg, DropoutKey { seed: 5, step: 2, micro_batch: 1 });
    let run = |ckpt: bool| -> Result<(f32, Vec<Tensor>)> {
        let mut acc = GradAccumulator::new(&f.params);
        let loss = lm_forward_backward(
            &f.model,
            &x,
            &y,
            Some(&drop),
            Backward { checkpoint_activations: ckpt, loss_scale: 1.0 },
            &mut acc,
        )?;
        Ok((loss, acc.finish()?))
    };
    let (l0, g0) = run(false)?;
    let (l1, g1) = run(true)?;
    let eval_loss = f.model.lm_loss(&x, &y, None)?.to_scalar::<f32>()?;
    assert_ne!(l0, eval_loss, "dropout must change the training loss");
    assert_eq!(l0, l1, "same masks, same loss");
    for ((name, a), b) in f.params.names.iter().zip(&g0).zip(&g1) {
        let scale: f32 = a.abs()?.flatten_all()?.max(0)?.to_scalar()?;
        let rel = max_abs_diff(a, b)? / scale.max(1e-12);
        assert!(rel < 1e-5, "{name}: checkpointed gradient differs by {rel}");
    }
    Ok(())
}

/// The fused CPU kernels (LayerNorm, masked softmax, bias + GELU, dropout, cross-entropy) give
/// every trainable parameter the gradient the composed reference ops give, with dropout on,
/// with and without activation checkpointing.
#[test]
fn fused_kernels_give_every_parameter_the_reference_ops_gradient() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let t = input.dim(1)?;
    let (x, y) = (input.narrow(1, 0, t - 1)?, input.narrow(1, 1, t - 1)?);
    let drop = Dropout::from_config(&f.model.cfg, DropoutKey { seed: 9, step: 4, micro_batch: 0 });
    for checkpoint in [false, true] {
        let run = || -> Result<(f32, Vec<Tensor>)> {
            let mut acc = GradAccumulator::new(&f.params);
            let how = Backward { checkpoint_activations: checkpoint, loss_scale: 1.0 };
            let loss = lm_forward_backward(&f.model, &x, &y, Some(&drop), how, &mut acc)?;
            Ok((loss, acc.finish()?))
        };
        let (fused_loss, fused) = run()?;
        let (reference_loss, reference) = hybrid_engine::kernels::ops::with_reference_ops(run)?;
        assert!(((fused_loss - reference_loss) / reference_loss).abs() < 1e-6, "loss {fused_loss} vs {reference_loss}");
        let mut worst = 0f32;
        for ((name, a), b) in f.params.names.iter().zip(&fused).zip(&reference) {
            let scale: f32 = b.abs()?.flatten_all()?.max(0)?.to_scalar()?;
            let rel = max_abs_diff(a, b)? / scale.max(1e-12);
            assert!(rel < 1e-5, "{name} (checkpoint {checkpoint}): fused gradient differs by {rel} relative");
            worst = worst.max(rel);
        }
        println!("checkpoint_activations={checkpoint}: fused vs reference worst relative diff {worst:e}");
    }
    Ok(())
}

/// As above with a left-padded batch, as PPO trains on it: an attention mask with a padding row
/// per sequence (a (B, 1, T, T) bias), position ids that skip the padding, and a head reading
/// log-softmax values at some positions (the actor's loss).
#[test]
fn fused_kernels_match_the_reference_ops_on_left_padded_batches() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?; // (B, T)
    let (b, t) = input.dims2()?;
    let pad = [0usize, 3];
    let mask: Vec<u32> = (0..b).flat_map(|r| (0..t).map(move |j| u32::from(j >= pad[r % 2]))).collect();
    let positions = hybrid_engine::generation::generate::position_ids(&mask, b, t);
    let mask = Tensor::from_vec(mask, (b, t), &candle_core::Device::Cpu)?;
    let positions = Tensor::from_vec(positions, (b, t), &candle_core::Device::Cpu)?;
    let pos =
        hybrid_engine::model::positions::Positions { position_ids: Some(&positions), attention_mask: Some(&mask) };
    let drop = Dropout::from_config(&f.model.cfg, DropoutKey { seed: 5, step: 1, micro_batch: 0 });
    let next = input.narrow(1, 4, t - 4)?.unsqueeze(2)?.contiguous()?; // (B, T-4, 1)
    for checkpoint in [false, true] {
        let run = || -> Result<(f32, Vec<Tensor>)> {
            let mut acc = GradAccumulator::new(&f.params);
            let how = Backward { checkpoint_activations: checkpoint, loss_scale: 1.0 };
            let loss = hybrid_engine::training::train_step::forward_backward(
                &f.model,
                &input,
                &pos,
                Some(&drop),
                how,
                &mut acc,
                |h| {
                    let h = h.narrow(1, 3, t - 4)?; // (B, T-4, C)
                    let logp = hybrid_engine::kernels::ops::log_softmax_last_dim(&f.model.lm_head(&h)?)?;
                    logp.gather(&next, 2)?.mean_all()?.neg()
                },
            )?;
            Ok((loss, acc.finish()?))
        };
        let (fused_loss, fused) = run()?;
        let (reference_loss, reference) = hybrid_engine::kernels::ops::with_reference_ops(run)?;
        assert!(((fused_loss - reference_loss) / reference_loss).abs() < 1e-5, "loss {fused_loss} vs {reference_loss}");
        for ((name, a), b) in f.params.names.iter().zip(&fused).zip(&reference) {
            let scale: f32 = b.abs()?.flatten_all()?.max(0)?.to_scalar()?;
            let rel = max_abs_diff(a, b)? / scale.max(1e-12);
            assert!(rel < 1e-4, "{name} (checkpoint {checkpoint}): fused gradient differs by {rel} relative");
        }
    }
    Ok(())
}

/// Two micro-batches of one row, each scaled by 1/2, accumulate the gradient of the two-row batch.
#[test]
fn gradient_accumulation_equals_the_full_batch_gradient() -> Result<()> {
    let f = load()?;
    let input = ids(&f.expected["input_ids"])?;
    let t = input.dim(1)?;
    let (x, y) = (input.narrow(1, 0, t - 1)?, input.narrow(1, 1, t - 1)?);
    let full = Backward { checkpoint_activations: false, loss_scale: 1.0 };
    let mut acc = GradAccumulator::new(&f.params);
    lm_forward_backward(&f.model, &x, &y, None, full, &mut acc)?;
    let want = acc.finish()?;
    let half = Backward { checkpoint_activations: false, loss_scale: 0.5 };
    let mut acc = GradAccumulator::new(&f.params);
    for row in 0..2 {
        lm_forward_backward(&f.model, &x.narrow(0, row, 1)?, &y.narrow(0, row, 1)?, None, half, &mut acc)?;
    }
    for ((name, a), b) in f.params.names.iter().zip(&want).zip(&acc.finish()?) {
        let scale: f32 = a.abs()?.flatten_all()?.max(0)?.to_scalar()?;
        let rel = max_abs_diff(a, b)? / scale.max(1e-12);
        assert!(rel < 1e-5, "{name}: accumulated gradient differs by {rel}");
    }
    Ok(())
}

/// Generation stops a row at EOS (kept as its last token) while other rows continue.
#[test]
fn generation_stops_each_row_at_eos() -> Result<()> {
    let f = load()?;
    let prompt: Vec<Vec<u32>> = ids(&f.expected["greedy_prompt"])?.to_vec2()?;
    let free = generate(&f.model, &prompt, &SamplingConfig::greedy(20, None, 210, 211), &Device::Cpu)?.remove(0);
    let eos = free[3];
    let first = free.iter().position(|&t| t == eos).unwrap();
    let mut cfg = SamplingConfig::greedy(20, Some(eos), 210, 211);
    let stopped = generate(&f.model, &prompt, &cfg, &Device::Cpu)?.remove(0);
    assert_eq!(stopped, free[..=first], "stops right after the first EOS");
    // In a batch, the row that hits EOS stops; the other runs to the limit.
    let other: Vec<Vec<u32>> = ids(&f.expected["input_ids"])?.narrow(1, 0, 6)?.to_vec2()?;
    cfg.max_new_tokens = 10;
    let batch = generate(&f.model, &[prompt[0].clone(), other[0].clone()], &cfg, &Device::Cpu)?;
    assert_eq!(batch[0], free[..=first.min(9)]);
    let alone = generate(&f.model, &[other[0].clone()], &cfg, &Device::Cpu)?.remove(0);
    assert_eq!(batch[1], alone, "a finished row does not disturb the others");
    Ok(())
}
