//! Checks the CUDA path against the CPU on the same weights, one line per check, and exits 1 if
//! any fails (scripts/gpu-check.sh runs it on the GPU machine):
//!
//! - `logits`: fp32 logits of a (2, T) batch, CUDA against CPU (max |diff| <= 1e-4);
//! - `grads`: the LM loss and the gradient of every parameter (each max |diff| <= 1e-4 of that
//!   gradient's largest value; a parameter without a gradient fails);
//! - `logits-bf16`, `logits-fp16`: the model in half precision on CUDA against fp32 on the CPU
//!   (max |diff| <= 5% of the largest logit: rounding, not a wrong kernel);
//! - `dropout-f32`, `dropout-bf16`, `dropout-fp16`: the dropout kernel (its mask drawn on the
//!   device) against the CPU's factors, drawn on the host and multiplied in that dtype: equal bit
//!   for bit;
//! - `generate`: greedy generation with the KV cache, the same tokens on both devices;
//! - `generate-sampled`: the same with temperature, top-k and top-p sampling and one seed;
//! - `train-step`: one step of the training path (dropout at the model's rates, backward, clip to
//!   norm 1.0, AdamW) from the same weights on each device: the gradient norms agree to 1e-4 and
//!   the updates (new - old weights) to 1e-3 of their norm (AdamW's first step divides each
//!   gradient by its own size, so elements near zero amplify rounding: a norm, not a max);
//! - `nccl`: a one-rank NCCL communicator's all-reduce (sum, max), reduce-scatter, all-gather and
//!   broadcast on CUDA tensors in f32, bf16 and f16 (the identity at world size 1, in the input's
//!   dtype: NCCL loads, and its calls go through).
//!
//! Usage: `gpu_check [--model tiny|gpt2|gpt2-medium | --path MODEL_DIR] [--device cuda:N] [--seq T]`
//! (default: a random-init gpt2, cuda:0, T = 128). With `--device cpu` the second side runs the
//! composed reference ops that CUDA runs (`kernels::ops::with_reference_ops`) against the fused
//! CPU kernels: the same checks, without a GPU.

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir};
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::kernels::ops::{dropout, dropout_reference, with_reference_ops, DropoutKey};
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::training::optim::{clip_and_step, AdamW, AdamWConfig, GradAccumulator};
use hybrid_engine::training::train_step::{lm_forward_backward, Backward};
use hybrid_engine::{Gpt2Config, ParamStore};

struct Args {
    model: String,
    path: Option<String>,
    device: String,
    seq: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { model: "gpt2".into(), path: None, device: "cuda:0".into(), seq: 128 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--path" => args.path = Some(value()?),
            "--device" => args.device = value()?,
            "--seq" => args.seq = value()?.parse().map_err(|_| anyhow!("--seq takes a number of tokens"))?,
            _ => bail!("unknown flag {flag}: gpu_check [--model NAME | --path MODEL_DIR] [--device cuda:N] [--seq T]"),
        }
    }
    Ok(args)
}

/// The largest |a - b| and the largest |b|, over all elements (both moved to the CPU as f32).
fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?;
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
    Ok((diff, b.abs()?.max(0)?.to_scalar::<f32>()?))
}

/// Runs the second side's `f`: on CUDA as it is; on the CPU (no GPU at hand) with the composed
/// reference ops that CUDA runs in place of the fused CPU kernels.
fn second<R>(cpu_only: bool, f: impl FnOnce() -> Result<R>) -> Result<R> {
    if cpu_only {
        with_reference_ops(f)
    } else {
        f()
    }
}

