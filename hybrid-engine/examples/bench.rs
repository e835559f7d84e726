//! Throughput benchmark of the engine (CPU, or a GPU with `--device cuda` in a CUDA build), the Rust half of `scripts/bench/run.sh` (its
//! PyTorch twin is `scripts/bench/hf_bench.py`, which prints the same JSON fields).
//!
//! Modes (one configuration per process, so the peak RSS belongs to that configuration):
//!
//! * `train --model M --batch B --seq T --steps N --warmup W [--checkpoint-activations]
//!   [--dropout P]`: full training steps on random token ids (forward with dropout on, as in
//!   torch train mode, at the model's probabilities or P for all;
//!   backward; clip to global norm 1.0; AdamW update, by `optim::clip_and_step` as the trainers:
//!   on a GPU the fused step). Reports the median over N steps after W warmup steps:
//!   `tokens_per_s` = B*T / step time; `ms_forward_backward` and `ms_optimizer` (the norm, the
//!   clipping, AdamW and the compute copy's refresh) are the medians of the step's two phases.
//!   `flops_per_token` is the model FLOPs per trained token (6N + 12LHQT, see
//!   `train_flops_per_token`), for MFU; `cpu_ms_per_step` the process's CPU time per step (on a
//!   GPU it counts the host spinning in synchronisations too); `timeline` the medians of the
//!   host's and the GPU's times at marks in the step (forward queued, backward queued, gradients
//!   finished, optimizer queued; see `Timeline`): where the GPU's time is near the host's, the
//!   host sets the pace;
//!   `cublaslt_fused_unfused` the matmuls so far with and without cuBLASLt's epilogues.
//! * `generate --model M --batch B --prompt-len P --new-tokens N --warmup W --reps R`: greedy
//!   generation with the KV cache (prefill included), or sampled with `--temperature T [--top-k K]
//!   [--top-p P]`, EOS disabled so every row makes exactly N tokens. Reports the median over R calls: `tokens_per_s` = B*N / call time, and
//!   `cpu_ms_per_token_step` the process's CPU time per token step (near `ms_per_token_step`:
//!   the host's work, not the GPU's, sets the pace).
//! * `ops --model M --batch B --seq T --reps R`: where a training step's time goes: each kind of
//!   op of the model (embeddings, LayerNorm, the four linears, the attention core, GELU, the
//!   residual dropout, the LM head with the cross-entropy) alone at the step's shapes, forward
//!   and forward+backward (median of R after one warmup, the device synchronised around each),
//!   with how many times a step runs it and the sum over the step (`step_ms_from_ops`); the
//!   attention core also without its dropout (a probe of the dropout's cost, 0 times a step).
//! * `peak --size N --reps R`: the f32 matmul rate of candle (gemm) on (N, N) x (N, N), the
//!   machine's measured peak for MFU.
//!
//! The model is randomly initialised with the vocabulary padded to 50304 (a multiple of 128),
//! as training from scratch does (Megatron `--make-vocab-size-divisible-by 128`); generation
//! never picks a padding id. Output: one JSON line per measurement on stdout, e.g.
//! `{"impl":"rust-candle","mode":"train","model":"gpt2","batch":4,"seq":128,...}`.
//!
//! Every mode takes `--device cpu|cuda|cuda:N|auto` (default cpu); on a GPU each timed region
//! ends with a device synchronisation, and the JSON carries `"device"` and `gpu_used_mib`: the
//! most device memory in use (the driver's total - free, sampled after each phase; the CUDA
//! context included), comparable with `hf_bench.py`'s same field; `train` adds
//! `gpu_pool_peak_mib`, the device memory pool's high-water mark over the measured steps (every
//! tensor at the step's peak, without the context), beside `plan_mib`, what the trainers' memory
//! plan predicts for the same step (`training::memory`). `train` and `generate` take
//! `--dtype fp32|bf16` (default fp32): bf16 trains as `--dtype bf16` does (bf16 compute copy of
//! fp32 masters, fp32 gradients and AdamW, the copy refreshed after each update, inside the
//! timed AdamW phase) and generates with bf16 weights.
//!
//! Run: `cargo run --release -p hybrid-engine --example bench -- train --model tiny --batch 8
//! --seq 128 --steps 5 --warmup 2`.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::{Dropout, GPT2_EOS, GPT2_VOCAB};
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::metrics::peak_rss_mib;
use hybrid_engine::training::optim::{clip_and_step, AdamW, AdamWConfig, GradAccumulator};
use hybrid_engine::{Gpt2Config, ParamStore};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

