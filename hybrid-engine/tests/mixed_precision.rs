//! Mixed precision end to end on the trainer: fp16 overflow handling (skip, hysteresis, halving,
//! unscaled gradients) and short fp16 / bf16 runs that track the fp32 loss curve.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::training::optim::AdamWConfig;
use hybrid_engine::training::precision::{Dtype, LossScaling, Precision};
use hybrid_engine::training::schedule::LrSchedule;
use hybrid_engine::training::train_step::{lm_forward_backward, Backward};
use hybrid_engine::training::trainer::Trainer;
use hybrid_engine::ParamStore;

fn schedule(lr: f64) -> LrSchedule {
    LrSchedule::constant(lr)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(a.to_dtype(DType::F32)?.sub(&b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar()?)
}

/// A batch of token ids with a learnable pattern (each row counts up from its own start), so
/// that a few steps lower the loss clearly.
fn batch(step: usize, b: usize, t: usize, vocab: u32) -> Result<(Tensor, Tensor)> {
    let row = |r: usize, k: usize| ((7 * (step * b + r) + 3 * k) as u32) % vocab;
    let ids: Vec<u32> = (0..b).flat_map(|r| (0..t).map(move |k| row(r, k))).collect();
    let targets: Vec<u32> = (0..b).flat_map(|r| (0..t).map(move |k| row(r, k + 1))).collect();
    Ok((Tensor::from_vec(ids, (b, t), &Device::Cpu)?, Tensor::from_vec(targets, (b, t), &Device::Cpu)?))
}

#[test]
fn fp16_overflow_skips_the_step_and_halves_the_scale_after_the_hysteresis() -> Result<()> {
    let cfg = Gpt2Config { n_layer: 2, n_embd: 32, n_head: 2, n_positions: 16, vocab_size: 64, ..Gpt2Config::tiny() };
    let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..cfg };
    let master = ParamStore::init(&cfg, 3, &Device::Cpu)?;
    let compute = master.compute_copy(DType::F16)?;
    let model = compute.model(&cfg)?;
    let precision = Precision { dtype: Dtype::Fp16, fp32_loss: false };
    let mut trainer = Trainer::new(&master, AdamWConfig::default(), schedule(1e-3), 1, 1.0)?.with_precision(
        precision,
        &compute,
        LossScaling { initial_scale_power: 16, window: 1000 },
    );
    assert_eq!(trainer.loss_scale(), 65536.0);
    let (ids, targets) = batch(0, 2, 8, 64)?;
    let before = master.copy()?;

    // Injected overflow: a loss factor of 1e30 on top of the scale makes every gradient inf.
    let overflowing = |t: &mut Trainer| -> Result<_> {
        let how = Backward { checkpoint_activations: false, loss_scale: 1e30 * t.loss_scale() };
        lm_forward_backward(&model, &ids, &targets, None, how, t.grads())?;
        Ok(t.micro_batch_done(&master)?.expect("one micro-batch per step"))
    };
    let first = overflowing(&mut trainer)?;
    assert!(first.skipped && !first.grad_norm.is_finite());
    assert_eq!((first.loss_scale, first.skipped_steps, first.step), (65536.0, 1, 1), "hysteresis 2 absorbs one");
    let second = overflowing(&mut trainer)?;
    assert!(second.skipped);
    assert_eq!((second.loss_scale, second.skipped_steps), (32768.0, 2), "halved after the second overflow");
    assert_eq!(trainer.optimizer.step, 0, "no update was applied");
    for (name, var) in master.iter() {
        assert_eq!(max_abs_diff(var.as_tensor(), before.get(name).unwrap())?, 0.0, "{name} changed on a skip");
    }

    // A clean step: the gradient the optimizer sees is unscaled (the fp32 model's, up to fp16
    // rounding), and the compute copy is refreshed from the updated masters.
    let how = Backward { checkpoint_activations: false, loss_scale: trainer.loss_scale() };
    lm_forward_backward(&model, &ids, &targets, None, how, trainer.grads())?;
    let clean = trainer.micro_batch_done(&master)?.expect("a step");
    assert!(!clean.skipped && clean.grad_norm.is_finite());
    let fp32 = before.model(&cfg)?;
    let mut acc = hybrid_engine::training::optim::GradAccumulator::new(&before);
    lm_forward_backward(
        &fp32,
        &ids,
        &targets,
        None,
        Backward { checkpoint_activations: false, loss_scale: 1.0 },
        &mut acc,
    )?;
    let want = hybrid_engine::training::optim::global_grad_norm(&acc.finish()?)?;
    assert!((clean.grad_norm - want).abs() < 0.01 * want, "unscaled norm {} vs fp32 {want}", clean.grad_norm);
    assert_eq!(trainer.optimizer.step, 1);
    for (name, var) in master.iter() {
        let copy = compute.get(name).unwrap();
        assert_eq!(copy.dtype(), DType::F16);
        assert_eq!(max_abs_diff(copy.as_tensor(), &var.to_dtype(DType::F16)?)?, 0.0, "{name} not refreshed");
    }
    Ok(())
}