/// Prints one check's line; returns whether it passed.
fn report(name: &str, pass: bool, detail: String) -> bool {
    println!("{} {name}: {detail}", if pass { "PASS" } else { "FAIL" });
    pass
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let cuda = hybrid_engine::device::parse_device(&args.device)?;
    let cpu = Device::Cpu;
    let (cfg, tensors) = match &args.path {
        Some(p) => {
            let files = load_model_dir(&resolve_model_dir(p)?, &cpu)?;
            (files.config, files.tensors)
        }
        None => {
            let cfg = Gpt2Config::from_preset(&args.model).ok_or_else(|| anyhow!("no model preset {}", args.model))?;
            let tensors = ParamStore::init(&cfg, 1234, &cpu)?.tensors();
            (cfg, tensors)
        }
    };
    let what = args.path.clone().unwrap_or_else(|| format!("random-init {}", args.model));
    let second_side = if cuda.is_cpu() { "the reference ops on the cpu".to_string() } else { args.device.clone() };
    println!("gpu_check: {what}, {} parameters, {second_side} against cpu", cfg.checked_parameter_count().unwrap_or(0));
    let on_cpu = ParamStore::from_tensors(&cfg, &tensors, &cpu)?;
    let on_gpu = ParamStore::from_tensors(&cfg, &tensors, &cuda)?;
    let (m_cpu, m_gpu) = (on_cpu.model(&cfg)?, on_gpu.model(&cfg)?);
    let sides = Sides { cfg: &cfg, on_cpu: &on_cpu, on_gpu: &on_gpu, m_cpu: &m_cpu, m_gpu: &m_gpu, cuda: &cuda };

    let (b, t) = (2, args.seq.min(cfg.n_positions));
    let vocab = cfg.vocab_size.min(50257) as u32;
    let ids: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let targets: Vec<u32> = ids.iter().map(|i| (i * 31 + 7) % vocab).collect();
    let ids_cpu = Tensor::from_vec(ids, (b, t), &cpu)?;
    let targets_cpu = Tensor::from_vec(targets, (b, t), &cpu)?;
    let (ids_gpu, targets_gpu) = (ids_cpu.to_device(&cuda)?, targets_cpu.to_device(&cuda)?);
    let mut ok = true;

    let logits_cpu = m_cpu.forward(&ids_cpu, &Positions::default(), None, None)?;
    let cpu_only = cuda.is_cpu();
    let logits_gpu = second(cpu_only, || Ok(m_gpu.forward(&ids_gpu, &Positions::default(), None, None)?))?;
    let (d, scale) = max_diff(&logits_gpu, &logits_cpu)?;
    ok &= report(
        "logits",
        d <= 1e-4,
        format!("fp32 {:?}: max |diff| {d:.3e} (largest |logit| {scale:.3})", logits_cpu.dims()),
    );

    ok &= gradients_check(&sides, &(&ids_cpu, &targets_cpu), &(&ids_gpu, &targets_gpu))?;

    for (label, dtype) in [("logits-bf16", DType::BF16), ("logits-fp16", DType::F16)] {
        let half = on_gpu.compute_copy(dtype)?.model(&cfg)?;
        let logits = half.forward(&ids_gpu, &Positions::default(), None, None)?;
        let (d, scale) = max_diff(&logits, &logits_cpu)?;
        ok &= report(
            label,
            d <= 0.05 * scale,
            format!("max |diff| {d:.3e} against fp32 cpu (largest |logit| {scale:.3})"),
        );
    }

    ok &= dropout_check(&cuda, cpu_only)?;

    ok &= generation_check(&sides)?;

    ok &= train_step_check(&sides, &(&ids_cpu, &targets_cpu), &(&ids_gpu, &targets_gpu))?;
    ok &= nccl_check(&cuda)?;
    if !ok {
        bail!("gpu_check: some checks failed");
    }
    println!("gpu_check: all passed");
    Ok(())
}

/// The same weights on both sides: the model and its parameters on the CPU and on the second
/// side (`cuda`: the GPU, or the CPU again).
#[derive(Clone, Copy)]
struct Sides<'a> {
    cfg: &'a Gpt2Config,
    on_cpu: &'a ParamStore,
    on_gpu: &'a ParamStore,
    m_cpu: &'a hybrid_engine::Gpt2,
    m_gpu: &'a hybrid_engine::Gpt2,
    cuda: &'a Device,
}

/// The LM loss and every parameter's gradient on both sides.
fn gradients_check(
    sides: &Sides,
    (ids_cpu, targets_cpu): &(&Tensor, &Tensor),
    (ids_gpu, targets_gpu): &(&Tensor, &Tensor),
) -> Result<bool> {
    let Sides { on_cpu, on_gpu, m_cpu, m_gpu, cuda, .. } = *sides;
    let (cpu, cpu_only) = (Device::Cpu, cuda.is_cpu());
    let mut ok = true;
    let loss_cpu = m_cpu.lm_loss(ids_cpu, targets_cpu, None)?;
    let g_cpu = loss_cpu.backward()?;
    let (loss_gpu, g_gpu) = second(cpu_only, || {
        let l = m_gpu.lm_loss(ids_gpu, targets_gpu, None)?;
        let g = l.backward()?;
        Ok((l, g))
    })?;
    let (l_cpu, l_gpu) = (loss_cpu.to_scalar::<f32>()?, loss_gpu.to_device(&cpu)?.to_scalar::<f32>()?);
    let (mut worst, mut worst_name, mut missing) = (0f32, String::new(), vec![]);
    for ((name, v_cpu), (_, v_gpu)) in on_cpu.iter().zip(on_gpu.iter()) {
        let (Some(gc), Some(gg)) = (g_cpu.get(v_cpu.as_tensor()), g_gpu.get(v_gpu.as_tensor())) else {
            missing.push(name.to_string());
            continue;
        };
        let (d, scale) = max_diff(gg, gc)?;
        let rel = d / scale.max(f32::MIN_POSITIVE);
        if rel > worst {
            (worst, worst_name) = (rel, name.to_string());
        }
    }
    let loss_ok = (l_cpu - l_gpu).abs() <= 1e-4 * l_cpu.abs().max(1.0);
    ok &= report(
        "grads",
        loss_ok && worst <= 1e-4 && missing.is_empty(),
        format!(
            "loss cpu {l_cpu:.6} second side {l_gpu:.6}; worst gradient {worst_name}: max |diff| / max |grad| {worst:.3e}; \
             {} of {} parameters without a gradient {missing:?}",
            missing.len(),
            on_cpu.names.len()
        ),
    );

    Ok(ok)
}