const USAGE: &str = "usage:
  bench train --model tiny|gpt2|gpt2-medium --batch B --seq T --steps N --warmup W [--checkpoint-activations] [--dtype fp32|bf16] [--dropout P]
  bench generate --model tiny|gpt2|gpt2-medium --batch B --prompt-len P --new-tokens N --warmup W --reps R [--dtype fp32|bf16]
                 [--temperature T [--top-k K] [--top-p P]]
  bench ops --model tiny|gpt2|gpt2-medium --batch B --seq T --reps R [--dtype fp32|bf16]
  bench peak --size N --reps R [--dtype fp32|bf16]
every mode also takes --device cpu|cuda|cuda:N|auto (default cpu)";

/// Megatron's `--make-vocab-size-divisible-by` default: 50257 -> 50304.
const VOCAB_DIVISOR: usize = 128;
const SEED: u64 = 1234;
const LR: f64 = 1e-4;

struct TrainArgs {
    model: String,
    batch: usize,
    seq: usize,
    steps: usize,
    warmup: usize,
    checkpoint_activations: bool,
    dtype: DType,
    /// Every dropout probability (embeddings, attention, residual) instead of the model's.
    dropout: Option<f64>,
}

struct GenerateArgs {
    model: String,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    warmup: usize,
    reps: usize,
    dtype: DType,
    /// Sampling instead of greedy decoding: (temperature, top-k, top-p).
    sampling: Option<(f64, Option<usize>, Option<f64>)>,
}

struct PeakArgs {
    size: usize,
    reps: usize,
    dtype: DType,
}

struct OpsArgs {
    model: String,
    batch: usize,
    seq: usize,
    reps: usize,
    dtype: DType,
}

enum Mode {
    Ops(OpsArgs),
    Train(TrainArgs),
    Generate(GenerateArgs),
    Peak(PeakArgs),
}

fn main() {
    hybrid_engine::runtime::init(); // as the training binaries do
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = parse_args(&args).and_then(|(mode, device)| run(mode, &device)) {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}

fn run(mode: Mode, device: &str) -> Result<()> {
    let device = hybrid_engine::device::parse_device(device)?;
    let mut line = match mode {
        Mode::Train(a) => bench_train(&a, &device)?,
        Mode::Generate(a) => bench_generate(&a, &device)?,
        Mode::Peak(a) => bench_peak(&a, &device)?,
        Mode::Ops(a) => bench_ops(&a, &device)?,
    };
    line["device"] = hybrid_engine::device::describe(&device).into();
    println!("{line}");
    Ok(())
}

/// `--flag value` pairs and `--checkpoint-activations`, std only (clap is not a dependency).
/// Returns the mode and the `--device` spec.
fn parse_args(args: &[String]) -> Result<(Mode, String)> {
    let Some((mode, rest)) = args.split_first() else {
        bail!("missing mode\n{USAGE}");
    };
    let mut values = Flags::new();
    let mut checkpoint_activations = false;
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--checkpoint-activations" => checkpoint_activations = true,
            "-h" | "--help" => bail!("{USAGE}"),
            f if f.starts_with("--") => {
                let v = it.next().with_context(|| format!("flag {f} needs a value"))?;
                values.insert(f.trim_start_matches("--").to_string(), v.clone());
            }
            f => bail!("unexpected argument {f:?}\n{USAGE}"),
        }
    }
    let device = values.remove("device").unwrap_or_else(|| "cpu".into());
    let dtype = match values.remove("dtype").as_deref() {
        None | Some("fp32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some(d) => bail!("--dtype {d:?}: use fp32 or bf16"),
    };
    let parsed = match mode.as_str() {
        "train" => Mode::Train(TrainArgs {
            model: take(&mut values, "model")?,
            batch: num(&mut values, "batch")?,
            seq: num(&mut values, "seq")?,
            steps: num(&mut values, "steps")?,
            warmup: num(&mut values, "warmup")?,
            checkpoint_activations,
            dtype,
            dropout: values.remove("dropout").map(|p| p.parse()).transpose().context("--dropout: a probability")?,
        }),
        "generate" => Mode::Generate(GenerateArgs {
            model: take(&mut values, "model")?,
            batch: num(&mut values, "batch")?,
            prompt_len: num(&mut values, "prompt-len")?,
            new_tokens: num(&mut values, "new-tokens")?,
            warmup: num(&mut values, "warmup")?,
            reps: num(&mut values, "reps")?,
            dtype,
            sampling: match values.remove("temperature") {
                None => None,
                Some(t) => Some((
                    t.parse().with_context(|| format!("--temperature {t:?}: a number"))?,
                    values.remove("top-k").map(|k| k.parse()).transpose().context("--top-k: a whole number")?,
                    values.remove("top-p").map(|p| p.parse()).transpose().context("--top-p: a number")?,
                )),
            },
        }),
        "peak" => Mode::Peak(PeakArgs { size: num(&mut values, "size")?, reps: num(&mut values, "reps")?, dtype }),
        "ops" => Mode::Ops(OpsArgs {
            model: take(&mut values, "model")?,
            batch: num(&mut values, "batch")?,
            seq: num(&mut values, "seq")?,
            reps: num(&mut values, "reps")?,
            dtype,
        }),
        m => bail!("unknown mode {m:?}: use train, generate, ops or peak\n{USAGE}"),
    };
    if let Some(flag) = values.keys().next() {
        bail!("unknown flag --{flag} for mode {mode}\n{USAGE}");
    }
    Ok((parsed, device))
}