/// Losses of `steps` AdamW steps of the tiny model computing in `dtype`, and the steps skipped.
fn loss_curve(dtype: Dtype, fp32_loss: bool, initial_scale_power: u32, steps: usize) -> Result<(Vec<f32>, u64)> {
    let cfg = Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..Gpt2Config::tiny() };
    let master = ParamStore::init(&cfg, 11, &Device::Cpu)?;
    let compute = master.compute_copy(dtype.dtype())?;
    let mut model = compute.model(&cfg)?;
    model.fp32_loss = fp32_loss;
    let scaling = LossScaling { initial_scale_power, window: 1000 };
    let mut trainer = Trainer::new(&master, AdamWConfig::default(), schedule(3e-3), 1, 1.0)?.with_precision(
        Precision { dtype, fp32_loss },
        &compute,
        scaling,
    );
    let mut losses = Vec::new();
    for step in 0..steps {
        let (ids, targets) = batch(step % 4, 4, 32, 1000)?;
        let how = Backward { checkpoint_activations: false, loss_scale: trainer.loss_scale() };
        losses.push(lm_forward_backward(&model, &ids, &targets, None, how, trainer.grads())?);
        let report = trainer.micro_batch_done(&master)?.expect("a step");
        assert!(!report.skipped || dtype == Dtype::Fp16, "only fp16 may skip");
    }
    Ok((losses, trainer.skipped_steps()))
}

/// Stated tolerance: over 12 steps that take the fp32 loss from 10.8 to about 7, every step's
/// fp16 loss is within 0.5% and every bf16 loss within 1% of the fp32 run's (measured on
/// 2026-11-22: at most 0.06% for fp16, 0.19% for bf16, with or without --compute-fp32-loss). fp16 starts at a loss scale of 2^8 here, where no step overflows, so the curves are
/// step-aligned; from DeepSpeed's 2^16 the first steps overflow and are skipped, as in DeepSpeed,
/// and the run still learns.
#[test]
fn fp16_and_bf16_runs_track_the_fp32_loss_curve() -> Result<()> {
    let steps = 12;
    let (fp32, _) = loss_curve(Dtype::Fp32, false, 16, steps)?;
    assert!(fp32[steps - 1] < fp32[0] - 2.0, "the fp32 run must learn: {fp32:?}");
    for (dtype, fp32_loss, tol) in [(Dtype::Fp16, false, 0.005), (Dtype::Bf16, false, 0.01), (Dtype::Bf16, true, 0.01)]
    {
        let (half, skipped) = loss_curve(dtype, fp32_loss, 8, steps)?;
        assert_eq!(skipped, 0, "{dtype:?}: no overflow expected at scale 2^8");
        let worst = fp32.iter().zip(&half).map(|(a, b)| (a - b).abs() / a).fold(0f32, f32::max);
        eprintln!("{dtype:?} (fp32 loss {fp32_loss}): largest relative loss difference {worst:.4}");
        for (i, (a, b)) in fp32.iter().zip(&half).enumerate() {
            let rel = (a - b).abs() / a;
            assert!(
                rel < tol,
                "{dtype:?} (fp32 loss {fp32_loss}) step {i}: {b} vs fp32 {a} ({rel:.4} > {tol})\n{half:?}\n{fp32:?}"
            );
        }
    }
    let (from_2_16, skipped) = loss_curve(Dtype::Fp16, false, 16, steps)?;
    assert!(skipped > 0, "2^16 overflows at first on this model");
    assert!(from_2_16[steps - 1] < from_2_16[0] - 1.0, "and still learns: {from_2_16:?}");
    Ok(())
}