/// Greedy and sampled generation give the same tokens on both sides.
fn generation_check(sides: &Sides) -> Result<bool> {
    let Sides { cfg, m_cpu, m_gpu, cuda, .. } = *sides;
    let (cpu, cpu_only) = (Device::Cpu, cuda.is_cpu());
    let mut ok = true;
    let prompts: Vec<Vec<u32>> = vec![(1..9).collect(), (100..104).collect()];
    let greedy = SamplingConfig::greedy(24, None, 0, cfg.vocab_size);
    let tok_cpu = generate(m_cpu, &prompts, &greedy, &cpu)?;
    let tok_gpu = second(cpu_only, || generate(m_gpu, &prompts, &greedy, cuda))?;
    ok &= report(
        "generate",
        tok_cpu == tok_gpu,
        format!("greedy, 2 prompts x 24 tokens: cpu {tok_cpu:?} second side {tok_gpu:?}"),
    );
    // Sampling draws on the host and picks on the device: the CPU's tokens for the same seed
    // (fp32 logits agree to rounding, which moves a token only for a draw within rounding of a
    // boundary).
    let sampled =
        SamplingConfig { temperature: Some(0.9), top_k: Some(50), top_p: Some(0.9), seed: 7, ..greedy.clone() };
    let tok_cpu = generate(m_cpu, &prompts, &sampled, &cpu)?;
    let tok_gpu = second(cpu_only, || generate(m_gpu, &prompts, &sampled, cuda))?;
    ok &= report(
        "generate-sampled",
        tok_cpu == tok_gpu,
        format!("temperature 0.9, top-k 50, top-p 0.9, seed 7: cpu {tok_cpu:?} second side {tok_gpu:?}"),
    );

    Ok(ok)
}

/// One training step with dropout: the same gradient norm and update on both sides.
fn train_step_check(
    sides: &Sides,
    (ids_cpu, targets_cpu): &(&Tensor, &Tensor),
    (ids_gpu, targets_gpu): &(&Tensor, &Tensor),
) -> Result<bool> {
    let Sides { cfg, on_cpu, on_gpu, cuda, .. } = *sides;
    let (cpu, cpu_only) = (Device::Cpu, cuda.is_cpu());
    let mut ok = true;
    let dropout = Dropout::from_config(cfg, DropoutKey { seed: 1234, step: 0, micro_batch: 0 });
    let (norm_cpu, new_cpu) = train_step(on_cpu, cfg, ids_cpu, targets_cpu, &dropout)?;
    let (norm_gpu, new_gpu) = second(cpu_only, || train_step(on_gpu, cfg, ids_gpu, targets_gpu, &dropout))?;
    let (mut diff2, mut update2) = (0f64, 0f64);
    for (((_, old), (_, c)), (_, g)) in on_cpu.iter().zip(new_cpu.iter()).zip(new_gpu.iter()) {
        let old = old.as_tensor();
        let u_cpu = (c.as_tensor() - old)?;
        let u_gpu = (g.as_tensor().to_device(&cpu)? - old)?;
        diff2 += f64::from((&u_gpu - &u_cpu)?.sqr()?.sum_all()?.to_scalar::<f32>()?);
        update2 += f64::from(u_cpu.sqr()?.sum_all()?.to_scalar::<f32>()?);
    }
    let rel = (diff2 / update2.max(f64::MIN_POSITIVE)).sqrt();
    let norm_rel = (norm_cpu - norm_gpu).abs() / norm_cpu.max(f64::MIN_POSITIVE);
    ok &= report(
        "train-step",
        norm_rel <= 1e-4 && rel <= 1e-3,
        format!(
            "dropout (embd {}, attn {}, resid {}); gradient norm cpu {norm_cpu:.6} second side {norm_gpu:.6}; \
             |update diff| / |update| {rel:.3e}",
            cfg.embd_pdrop, cfg.attn_pdrop, cfg.resid_pdrop
        ),
    );

    Ok(ok)
}