type Flags = std::collections::HashMap<String, String>;

fn take(values: &mut Flags, name: &str) -> Result<String> {
    values.remove(name).with_context(|| format!("missing --{name}\n{USAGE}"))
}

fn num(values: &mut Flags, name: &str) -> Result<usize> {
    let v = take(values, name)?;
    v.parse().with_context(|| format!("--{name} {v:?} is not a non-negative integer"))
}

fn model_config(name: &str) -> Result<Gpt2Config> {
    let mut cfg = Gpt2Config::from_preset(name)
        .with_context(|| format!("unknown --model {name:?}: use one of {}", Gpt2Config::PRESETS))?;
    cfg.pad_vocab(VOCAB_DIVISOR);
    Ok(cfg)
}

/// Uniform ids from GPT-2's real vocabulary (never a padding row). (rows, cols)
fn random_ids(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<Vec<u32>> {
    (0..rows).map(|_| (0..cols).map(|_| rng.random_range(0..GPT2_VOCAB as u32)).collect()).collect()
}

/// CPU seconds this process has used, all threads together (NaN where unsupported): beside wall
/// time it shows threads spinning or waiting, and it is steadier on a busy machine.
fn cpu_seconds() -> f64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec it is given.
        if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
        }
    }
    f64::NAN
}

/// Model FLOPs per trained token (forward and backward), as PaLM's appendix B and nanoGPT's
/// `estimate_mfu`: 6 N + 12 L H Q T, with N the parameters that multiply each token (all but the
/// position embedding; the token embedding counts as the tied LM head's weight), L layers, H
/// heads of Q dimensions and T the sequence length (full, not causal-halved, attention).
fn train_flops_per_token(cfg: &Gpt2Config, seq: usize) -> f64 {
    let n = hybrid_engine::model::params::parameter_count(cfg) - cfg.n_positions * cfg.n_embd;
    6.0 * n as f64 + 12.0 * (cfg.n_layer * cfg.n_head * cfg.head_dim() * seq) as f64
}

fn dtype_name(dtype: DType) -> &'static str {
    if dtype == DType::BF16 {
        "bf16"
    } else {
        "fp32"
    }
}

/// The most device memory seen in use, in MiB (the driver's total - free); 0 on the CPU.
#[derive(Default)]
struct GpuMemory {
    max_mib: f64,
}

impl GpuMemory {
    fn sample(&mut self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            let (free, total) = candle_core::cuda_backend::cudarc::driver::result::mem_get_info()?;
            self.max_mib = self.max_mib.max((total - free) as f64 / 1048576.0);
        }
        let _ = device;
        Ok(())
    }
}

