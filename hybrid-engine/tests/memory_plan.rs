//! The memory plan's activation estimate against memory actually allocated: this test binary
//! counts every allocation (a global allocator wrapper) and measures, for one micro-batch's
//! forward and backward on the fused CPU kernels, the peak of live bytes above what was live
//! before and what stays after (the gradients the step leaves), for the first micro-batch and
//! for one that adds to gradients already accumulated. That peak is what
//! `memory::activation_bytes` estimates; the plan is printed at the start of every step so that
//! a run that will not fit is known before it starts.

use candle_core::{Device, Tensor};
use hybrid_engine::kernels::ops::DropoutKey;
use hybrid_engine::model::gpt2::Dropout;
use hybrid_engine::model::reward_model::{add_score_head, RewardModel};
use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::training::optim::GradAccumulator;
use hybrid_engine::training::train_step::{forward_backward, lm_forward_backward, Backward};
use hybrid_engine::{Gpt2Config, ParamStore};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        if size > l.size() {
            grew(size - l.size());
        } else {
            LIVE.fetch_sub(l.size() - size, Relaxed);
        }
        System.realloc(p, l, size)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// A micro-batch's forward and backward, adding its gradients to the accumulator.
type MicroBatch<'a> = Box<dyn Fn(&mut GradAccumulator) -> anyhow::Result<()> + 'a>;

/// Peak live bytes of one micro-batch above what was live before it and what it leaves live:
/// `first` into an empty accumulator, else into one that already holds a micro-batch's
/// gradients (gradient accumulation's steady state).
fn transient_peak(step: &MicroBatch, empty: &GradAccumulator, first: bool) -> anyhow::Result<u64> {
    let mut acc = empty.emptied();
    if !first {
        step(&mut acc)?;
    }
    let before = LIVE.load(Relaxed);
    PEAK.store(before, Relaxed);
    step(&mut acc)?;
    let (peak, after) = (PEAK.load(Relaxed), LIVE.load(Relaxed));
    drop(acc);
    Ok((peak - after.max(before)) as u64)
}

/// A configuration the estimate is checked on, chosen so that each phase of
/// `memory::activation_bytes` is the peak somewhere.
struct Case {
    name: &'static str,
    cfg: Gpt2Config,
    b: usize,
    t: usize,
    score_head: bool,
    lora_only: bool,
}

fn case(name: &'static str, cfg: Gpt2Config, b: usize, t: usize) -> Case {
    Case { name, cfg, b, t, score_head: false, lora_only: false }
}

/// One test, so that no other test allocates while a peak is measured.
#[test]
fn the_activation_estimate_matches_measured_allocations() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let padded = |mut cfg: Gpt2Config| {
        cfg.pad_vocab(128);
        cfg
    };
    let tiny = padded(Gpt2Config::tiny());
    let gpt2 = padded(Gpt2Config::gpt2());
    // The embedding's gradient larger than all other parameters together, and a small vocabulary.
    let wide = Gpt2Config { n_layer: 2, n_embd: 256, ..tiny.clone() };
    let small_vocab = Gpt2Config { n_layer: 2, vocab_size: 12800, ..tiny.clone() };
    let cases = [
        case("tiny", tiny.clone(), 8, 64),
        case("tiny", tiny.clone(), 2, 256),
        case("wide", wide.clone(), 1, 128),
        case("small-vocab", small_vocab.clone(), 4, 128),
        case("gpt2", gpt2.clone(), 1, 128),
        case("gpt2", gpt2.clone(), 2, 128),
        Case { lora_only: true, ..case("tiny LoRA-only", tiny.clone(), 8, 64) },
        Case { score_head: true, ..case("tiny score head", tiny.clone(), 8, 64) },
        Case { score_head: true, ..case("wide score head", wide.clone(), 1, 128) },
    ];
    let mut report = Vec::new();
    for c in &cases {
        let mut params = ParamStore::init(&c.cfg, 0, &dev)?;
        if c.score_head {
            add_score_head(&mut params, &c.cfg, 0, &dev)?;
        }
        if c.lora_only {
            params.add_lora(&c.cfg, &lora::LoraConfig { dim: 8, ..Default::default() }, 0)?;
            params.freeze_trunk();
        }
        let trainable = params.trainable();
        let empty = GradAccumulator::new(&trainable);
        let model = params.model(&c.cfg)?;
        let rm = if c.score_head { Some(RewardModel::new(&params, &c.cfg)?) } else { None };
        let ids = Tensor::zeros((c.b, c.t), candle_core::DType::U32, &dev)?;
        let dropout = Dropout::from_config(&c.cfg, DropoutKey { seed: 0, step: 0, micro_batch: 0 });
        for checkpoint in [false, true] {
            let how = Backward { checkpoint_activations: checkpoint, loss_scale: 1.0 };
            let step: MicroBatch = match &rm {
                None => Box::new(|acc| lm_forward_backward(&model, &ids, &ids, Some(&dropout), how, acc).map(drop)),
                Some(rm) => Box::new(|acc| {
                    let score = |h: &Tensor| rm.token_scores(h)?.mean_all();
                    forward_backward(&rm.trunk, &ids, &Default::default(), Some(&dropout), how, acc, score).map(drop)
                }),
            };
            transient_peak(&step, &empty, true)?; // warm-up: thread pools and caches allocate once
            for accumulating in [false, true] {
                let measured = transient_peak(&step, &empty, !accumulating)?;
                let mut plan = MemoryPlan::new(&c.cfg, c.b, c.t, checkpoint)
                    .with_parameters(params.numel(), trainable.numel())
                    .with_gradient_accumulation(if accumulating { 2 } else { 1 })
                    .with_lora(c.lora_only)
                    .on_device(&dev);
                if c.score_head {
                    plan = plan.with_score_head();
                }
                let label = format!(
                    "{} B{} T{} ckpt={checkpoint} {}",
                    c.name,
                    c.b,
                    c.t,
                    if accumulating { "accumulating" } else { "first micro-batch" }
                );
                report.push((label, measured, plan.activation_bytes()));
            }
        }
    }

    let mib = |x: u64| x as f64 / 1048576.0;
    let lines: Vec<String> = report
        .iter()
        .map(|(n, m, e)| {
            format!(
                "{n}: measured {:.1} MiB, estimated {:.1} MiB ({:+.1}%)",
                mib(*m),
                mib(*e),
                100.0 * (*e as f64 / *m as f64 - 1.0)
            )
        })
        .collect();
    println!("{}", lines.join("\n"));
    for ((_, measured, estimate), line) in report.iter().zip(&lines) {
        let ratio = *estimate as f64 / *measured as f64;
        // Never under the measured peak by more than rounding (a run that does not fit must not
        // look as if it did), and at most 5% over (a run that fits must not look as if not).
        assert!((0.99..1.05).contains(&ratio), "{line}: outside 0.99-1.05x of the measured peak");
    }
    Ok(())
}