/// Dropout at p = 0.1 of a (3, 1000, 257) tensor in each dtype: the second side's `ops::dropout`
/// (the CUDA kernel on a GPU) equals the host-drawn reference on the CPU, element for element.
fn dropout_check(device: &Device, cpu_only: bool) -> Result<bool> {
    let key = DropoutKey { seed: 1234, step: 7, micro_batch: 1 };
    let x = Tensor::randn(0f32, 1f32, (3, 1000, 257), &Device::Cpu)?;
    let mut ok = true;
    for (label, dtype) in [("dropout-f32", DType::F32), ("dropout-bf16", DType::BF16), ("dropout-fp16", DType::F16)] {
        let x = x.to_dtype(dtype)?;
        let want = dropout_reference(&x, key.mask(0.1, 3, 2))?;
        let got = second(cpu_only, || Ok(dropout(&x.to_device(device)?, 0.1, &key, 3, 2)?))?;
        let (d, _) = max_diff(&got, &want)?;
        let kept = want.to_dtype(DType::F32)?.ne(0f32)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        ok &=
            report(label, d == 0.0 && (kept - 0.9).abs() < 0.01, format!("max |diff| {d:e}; kept {kept:.4} (p = 0.1)"));
    }
    Ok(ok)
}

/// One training step on a copy of `params` (on their device): forward with `dropout`, backward,
/// clip to norm 1.0, AdamW at lr 1e-3. Returns the gradient norm before clipping and the weights.
fn train_step(
    params: &ParamStore,
    cfg: &Gpt2Config,
    ids: &Tensor,
    targets: &Tensor,
    dropout: &Dropout,
) -> Result<(f64, ParamStore)> {
    let params = params.copy()?;
    let model = params.model(cfg)?;
    let mut acc = GradAccumulator::new(&params);
    let how = Backward { checkpoint_activations: false, loss_scale: 1.0 };
    lm_forward_backward(&model, ids, targets, Some(dropout), how, &mut acc)?;
    let grads = acc.finish_in_compute_dtype()?;
    // On a GPU the fused optimizer step (one launch), on the CPU one parameter at a time.
    let mut opt = AdamW::new(AdamWConfig::default(), &params)?;
    let norm = clip_and_step(&mut opt, &params, &params, grads, 1e-3, 1.0)?;
    Ok((norm, params))
}

#[cfg(feature = "nccl")]
fn nccl_check(device: &Device) -> Result<bool> {
    use hybrid_engine::comm::nccl::NcclComm;
    if !device.is_cuda() {
        return Ok(report("nccl", true, "skipped: not a CUDA device".into()));
    }
    use hybrid_engine::comm::tcp::{ReduceOp, TcpRing};
    let comm = NcclComm::new(&TcpRing::single(), device)?;
    let mut pass = true;
    let mut detail = vec![];
    // Every collective in every dtype NCCL carries here: the identity on one rank, in the
    // input's dtype (integers to 256 are exact in f16 and bf16).
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = Tensor::arange(0f32, 256.0, device)?.to_dtype(dtype)?;
        let outs = [
            ("all-reduce", comm.all_reduce(&x, ReduceOp::Sum)?),
            ("all-reduce max", comm.all_reduce(&x, ReduceOp::Max)?),
            ("reduce-scatter", comm.reduce_scatter(&x)?),
            ("all-gather", comm.all_gather(&x)?),
            ("broadcast", comm.broadcast(&x, 0)?),
        ];
        for (name, out) in &outs {
            let (d, _) = max_diff(&out.to_dtype(DType::F32)?, &x.to_dtype(DType::F32)?)?;
            pass &= d == 0.0 && out.dims() == x.dims() && out.dtype() == dtype;
            detail.push(format!("{name} {dtype:?} {:?} max |diff| {d}", out.dims()));
        }
    }
    Ok(report("nccl", pass, format!("one rank: {}", detail.join(", "))))
}

#[cfg(not(feature = "nccl"))]
fn nccl_check(_: &Device) -> Result<bool> {
    Ok(report("nccl", true, "skipped: built without the nccl feature".into()))
}