/// The device's default memory pool's high-water mark of bytes in use, in MiB, reset to what is in
/// use now when `reset`: every tensor at its peak, without the CUDA context or cuBLAS's workspace
/// (cudarc allocates with cuMemAllocAsync from that pool where the device has memory pools). None
/// on the CPU or where nothing came from the pool.
fn pool_peak_mib(device: &Device, reset: bool) -> Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        let (mut dev, mut pool, mut bytes) = (0, std::ptr::null_mut(), 0u64);
        // SAFETY: candle made this thread's context current; each call writes its out-parameter,
        // and the attribute is a u64 (the driver API's documentation).
        unsafe {
            sys::cuCtxGetDevice(&mut dev).result()?;
            sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result()?;
            if reset {
                sys::cuMemPoolSetAttribute(pool, attribute, (&mut bytes as *mut u64).cast()).result()?;
            }
            sys::cuMemPoolGetAttribute(pool, attribute, (&mut bytes as *mut u64).cast()).result()?;
        }
        return Ok((bytes > 0).then_some(bytes as f64 / 1048576.0));
    }
    let _ = (device, reset);
    Ok(None)
}

/// Where a step's time goes between the host and the GPU: at each mark, the host's time since the
/// step began and the GPU's time to finish everything queued before the mark (a CUDA event
/// recorded there, against one recorded at the start, when the GPU was idle). Where the two are
/// close, the GPU had caught up and waited for the host; where the GPU's is later, the host ran
/// ahead. On the CPU only the host's times.
struct Timeline {
    start: Instant,
    #[cfg(feature = "cuda")]
    events: Option<(
        std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
        Vec<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
    )>,
    marks: Vec<(&'static str, f64)>,
}

impl Timeline {
    fn start(device: &Device, start: Instant) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let events = match device {
            Device::Cuda(dev) => {
                let stream = dev.cuda_stream();
                let first = stream.record_event(Some(
                    candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
                ))?;
                Some((stream, vec![first]))
            }
            _ => None,
        };
        let _ = device;
        Ok(Self {
            start,
            #[cfg(feature = "cuda")]
            events,
            marks: Vec::new(),
        })
    }

    fn mark(&mut self, name: &'static str) -> Result<()> {
        self.marks.push((name, self.start.elapsed().as_secs_f64() * 1e3));
        #[cfg(feature = "cuda")]
        if let Some((stream, events)) = &mut self.events {
            events.push(
                stream.record_event(Some(
                    candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
                ))?,
            );
        }
        Ok(())
    }

    /// (mark, host ms, GPU ms or NaN) for each mark.
    fn finish(self) -> Result<Vec<(&'static str, f64, f64)>> {
        #[allow(unused_mut)]
        let mut gpu = vec![f64::NAN; self.marks.len()];
        #[cfg(feature = "cuda")]
        if let Some((_, events)) = &self.events {
            for (g, event) in gpu.iter_mut().zip(&events[1..]) {
                *g = f64::from(events[0].elapsed_ms(event)?);
            }
        }
        Ok(self.marks.iter().zip(gpu).map(|(&(name, host), gpu)| (name, host, gpu)).collect())
    }

    /// Each mark's median host and GPU times over the steps, as JSON.
    fn medians(steps: &[Vec<(&'static str, f64, f64)>]) -> serde_json::Value {
        let Some(first) = steps.first() else { return serde_json::Value::Null };
        let column = |i: usize, f: fn(&(&'static str, f64, f64)) -> f64| {
            median(&steps.iter().map(|s| f(&s[i])).collect::<Vec<_>>())
        };
        first
            .iter()
            .enumerate()
            .map(|(i, (name, _, _))| {
                let gpu = column(i, |m| m.2);
                serde_json::json!({"mark": name, "host_ms": column(i, |m| m.1), "gpu_ms": (!gpu.is_nan()).then_some(gpu)})
            })
            .collect()
    }
}

/// The matmuls that took cuBLASLt's fused epilogues and those that could not, so far.
fn cublaslt_counts() -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    return Some(hybrid_engine::kernels::cublaslt::counts());
    #[cfg(not(feature = "cuda"))]
    None
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn bench_train(a: &TrainArgs, device: &Device) -> Result<serde_json::Value> {
    if a.steps == 0 || a.batch == 0 || a.seq == 0 {
        bail!("--steps, --batch and --seq must be positive");
    }
    let mut cfg = model_config(&a.model)?;
    if a.seq > cfg.n_positions {
        bail!("--seq {} exceeds {}'s context of {} tokens", a.seq, a.model, cfg.n_positions);
    }
    if let Some(p) = a.dropout {
        if !(0.0..1.0).contains(&p) {
            bail!("--dropout {p}: a probability in [0, 1)");
        }
        (cfg.embd_pdrop, cfg.attn_pdrop, cfg.resid_pdrop) = (p, p, p);
    }
    // fp32 masters; in bf16 the model runs on a bf16 copy, as the trainer's --dtype bf16.
    let params = ParamStore::init(&cfg, SEED, device)?;
    let compute = params.compute_copy(a.dtype)?;
    let model = compute.model(&cfg)?;
    let mut opt = AdamW::new(AdamWConfig::default(), &params)?;
    let mut memory = GpuMemory::default();
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);

    // Per measured step: total, forward+backward and optimizer seconds, and CPU seconds.
    let mut times = Vec::with_capacity(a.steps);
    let mut cpu_times = Vec::with_capacity(a.steps);
    let mut phases: [Vec<f64>; 2] = Default::default();
    let mut timelines = Vec::with_capacity(a.steps);
    let mut loss = f32::NAN;
    for step in 0..a.warmup + a.steps {
        if step == a.warmup {
            device.synchronize()?;
            pool_peak_mib(device, true)?;
        }
        // Fresh ids each step, made outside the timed region. (B, T+1) -> inputs and targets.
        let rows = random_ids(&mut rng, a.batch, a.seq + 1);
        let all = Tensor::new(rows, device)?; // (B, T+1)
        let ids = all.narrow(1, 0, a.seq)?; // (B, T)
        let targets = all.narrow(1, 1, a.seq)?; // (B, T)
        let dropout = Dropout::from_config(&cfg, DropoutKey { seed: SEED, step: step as u64, micro_batch: 0 });

        device.synchronize()?;
        let (start, cpu_start) = (Instant::now(), cpu_seconds());
        let mut timeline = Timeline::start(device, start)?;
        let mut acc = GradAccumulator::new(&compute);
        if a.checkpoint_activations {
            loss = hybrid_engine::training::train_step::lm_forward_backward(
                &model,
                &ids,
                &targets,
                Some(&dropout),
                hybrid_engine::training::train_step::Backward { checkpoint_activations: true, loss_scale: 1.0 },
                &mut acc,
            )?;
        } else {
            // lm_forward_backward's whole-model path, marked where the host has queued the
            // forward and the backward, before the loss comes back (which waits for the GPU).
            let loss_t = model.lm_loss(&ids, &targets, Some(&dropout))?;
            timeline.mark("forward queued")?;
            acc.add(&(&loss_t * 1.0)?.backward()?)?; // the trainers' loss scale, as they run it
            timeline.mark("backward queued")?;
            loss = loss_t.to_scalar::<f32>()?;
        }
        let grads = acc.finish_in_compute_dtype()?;
        device.synchronize()?;
        let backward_done = Instant::now();
        timeline.mark("gradients finished")?;
        memory.sample(device)?;
        clip_and_step(&mut opt, &params, &compute, grads, LR, 1.0)?;
        timeline.mark("optimizer queued")?;
        device.synchronize()?;
        let end = Instant::now();
        memory.sample(device)?;
        if step >= a.warmup {
            cpu_times.push(cpu_seconds() - cpu_start);
            times.push((end - start).as_secs_f64());
            phases[0].push((backward_done - start).as_secs_f64());
            phases[1].push((end - backward_done).as_secs_f64());
            timelines.push(timeline.finish()?);
        }
    }
    let step_s = median(&times);
    // What the trainers' memory plan predicts for this step (parameters, gradients, AdamW, the
    // compute copy, one micro-batch's activations), beside the pool's measured peak.
    let plan =
        MemoryPlan::new(&cfg, a.batch, a.seq, a.checkpoint_activations).with_compute_dtype(a.dtype).on_device(device);
    Ok(serde_json::json!({
        "impl": "rust-candle",
        "mode": "train",
        "model": a.model,
        "batch": a.batch,
        "seq": a.seq,
        "checkpoint_activations": a.checkpoint_activations,
        "dropout": [cfg.embd_pdrop, cfg.attn_pdrop, cfg.resid_pdrop],
        "dtype": dtype_name(a.dtype),
        "vocab_size": cfg.vocab_size,
        "params": hybrid_engine::model::params::parameter_count(&cfg),
        "flops_per_token": train_flops_per_token(&cfg, a.seq),
        "threads": candle_core::utils::get_num_threads(),
        "warmup": a.warmup,
        "steps": a.steps,
        "tokens_per_s": (a.batch * a.seq) as f64 / step_s,
        "ms_per_step": step_s * 1e3,
        "ms_per_step_min": times.iter().copied().fold(f64::INFINITY, f64::min) * 1e3,
        "ms_per_step_max": times.iter().copied().fold(0.0, f64::max) * 1e3,
        "ms_forward_backward": median(&phases[0]) * 1e3,
        "timeline": Timeline::medians(&timelines),
        "cublaslt_fused_unfused": cublaslt_counts(),
        "ms_optimizer": median(&phases[1]) * 1e3,
        "cpu_ms_per_step": median(&cpu_times) * 1e3,
        "last_loss": loss,
        "peak_rss_mib": peak_rss_mib(),
        "gpu_used_mib": memory.max_mib,
        "gpu_pool_peak_mib": pool_peak_mib(device, false)?,
        "plan_mib": plan.total() as f64 / 1048576.0,
        "plan_activations_mib": plan.activation_bytes() as f64 / 1048576.0,
    }))
}

fn bench_generate(a: &GenerateArgs, device: &Device) -> Result<serde_json::Value> {
    if a.reps == 0 || a.batch == 0 || a.prompt_len == 0 || a.new_tokens == 0 {
        bail!("--reps, --batch, --prompt-len and --new-tokens must be positive");
    }
    let cfg = model_config(&a.model)?;
    if a.prompt_len + a.new_tokens > cfg.n_positions {
        bail!(
            "--prompt-len {} + --new-tokens {} exceeds {}'s context of {} tokens",
            a.prompt_len,
            a.new_tokens,
            a.model,
            cfg.n_positions
        );
    }
    let params = ParamStore::init(&cfg, SEED, device)?.compute_copy(a.dtype)?;
    let model = params.model(&cfg)?;
    let mut memory = GpuMemory::default();
    let prompts = random_ids(&mut ChaCha8Rng::seed_from_u64(SEED), a.batch, a.prompt_len);
    // eos None: no row stops early, so every call makes exactly B * N tokens.
    let greedy = SamplingConfig::greedy(a.new_tokens, None, GPT2_EOS, GPT2_VOCAB);
    let sampling = match a.sampling {
        None => greedy,
        Some((t, top_k, top_p)) => SamplingConfig { temperature: Some(t), top_k, top_p, seed: SEED, ..greedy },
    };

    let (mut times, mut cpu_times) = (Vec::with_capacity(a.reps), Vec::with_capacity(a.reps));
    for rep in 0..a.warmup + a.reps {
        let (start, cpu_start) = (Instant::now(), cpu_seconds());
        let out = generate(&model, &prompts, &sampling, device)?;
        device.synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        let cpu_secs = cpu_seconds() - cpu_start;
        memory.sample(device)?;
        let made: usize = out.iter().map(Vec::len).sum();
        assert_eq!(made, a.batch * a.new_tokens, "generation stopped early");
        if rep >= a.warmup {
            times.push(secs);
            cpu_times.push(cpu_secs);
        }
    }
    let call_s = median(&times);
    Ok(serde_json::json!({
        "impl": "rust-candle",
        "mode": "generate",
        "model": a.model,
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "dtype": dtype_name(a.dtype),
        "sampling": a.sampling.map(|(t, k, p)| serde_json::json!({"temperature": t, "top_k": k, "top_p": p})),
        "vocab_size": cfg.vocab_size,
        "threads": candle_core::utils::get_num_threads(),
        "warmup": a.warmup,
        "reps": a.reps,
        "tokens_per_s": (a.batch * a.new_tokens) as f64 / call_s,
        "ms_per_call": call_s * 1e3,
        "ms_per_token_step": call_s * 1e3 / a.new_tokens as f64,
        "cpu_ms_per_token_step": median(&cpu_times) * 1e3 / a.new_tokens as f64,
        "peak_rss_mib": peak_rss_mib(),
        "gpu_used_mib": memory.max_mib,
        "decode_graph_replayed_steps": replayed_decoding_steps(),
    }))
}

/// Decoding steps replayed from a CUDA graph so far (`HYBRID_ENGINE_DECODE_GRAPH=1`).
fn replayed_decoding_steps() -> u64 {
    #[cfg(feature = "cuda")]
    return hybrid_engine::generation::decode_graph::REPLAYED_STEPS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(feature = "cuda"))]
    0
}

/// The median milliseconds of `f` (after one warmup call), the device synchronised around each
/// call; with `backward`, `f`'s output summed and back-propagated inside the timed region.
fn time_ms(device: &Device, reps: usize, backward: bool, f: &dyn Fn() -> Result<Tensor>) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps + 1 {
        device.synchronize()?;
        let start = Instant::now();
        let out = f()?;
        if backward {
            drop(out.sum_all()?.backward()?);
        }
        device.synchronize()?;
        drop(out);
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(median(&times))
}

/// `bench ops`: each kind of op of a training step alone at the step's shapes (see the module
/// documentation), so that the step's time can be attributed.
fn bench_ops(a: &OpsArgs, device: &Device) -> Result<serde_json::Value> {
    use candle_core::Var;
    use hybrid_engine::kernels::ops;
    use hybrid_engine::model::positions::MASKED;
    if a.reps == 0 {
        bail!("--reps must be positive");
    }
    let cfg = model_config(&a.model)?;
    let (b, t, c, l, v) = (a.batch, a.seq, cfg.n_embd, cfg.n_layer, cfg.vocab_size);
    if t > cfg.n_positions {
        bail!("--seq {t} is longer than the model's {} positions", cfg.n_positions);
    }
    let var = |shape: &[usize], std: f32| -> Result<Var> {
        Ok(Var::from_tensor(&Tensor::randn(0f32, std, shape, device)?.to_dtype(a.dtype)?)?)
    };
    let key = DropoutKey { seed: SEED, step: 0, micro_batch: 0 };
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let ids = Tensor::new(random_ids(&mut rng, b, t), device)?;
    let targets = ids.flatten_all()?;
    let causal: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { MASKED } else { 0.0 }).collect();
    let bias = Tensor::from_vec(causal, (1, 1, t, t), device)?;
    let (wte, wpe) = (var(&[v, c], 0.02)?, var(&[cfg.n_positions, c], 0.01)?);
    let x = var(&[b, t, c], 1.0)?;
    let (ln_w, ln_b) = (var(&[c], 1.0)?, var(&[c], 0.1)?);
    let qkv = var(&[b, t, 3 * c], 1.0)?;
    let h = var(&[b, t, 4 * c], 1.0)?;
    let linear = |d_in: usize, d_out: usize| -> Result<(Var, Var, Var)> {
        Ok((var(&[b, t, d_in], 1.0)?, var(&[d_in, d_out], 0.02)?, var(&[d_out], 0.02)?))
    };
    let (attn_in, attn_proj, fc, mlp_proj) = (linear(c, 3 * c)?, linear(c, c)?, linear(c, 4 * c)?, linear(4 * c, c)?);
    let scale = 1.0 / ((c / cfg.n_head) as f64).sqrt();
    let p = 0.1;
    type Op<'a> = (&'static str, usize, Box<dyn Fn() -> Result<Tensor> + 'a>);
    let run_linear = |(x, w, bias): &(Var, Var, Var)| ops::linear(x.as_tensor(), w.as_tensor(), bias.as_tensor());
    let kinds: Vec<Op> = vec![
        (
            "embeddings",
            1,
            Box::new(|| {
                let tok = wte.as_tensor().index_select(&ids.flatten_all()?, 0)?.reshape((b, t, c))?;
                let pos = wpe.as_tensor().index_select(&Tensor::arange(0u32, t as u32, device)?, 0)?;
                Ok(ops::dropout(&tok.broadcast_add(&pos)?, p, &key, u64::MAX, 0)?)
            }),
        ),
        (
            "layer_norm",
            2 * l + 1,
            Box::new(|| Ok(ops::layer_norm(x.as_tensor(), ln_w.as_tensor(), ln_b.as_tensor(), 1e-5)?)),
        ),
        ("linear c_attn", l, Box::new(|| Ok(run_linear(&attn_in)?))),
        (
            "attention core",
            l,
            Box::new(|| Ok(ops::attention(qkv.as_tensor(), &bias, cfg.n_head, scale, Some(key.mask(p, 0, 1)))?)),
        ),
        // Not part of the step (0 a step): beside the row above, what its in-kernel dropout costs.
        (
            "attention core without dropout",
            0,
            Box::new(|| Ok(ops::attention(qkv.as_tensor(), &bias, cfg.n_head, scale, None)?)),
        ),
        ("linear attn c_proj", l, Box::new(|| Ok(run_linear(&attn_proj)?))),
        (
            "residual dropout and add",
            2 * l,
            Box::new(|| Ok((ops::dropout(x.as_tensor(), p, &key, 0, 2)? + x.as_tensor())?)),
        ),
        ("linear c_fc", l, Box::new(|| Ok(run_linear(&fc)?))),
        ("gelu", l, Box::new(|| Ok(ops::gelu(h.as_tensor(), false)?))),
        ("linear mlp c_proj", l, Box::new(|| Ok(run_linear(&mlp_proj)?))),
        (
            "lm head and cross-entropy",
            1,
            Box::new(|| {
                let rows = x.as_tensor().reshape((b * t, c))?;
                Ok(ops::lm_head_cross_entropy_rows(&rows, wte.as_tensor(), &targets)?.mean_all()?)
            }),
        ),
    ];
    let mut report = serde_json::Map::new();
    let (mut step_fwd, mut step_fwd_bwd) = (0.0, 0.0);
    for (name, count, f) in &kinds {
        let fwd = time_ms(device, a.reps, false, f.as_ref())?;
        let fwd_bwd = time_ms(device, a.reps, true, f.as_ref())?;
        step_fwd += fwd * *count as f64;
        step_fwd_bwd += fwd_bwd * *count as f64;
        report.insert(
            name.to_string(),
            serde_json::json!({"ms_forward": fwd, "ms_forward_backward": fwd_bwd, "per_step": count,
                               "step_ms": fwd_bwd * *count as f64}),
        );
    }
    Ok(serde_json::json!({
        "impl": "rust-candle",
        "mode": "ops",
        "model": a.model,
        "batch": b,
        "seq": t,
        "dtype": dtype_name(a.dtype),
        "reps": a.reps,
        "ops": report,
        "step_ms_forward_from_ops": step_fwd,
        "step_ms_from_ops": step_fwd_bwd,
    }))
}

/// The machine's measured matmul peak (f32, or bf16 with `--dtype bf16`): an (N, N) x (N, N)
/// product R times after one warmup,
/// 2 N^3 FLOPs each; reports the best and the median rate.
fn bench_peak(a: &PeakArgs, device: &Device) -> Result<serde_json::Value> {
    if a.reps == 0 || a.size == 0 {
        bail!("--size and --reps must be positive");
    }
    let n = a.size;
    let x = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(a.dtype)?;
    let y = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(a.dtype)?;
    let mut times = Vec::with_capacity(a.reps);
    for rep in 0..a.reps + 1 {
        device.synchronize()?;
        let start = Instant::now();
        let z = x.matmul(&y)?;
        device.synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        drop(z);
        if rep > 0 {
            times.push(secs);
        }
    }
    let flops = 2.0 * (n as f64).powi(3);
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(serde_json::json!({
        "impl": "rust-candle",
        "mode": "peak",
        "size": n,
        "dtype": dtype_name(a.dtype),
        "reps": a.reps,
        "threads": candle_core::utils::get_num_threads(),
        "gflops_best": flops / best / 1e9,
        "gflops_median": flops / median(&times) / 1e9,
    }))
}
