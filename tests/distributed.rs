//! Data parallelism end to end: N real rank processes talking over loopback, against one process
//! trained on the same global batch. The N-rank run must end with the one-rank run's weights
//! (fp32, 1e-5 relative per tensor) at every ZeRO stage, with 2 and 3 ranks (3 makes the shards
//! uneven), for pretraining, SFT, the reward model and PPO; a rank that dies, a missing rank and
//! mismatched flags must fail every rank with one line naming the culprit, within the timeout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A step (`sft`, `reward`, `ppo`): the multi-call `train` binary under that name.
fn step_binary(dir: &Path, step: &str) -> PathBuf {
    let link = dir.join(step);
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_train"), &link).unwrap();
    }
    link
}

fn free_port() -> u16 {
    rlhf::ranks::free_port().unwrap()
}

fn start_rank(dir: &Path, step: &str, rank: usize, world: usize, port: u16, args: &[String]) -> Child {
    start_rank_with(dir, step, (rank, world, port), args, &[])
}

/// [`start_rank`] with `env` set over the launcher's variables.
fn start_rank_with(
    dir: &Path,
    step: &str,
    (rank, world, port): (usize, usize, u16),
    args: &[String],
    env: &[(&str, &str)],
) -> Child {
    let mut cmd = Command::new(step_binary(dir, step));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).env("HF_HUB_OFFLINE", "1");
    if world > 1 {
        cmd.envs(rlhf::ranks::rank_env(rank, world, port));
    }
    cmd.envs(env.iter().copied());
    cmd.spawn().expect("start a rank")
}

/// Waits for a child, killing it after `limit`: no test leaves a process behind.
fn wait(child: Child, limit: Duration) -> Output {
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let watchdog = std::thread::spawn(move || {
        let t0 = Instant::now();
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            if t0.elapsed() > limit {
                // SAFETY: kill sends a signal to our own child.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let out = child.wait_with_output().expect("wait for a rank");
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watchdog.join().unwrap();
    out
}

/// Runs `world` ranks of `step` with `args`, all of which must succeed.
fn run_ranks(dir: &Path, step: &str, world: usize, args: &[String]) -> Vec<Output> {
    let port = free_port();
    let children: Vec<Child> = (0..world).map(|r| start_rank(dir, step, r, world, port, args)).collect();
    let outs: Vec<Output> = children.into_iter().map(|c| wait(c, Duration::from_secs(300))).collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r} of {world} failed: {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(&o.stdout)
        );
    }
    outs
}

fn weights(model_dir: &Path) -> HashMap<String, Vec<f32>> {
    weights_file(&model_dir.join("model.safetensors"))
}

/// The f32 tensors of a safetensors file.
fn weights_file(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let v = view.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            (name, v)
        })
        .collect()
}

/// Per tensor, the relative L2 distance of `a`'s weights from `b`'s.
///
/// Without the key third of each `c_attn.bias`: softmax is invariant to adding the same value to
/// every score, so the key bias's exact gradient is zero and what backward computes is rounding
/// noise, which Adam scales up to full-size steps of either sign. Any change in summation order
/// moves those weights by about the learning rate; they have no effect on any output.
fn distances(a: &Path, b: &Path) -> HashMap<String, f64> {
    tensor_distances(&weights(a), &weights(b))
}

/// [`distances`] between two sets of tensors with the same names.
fn tensor_distances(wa: &HashMap<String, Vec<f32>>, wb: &HashMap<String, Vec<f32>>) -> HashMap<String, f64> {
    assert_eq!(wa.len(), wb.len());
    let mut out = HashMap::new();
    for (name, x) in wa {
        let y = &wb[name];
        assert_eq!(x.len(), y.len(), "{name}: the shapes differ");
        let (x, y) = if name.ends_with("attn.c_attn.bias") {
            let c = x.len() / 3;
            ([&x[..c], &x[2 * c..]].concat(), [&y[..c], &y[2 * c..]].concat())
        } else {
            (x.clone(), y.clone())
        };
        let norm = y.iter().map(|v| f64::from(v * v)).sum::<f64>().sqrt().max(1e-12);
        let diff = x.iter().zip(&y).map(|(p, q)| f64::from((p - q) * (p - q))).sum::<f64>().sqrt();
        out.insert(name.clone(), diff / norm);
    }
    out
}

/// Every tensor of `a` within `limit` (relative L2) of `b`'s. A wrong reduction (a missing
/// average, a shard at the wrong offset, a rank's rows counted twice) moves weights by orders of
/// magnitude more than the limits used here.
fn assert_same_weights(a: &Path, b: &Path, limit: f64, noise: f64, what: &str) {
    let all = distances(a, b);
    let worst = all.iter().max_by(|a, b| a.1.total_cmp(b.1)).map(|(n, d)| format!("{d:.2e} ({n})"));
    eprintln!("{what}: worst {}", worst.unwrap_or_default());
    for (name, d) in all {
        assert!(
            d <= limit,
            "{what}: {name} differs by {d:.2e} relative (limit {limit:.1e}, reassociation alone {noise:.1e})"
        );
    }
}

/// A command line's words (none of these hold spaces).
fn args(line: &str) -> Vec<String> {
    line.split_whitespace().map(String::from).collect()
}

fn pretrain_args(out: &Path, micro: usize, stage: u8) -> Vec<String> {
    let mut a = args("--from-scratch --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --train-iters 6 --gradient-accumulation-steps 2 --lr 3e-3 --lr-warmup-iters 1 --dropout 0 --eval-iters 1 --log-interval 3 --device cpu --dist-timeout 60 --adam-eps 1e-4");
    a.extend(["--micro-batch-size".into(), micro.to_string(), "--zero-stage".into(), stage.to_string()]);
    a.extend(["--output-dir".into(), out.display().to_string()]);
    a
}

/// The final checkpoint of a pretraining run.
fn latest(out: &Path) -> PathBuf {
    let name = std::fs::read_to_string(out.join("latest")).unwrap();
    out.join(name.trim())
}

/// `a` with the words of `extra` appended.
fn with(mut a: Vec<String>, extra: &str) -> Vec<String> {
    a.extend(args(extra));
    a
}

/// The limit a parallel pretraining run is held to against the one-rank run `single`
/// (`pretrain_args` with micro-batches of 6), with the noise it allows for: 1e-5, or twice what
/// reassociation alone moves a tensor if that is more. The control is one rank taking each
/// iteration's 12 blocks as 4 micro-batches of 3 instead of 2 of 6 (the same mean gradient,
/// summed in another order). Both use --adam-eps 1e-4: with 1e-8, Adam turns the rounding noise
/// of near-zero gradients into full-size steps of either sign (measured: 1.6e-5 between two
/// orders of summation in one process), which says nothing about the reductions under test.
fn reassociation_limit(dir: &Path, single: &Path) -> (f64, f64) {
    let control = dir.join("control");
    let mut a = pretrain_args(&control, 3, 0);
    let acc = a.iter().position(|x| x == "--gradient-accumulation-steps").unwrap();
    a[acc + 1] = "4".into();
    run_ranks(dir, "sft", 1, &a);
    let noise = distances(&latest(&control), &latest(single)).into_values().fold(0f64, f64::max);
    eprintln!("control noise {noise:.2e}");
    (1e-5f64.max(2.0 * noise), noise)
}

#[test]
fn pretraining_on_2_and_3_ranks_matches_one_rank_at_every_zero_stage() {
    let dir = tempfile::tempdir().unwrap();
    // Global batch 6 blocks per micro-step: 1 x 6, 2 x 3, 3 x 2.
    let single = dir.path().join("single");
    run_ranks(dir.path(), "sft", 1, &pretrain_args(&single, 6, 0));
    let (limit, noise) = reassociation_limit(dir.path(), &single);
    for world in [2, 3] {
        for stage in [0u8, 1, 2, 3] {
            let out = dir.path().join(format!("w{world}-s{stage}"));
            let tb = dir.path().join(format!("tb-w{world}-s{stage}"));
            let a = with(pretrain_args(&out, 6 / world, stage), &format!("--tensorboard-dir {}", tb.display()));
            let outs = run_ranks(dir.path(), "sft", world, &a);
            let log = String::from_utf8_lossy(&outs[0].stdout);
            assert!(log.contains(&format!("data parallel: {world} ranks, ZeRO stage {stage}")), "{log}");
            assert_same_weights(
                &latest(&out),
                &latest(&single),
                limit,
                noise,
                &format!("{world} ranks, stage {stage}"),
            );
            // Only rank 0 writes metrics, TensorBoard events and models.
            assert!(out.join("metrics.jsonl").is_file());
            assert_eq!(std::fs::read_dir(&tb).unwrap().count(), 1, "one event file, from rank 0");
        }
        // Stage 2 reduce-scattering in buckets during backward (a block's gradients about one
        // bucket, the embeddings cut into several; backward block by block) and all-gathering
        // the updated weights in rounds: one rank's training, the bytes of one reduce-scatter a
        // micro-batch and one all-gather a step.
        let out = dir.path().join(format!("w{world}-s2-buckets"));
        let a = with(pretrain_args(&out, 6 / world, 2), "--reduce-bucket-size 15000 --allgather-bucket-size 20000");
        let outs = run_ranks(dir.path(), "sft", world, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("ZeRO stage 2: gradients reduce-scattered during backward in"), "{log}");
        let what = format!("{world} ranks, stage 2 in buckets");
        assert_same_weights(&latest(&out), &latest(&single), limit, noise, &what);
        let whole = dir.path().join(format!("w{world}-s2"));
        let (sent, want) = (comm_bytes(&out), comm_bytes(&whole));
        assert!(
            (sent - want).abs() <= 1e-5 * want,
            "{world} ranks, stage 2 in buckets: {sent} bytes sent, {want} in one"
        );
        // Stages 1 and 3 reduce-scattering the gradients (stage 3 each unit's) in rounds of a
        // bucket: the default's weights bit for bit, in the same bytes.
        for stage in [1, 3] {
            let out = dir.path().join(format!("w{world}-s{stage}-rounds"));
            let a = with(pretrain_args(&out, 6 / world, stage), "--reduce-bucket-size 3000");
            run_ranks(dir.path(), "sft", world, &a);
            let whole = dir.path().join(format!("w{world}-s{stage}"));
            let what = format!("{world} ranks, stage {stage} in rounds");
            assert!(weights(&latest(&out)) == weights(&latest(&whole)), "{what}: other weights");
            let (sent, want) = (comm_bytes(&out), comm_bytes(&whole));
            assert!((sent - want).abs() <= 1e-5 * want, "{what}: {sent} bytes, {want} in one");
        }
    }
}

/// What one rank sends per optimizer step in ZeRO's ring collectives over `world` ranks, each
/// of L values sending (N - 1)/N of its buffer per phase, in fp32: stage 0 all-reduces the
/// gradients accumulated over the step's micro-batches (two phases), stage 1 reduce-scatters
/// them and all-gathers the updated weights (the same volume), stage 2 reduce-scatters each
/// micro-batch's gradients as DeepSpeed's does (it keeps only its shard of the sum across
/// micro-batches) and all-gathers the weights once, and stage 3, per micro-batch, gathers the outer unit (embeddings, final
/// norm) for the embedding and the head (the embedding's backward reads no weights) and each
/// block for its forward and its recomputation, and reduce-scatters the outer unit's gradients
/// twice (head, embedding) and each block's once.
///
/// With `half_gradients` (`--communication-data-type fp16/bf16`) the gradients' reductions send
/// 2 bytes a value; the weights' gathers stay fp32.
fn ring_bytes_per_step(
    cfg: &hybrid_engine::Gpt2Config,
    stage: u8,
    world: usize,
    micro_batches: usize,
    (half_gradients, half_weights): (bool, bool),
) -> f64 {
    let (mut outer, mut blocks) = (0usize, 0usize);
    for (name, shape) in hybrid_engine::model::params::parameter_shapes(cfg) {
        let n: usize = shape.iter().product();
        match name.starts_with("h.") {
            true => blocks += n,
            false => outer += n,
        }
    }
    let phase = |values: usize| 4.0 * values as f64 * (world - 1) as f64 / world as f64;
    let g = if half_gradients { 0.5 } else { 1.0 };
    let w = if half_weights { 0.5 } else { 1.0 };
    match stage {
        0 => 2.0 * g * phase(outer + blocks),
        1 => (g + w) * phase(outer + blocks),
        2 => (micro_batches as f64 * g + w) * phase(outer + blocks),
        _ => micro_batches as f64 * (phase(outer) * (2.0 * w + 2.0 * g) + phase(blocks) * (2.0 * w + g)),
    }
}

/// The bytes rank 0 sent in training (its `rank_usage` record in metrics.jsonl).
fn comm_bytes(out: &Path) -> f64 {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["event"] == "rank_usage")
        .expect("a rank_usage record")["comm_bytes"]
        .as_f64()
        .unwrap()
}

/// The bytes a rank sends in training at every ZeRO stage on 2 and 3 ranks, with fp32 and (on 2)
/// bf16 gradient reductions, are ZeRO's ring volumes (`ring_bytes_per_step`) to within 0.001% (the scalars reduced beside them: about 100
/// bytes in 40-260 MB): a stage that moved a buffer twice, or a bucket left out, is off by
/// a whole buffer.
#[test]
fn zero_stages_send_the_ring_volumes_of_theory() {
    let dir = tempfile::tempdir().unwrap();
    for world in [2usize, 3] {
        for stage in [0u8, 1, 2, 3] {
            let out = dir.path().join(format!("w{world}-s{stage}"));
            run_ranks(dir.path(), "sft", world, &with(pretrain_args(&out, 6 / world, stage), "--eval-interval 0"));
            let cfg = hybrid_engine::checkpoints::hf_io::read_config(&latest(&out).join("config.json")).unwrap();
            // 6 iterations of 2 micro-batches (--gradient-accumulation-steps 2).
            let sent = comm_bytes(&out);
            let theory = 6.0 * ring_bytes_per_step(&cfg, stage, world, 2, (false, false));
            let what = format!("{world} ranks, stage {stage}: {sent} bytes sent, theory {theory}");
            assert!((sent - theory).abs() <= 1e-5 * theory, "{what}");
            eprintln!("{what}");
            // Gradients reduced in bf16 (DeepSpeed's communication_data_type): their bytes
            // halve, and training follows the fp32 reductions to bf16's precision.
            if world == 2 {
                let half = dir.path().join(format!("w{world}-s{stage}-bf16"));
                let a =
                    with(pretrain_args(&half, 6 / world, stage), "--eval-interval 0 --communication-data-type bf16");
                let outs = run_ranks(dir.path(), "sft", world, &a);
                let log = String::from_utf8_lossy(&outs[0].stdout);
                assert!(log.contains("gradients reduced in bf16"), "{log}");
                let sent = comm_bytes(&half);
                let theory = 6.0 * ring_bytes_per_step(&cfg, stage, world, 2, (true, false));
                let what = format!("{world} ranks, stage {stage}, bf16 gradients: {sent} bytes sent, theory {theory}");
                assert!((sent - theory).abs() <= 1e-5 * theory, "{what}");
                let (loss, want) = (per_iteration(&half, "lm_loss"), per_iteration(&out, "lm_loss"));
                assert_same_curve(&loss, &want, 0, 1e-3, &what);
            }
        }
    }
}

/// DeepSpeed's stages 1 and 2 under mixed precision on 2 ranks: each rank keeps only its shard
/// of the fp32 masters (said in the log) and all-gathers the updated weights in bf16, so the
/// weights' phase sends half the bytes of fp32 (gradients still reduced in fp32); training is
/// that of whole masters (stage 0 in bf16 on the same ranks) to float rounding, and the saved
/// checkpoint (the masters gathered on rank 0, each rank's optimizer shard) holds the same fp32
/// weights. Stage 3 gathers its units in bf16 too: half the weights' bytes. Under tensor
/// parallelism the masters of each TP rank's slices are sharded alike.
#[test]
fn mixed_precision_zero_shards_the_masters_and_gathers_the_weights_in_half_the_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, stage: u8, extra: &str| {
        let out = dir.path().join(name);
        let a = with(pretrain_args(&out, 3, stage), &format!("--eval-interval 0 --dtype bf16 {extra}"));
        let outs = run_ranks(dir.path(), "sft", 2, &a);
        (out, String::from_utf8_lossy(&outs[0].stdout).into_owned())
    };
    let (whole, log) = run("s0", 0, "");
    assert!(!log.contains("fp32 masters"), "{log}");
    let cfg = hybrid_engine::checkpoints::hf_io::read_config(&latest(&whole).join("config.json")).unwrap();
    for stage in [1u8, 2, 3] {
        // Stage 1 also saves at iteration 3 (resumed below; its save's gathers go to rank 0,
        // which sends nothing in them).
        let (out, log) = run(&format!("s{stage}"), stage, if stage == 1 { "--save-interval 3" } else { "" });
        let sharded = format!("ZeRO stage {stage} in bf16: each rank keeps 1/2 of the fp32 masters");
        assert_eq!(log.contains(&sharded), stage < 3, "{log}");
        let sent = comm_bytes(&out);
        let theory = 6.0 * ring_bytes_per_step(&cfg, stage, 2, 2, (false, true));
        let what = format!("stage {stage} in bf16: {sent} bytes sent, theory {theory}");
        assert!((sent - theory).abs() <= 1e-5 * theory, "{what}");
        assert!(
            latest(&out).join("optimizer-rank-001-of-002.safetensors").is_file(),
            "{what}: each rank saves its shard"
        );
        // (Stage 3's weights against one rank: sft_in_fp16_and_bf16_on_2_ranks_at_stages_2_and_3.)
        if stage < 3 {
            assert_same_weights(&latest(&out), &latest(&whole), 1e-6, 0.0, &what);
        }
    }
    // Stage 1's checkpoint at iteration 3 resumed at stage 2 (each rank cuts its master shard
    // from the saved weights and reads its moments) ends where the uninterrupted runs end.
    let saved = dir.path().join("s1");
    std::fs::write(saved.join("latest"), "iter_0000003\n").unwrap();
    let (resumed, log) = run("resumed", 2, &format!("--load {}", saved.display()));
    assert!(log.contains("resumed from") && log.contains("at iteration 3"), "{log}");
    assert_same_weights(&latest(&resumed), &latest(&whole), 1e-6, 0.0, "stage 1 in bf16 resumed at stage 2");
    // Under tensor parallelism (TP=2 x DP=2) each rank keeps its shard of its TP slices' masters;
    // the save puts the slices together on the first data-parallel rank, then the TP ranks'.
    let tp = |name: &str, stage: u8| {
        let out = dir.path().join(name);
        let a = with(pretrain_args(&out, 3, stage), "--eval-interval 0 --dtype bf16 --tensor-model-parallel-size 2");
        let outs = run_ranks(dir.path(), "sft", 4, &a);
        (out, String::from_utf8_lossy(&outs[0].stdout).into_owned())
    };
    let (tp_whole, _) = tp("tp-s0", 0);
    let (tp_sharded, log) = tp("tp-s1", 1);
    assert!(log.contains("ZeRO stage 1 in bf16: each rank keeps 1/2 of the fp32 masters"), "{log}");
    assert_same_weights(&latest(&tp_sharded), &latest(&tp_whole), 1e-6, 0.0, "TP=2 x DP=2, stage 1 in bf16");
}

/// One metric of each iteration of a pretraining run (`lm_loss`, `grad_norm`), from its metrics.
fn per_iteration(out: &Path, key: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    records.filter(|r| r.get("lm_loss").is_some()).map(|r| r[key].as_f64().unwrap()).collect()
}

/// `a` within `limit` relative of `b`, iteration by iteration (`b` from iteration `first`).
fn assert_same_curve(a: &[f64], b: &[f64], first: usize, limit: f64, what: &str) {
    assert_eq!(a.len() + first, b.len(), "{what}: iterations");
    for (i, (x, y)) in a.iter().zip(&b[first..]).enumerate() {
        assert!((x - y).abs() <= limit * y.abs(), "{what}: iteration {}: {x} vs {y}", first + i + 1);
    }
}

/// Megatron's layout: TP=2 and TP=2 x DP=2 (ZeRO stages 0-3 across the DP groups) end with the
/// one-rank run's weights and losses; the consolidated checkpoint of TP=2 resumes at TP=1 x DP=2
/// and at TP=1 x DP=1, that of TP=2 x DP=2 at stage 3 on one rank, and the one-rank checkpoint at
/// TP=2 x DP=2 at stages 2 and 3, on the uninterrupted trajectory. The embedding's 50304 rows are padded to 50432 (a multiple of 128 x 2) under
/// TP=2, so the saved embedding also checks that the padding is cut off again.
#[test]
fn pretraining_with_tensor_parallelism_matches_one_rank_and_resumes_in_any_layout() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    run_ranks(dir.path(), "sft", 1, &with(pretrain_args(&single, 6, 0), "--save-interval 3"));
    let (expected, expected_norms) = (per_iteration(&single, "lm_loss"), per_iteration(&single, "grad_norm"));
    assert_eq!(expected.len(), 6);
    // A row-parallel layer sums partial products in another order: reassociation again.
    let (limit, noise) = reassociation_limit(dir.path(), &single);
    // ZeRO stages 1-3 shard each TP rank's slices across its data-parallel group.
    for (world, micro, stage) in [(2, 6, 0), (4, 3, 0), (4, 3, 1), (4, 3, 2), (4, 3, 3)] {
        let out = dir.path().join(format!("tp2-w{world}-s{stage}"));
        let flags = "--save-interval 3 --tp-size 2";
        let outs = run_ranks(dir.path(), "sft", world, &with(pretrain_args(&out, micro, stage), flags));
        let log = String::from_utf8_lossy(&outs[0].stdout);
        let dp = world / 2;
        assert!(log.contains(&format!("tensor parallel: 2 ranks per layer, {dp} data-parallel groups")), "{log}");
        let what = format!("TP=2 x DP={dp} at ZeRO stage {stage}");
        // Only rank 0 writes metrics; the loss is the data-parallel mean, counted once per TP group.
        assert_same_curve(&per_iteration(&out, "lm_loss"), &expected, 0, 1e-5, &format!("{what} loss"));
        // The norm that clipping reads counts every replicated parameter once, every slice once.
        let norms = per_iteration(&out, "grad_norm");
        assert_same_curve(&norms, &expected_norms, 0, 1e-5, &format!("{what} grad norm"));
        assert_same_weights(&latest(&out), &latest(&single), limit, noise, &what);
    }
    // Half precision: bf16 and fp16 compute at TP=2 follow the one-rank run in the same dtype, the
    // losses within 1e-3 relative (the dtype's rounding, not the layout; measured 1.4e-4 in bf16).
    // fp16 from 2^16: Megatron's default 2^32 would skip all 6 iterations.
    for (dtype, scaler) in [("bf16", ""), ("fp16", " --initial-scale-power 16")] {
        let one = dir.path().join(format!("{dtype}-single"));
        run_ranks(dir.path(), "sft", 1, &with(pretrain_args(&one, 6, 0), &format!("--dtype {dtype}{scaler}")));
        let split = dir.path().join(format!("{dtype}-tp2"));
        let flags = format!("--dtype {dtype}{scaler} --tp-size 2");
        run_ranks(dir.path(), "sft", 2, &with(pretrain_args(&split, 6, 0), &flags));
        let what = format!("{dtype} at TP=2");
        assert_same_curve(&per_iteration(&split, "lm_loss"), &per_iteration(&one, "lm_loss"), 0, 1e-3, &what);
        let scales = per_iteration(&split, "loss_scale");
        assert_eq!(scales, per_iteration(&one, "loss_scale"), "{what}: the same loss scales (and skipped steps)");
    }
    // Resharding: the TP=2 checkpoint of iteration 3 continues at TP=1 on 2 ranks and on 1, and
    // that of TP=2 x DP=2 at stage 3 on 1.
    for (from, world) in [("tp2-w2-s0", 2), ("tp2-w2-s0", 1), ("tp2-w4-s3", 1)] {
        let from_tp = stopped_at(&dir.path().join(from), 3, &dir.path().join(format!("from-{from}-{world}")));
        let resumed = dir.path().join(format!("{from}-to-w{world}"));
        let mut a = pretrain_args(&resumed, 6 / world, 0);
        a.extend(["--load".into(), from_tp.display().to_string()]);
        let out = run_ranks(dir.path(), "sft", world, &a);
        assert!(String::from_utf8_lossy(&out[0].stdout).contains("resumed from"), "the run must resume");
        let what = format!("{from} -> TP=1 x DP={world}");
        assert_same_weights(&latest(&resumed), &latest(&single), limit, noise, &what);
        assert_same_curve(&per_iteration(&resumed, "lm_loss"), &expected, 3, 1e-5, &format!("{what} loss"));
    }
    // And the other way: the one-rank checkpoint continues at TP=2 x DP=2 with ZeRO stages 2 and
    // 3 (each rank cuts its slices of the weights, then its data-parallel shard of their moments,
    // at stage 3 of the weights too).
    let from_one = stopped_at(&single, 3, &dir.path().join("from-one"));
    for stage in [2u8, 3] {
        let resumed = dir.path().join(format!("one-to-tp2-w4-s{stage}"));
        let mut a = with(pretrain_args(&resumed, 3, stage), "--tp-size 2 --load");
        a.push(from_one.display().to_string());
        run_ranks(dir.path(), "sft", 4, &a);
        let what = format!("TP=1 -> TP=2 x DP=2 at stage {stage}");
        assert_same_weights(&latest(&resumed), &latest(&single), limit, noise, &what);
        assert_same_curve(&per_iteration(&resumed, "lm_loss"), &expected, 3, 1e-5, &format!("{what} loss"));
    }
}

/// Every rank of a bad layout fails with one line saying what to change.
#[test]
fn bad_tensor_parallel_layouts_are_one_line_each() {
    let dir = tempfile::tempdir().unwrap();
    let base = |extra: &str| {
        let mut a = pretrain_args(&dir.path().join("bad"), 2, 0);
        a.extend(args(extra));
        a
    };
    // (world, ranks per node, flags, what the line says)
    let cases: &[(usize, usize, &str, &str)] = &[
        (1, 1, "--tp-size 2", "does not divide the 1 ranks"),
        (2, 2, "--tp-size 2 --num-attention-heads 1", "does not divide the model's 1 attention heads"),
        (2, 1, "--tp-size 2", "across nodes (1 ranks per node)"),
    ];
    for &(world, per_node, flags, want) in cases {
        let port = free_port();
        let a = base(flags);
        let children: Vec<Child> = (0..world)
            .map(|r| {
                let local = (r % per_node).to_string();
                let env = [("LOCAL_WORLD_SIZE", per_node.to_string()), ("LOCAL_RANK", local)];
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                start_rank_with(dir.path(), "sft", (r, world, port), &a, &env)
            })
            .collect();
        for (r, c) in children.into_iter().enumerate() {
            let out = wait(c, Duration::from_secs(120));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains(want), "{flags}, rank {r}: {err}");
            assert_eq!(err.lines().count(), 1, "{flags}, rank {r}: one line: {err}");
        }
    }
    // Step 3: --inference-tp-size has nothing to re-lay out under TP, refused before any work.
    let a = args("--tp-size 2 --inference-tp-size 2 --device cpu");
    let out = wait(start_rank(dir.path(), "ppo", 0, 1, 0, &a), Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("drop --inference-tp-size"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
}

/// A checkpoint directory holding only `out`'s checkpoint of `iteration`, as if the run had
/// stopped there.
fn stopped_at(out: &Path, iteration: u64, root: &Path) -> PathBuf {
    let name = format!("iter_{iteration:07}");
    std::fs::create_dir_all(root.join(&name)).unwrap();
    for f in std::fs::read_dir(out.join(&name)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), root.join(&name).join(f.file_name())).unwrap();
    }
    std::fs::write(root.join("latest"), &name).unwrap();
    root.to_path_buf()
}

#[test]
fn pretraining_resumes_at_another_world_size_and_stage_on_the_same_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    // One rank, 6 iterations, a checkpoint every 3: the trajectory to continue.
    let single = dir.path().join("single");
    run_ranks(dir.path(), "sft", 1, &with(pretrain_args(&single, 6, 0), "--save-interval 3"));
    let end = latest(&single);

    // 2 ranks at stage 3 stop at iteration 3; one rank resumes with micro-batches of 3 and
    // --global-batch-size 12 (4 accumulation steps instead of 2 x 2 ranks).
    let two = dir.path().join("two");
    run_ranks(dir.path(), "sft", 2, &with(pretrain_args(&two, 3, 3), "--save-interval 3"));
    // Each rank wrote the optimizer state it holds; no rank gathered all of it.
    let files = |d: PathBuf| -> Vec<String> {
        let mut f: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        f.retain(|n| n.starts_with("optimizer"));
        f.sort();
        f
    };
    let sharded =
        ["optimizer-manifest.json", "optimizer-rank-000-of-002.safetensors", "optimizer-rank-001-of-002.safetensors"];
    assert_eq!(files(two.join("iter_0000003")), sharded);
    assert_eq!(files(end.clone()), ["optimizer-manifest.json", "optimizer-rank-000-of-001.safetensors"]);
    assert!(
        !std::fs::read_dir(&two).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with('.')),
        "no staging left"
    );
    let from_two = stopped_at(&two, 3, &dir.path().join("from-two"));
    let resumed = dir.path().join("two-to-one");
    let mut a = pretrain_args(&resumed, 3, 0);
    let acc = a.iter().position(|x| x == "--gradient-accumulation-steps").unwrap();
    a.drain(acc..acc + 2);
    a.extend(args("--global-batch-size 12 --load"));
    a.push(from_two.display().to_string());
    let out = run_ranks(dir.path(), "sft", 1, &a);
    assert!(String::from_utf8_lossy(&out[0].stdout).contains("resumed from"), "the run must resume");
    assert_same_weights(&latest(&resumed), &end, 1e-5, 0.0, "2 ranks (stage 3) -> 1 rank");

    // One rank stops at iteration 3; 3 ranks at stage 3 resume.
    let from_one = stopped_at(&single, 3, &dir.path().join("from-one"));
    let resumed = dir.path().join("one-to-three");
    let mut a = pretrain_args(&resumed, 2, 3);
    a.push("--load".into());
    a.push(from_one.display().to_string());
    run_ranks(dir.path(), "sft", 3, &a);
    assert_same_weights(&latest(&resumed), &end, 1e-5, 0.0, "1 rank -> 3 ranks (stage 3)");

    // Another global batch is refused with one line that says what differs.
    let mut a = pretrain_args(&dir.path().join("refused"), 2, 0);
    a.extend(["--load".into(), from_one.display().to_string()]);
    let out = wait(start_rank(dir.path(), "sft", 0, 1, 0, &a), Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("global batch") && err.contains("= 4 now, 12 then"), "{err}");
}

/// `--adam-eps 1e-2` and no clipping make the update proportional to the gradient for most
/// values, so a gradient scaled wrongly (a missing average over ranks) changes the weights;
/// clipping or Adam's usual 1e-8 would normalise the scale away. Step 1's share of the demo data
/// is about a tenth (`--data-split 99,801,100`): 396 training rows, 25 optimizer steps at a global
/// micro-batch of 8 rows (a last micro-batch of 4 rows), 33 at 6, every one of which must agree
/// with the one-rank run. 396 is a multiple of 2, 3 and 4 ranks: a rank pads its share with
/// repeated rows otherwise (as torch's `DistributedSampler` does), which one rank does not see.
fn sft_args(out: &Path, per_device: usize, stage: u8) -> Vec<String> {
    let mut a = args("--data-path demo --data-split 99,801,100 --max-seq-len 48 --learning-rate 2e-3 --num-train-epochs 1 --dropout 0 --gradient-accumulation-steps 2 --device cpu --dist-timeout 60 --log-interval 100 --adam-eps 1e-2 --gradient-clipping 0");
    a.extend([
        "--per-device-train-batch-size".into(),
        per_device.to_string(),
        "--zero-stage".into(),
        stage.to_string(),
    ]);
    a.extend(["--output-dir".into(), out.display().to_string()]);
    a.extend(["--data-output-path".into(), out.with_extension("cache").display().to_string()]);
    a
}

/// `args` with `--data-split` replaced: a smaller share of the demo for step 1 where a test is
/// about how ranks start or agree, not about how far training goes.
fn with_data_split(mut args: Vec<String>, split: &str) -> Vec<String> {
    let at = args.iter().position(|x| x == "--data-split").expect("the args have a --data-split");
    args[at + 1] = split.into();
    args
}

/// Global micro-batches of 8 rows on 2 ranks (ZeRO stages 0 and 2) and of 6 on 3 (uneven shards;
/// stages 1 and 3): every stage once through step 1's data path. The pretraining test above runs
/// every stage on both world sizes; this one is about SFT's sampler, its last short micro-batch
/// and the averaging over ranks, which the stage does not change (halved for CI's time).
#[test]
fn sft_on_2_and_3_ranks_matches_one_rank_at_every_zero_stage() {
    let dir = tempfile::tempdir().unwrap();
    for (world, per_device, stages) in [(2, 4, [0u8, 2]), (3, 2, [1, 3])] {
        let rows = world * per_device;
        let single = dir.path().join(format!("single-{rows}"));
        run_ranks(dir.path(), "sft", 1, &sft_args(&single, rows, 0));
        for stage in stages {
            let out = dir.path().join(format!("w{world}-s{stage}"));
            std::fs::create_dir_all(&out).unwrap();
            std::fs::write(out.join("NOTES.txt"), "a user's file").unwrap();
            let outs = run_ranks(dir.path(), "sft", world, &sft_args(&out, per_device, stage));
            assert_same_weights(&out, &single, 1e-5, 0.0, &format!("SFT on {world} ranks, stage {stage}"));
            // Stage 3 builds the model sharded (each rank draws the one-rank values of its shard)
            // and saves it as it is gathered: the directory keeps the user's file, and no
            // staging directory is left beside it.
            let log = String::from_utf8_lossy(&outs[0].stdout);
            assert_eq!(log.contains("drawn sharded"), stage == 3, "{log}");
            assert!(out.join("NOTES.txt").is_file(), "the save kept the user's file");
            let hidden = std::fs::read_dir(dir.path()).unwrap().flatten();
            let left: Vec<_> = hidden.filter(|e| e.file_name().to_string_lossy().starts_with('.')).collect();
            assert!(left.is_empty(), "staging left behind: {left:?}");
        }
    }
}

/// The eval perplexities (before training, after each epoch) of a step-1 run.
fn sft_perplexities(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let end: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    end["summary"]["perplexity"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

/// Step 1 with the tiny model's 4 heads split over 2 ranks, alone and as 2 x 2 ranks (ZeRO 0,
/// and 3: each TP rank's slices sharded over its data-parallel group): the one-rank run's
/// weights and perplexities, and one consolidated HF model directory.
#[test]
fn sft_with_tensor_parallelism_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    run_ranks(dir.path(), "sft", 1, &sft_args(&single, 8, 0));
    let expected = sft_perplexities(&single);
    assert_eq!(expected.len(), 2);
    for (world, per_device, stage) in [(2, 8, 0), (4, 4, 0), (4, 4, 3)] {
        let out = dir.path().join(format!("tp2-w{world}-s{stage}"));
        let mut a = sft_args(&out, per_device, stage);
        a.extend(args("--tensor-model-parallel-size 2"));
        let outs = run_ranks(dir.path(), "sft", world, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        let what = format!("SFT at TP=2 x DP={} at ZeRO stage {stage}", world / 2);
        assert!(
            log.contains(&format!("tensor parallel: 2 ranks per layer, {} data-parallel groups", world / 2)),
            "{log}"
        );
        // Each rank draws the one-rank weights tensor by tensor and keeps only its slices.
        assert!(log.contains("random weights of size tiny (seed 1234), drawn in TP slices"), "{log}");
        assert_same_weights(&out, &single, 1e-5, 0.0, &what);
        for (a, b) in sft_perplexities(&out).iter().zip(&expected) {
            assert!((a - b).abs() <= 1e-5 * b, "{what}: perplexity {a} vs {b}");
        }
    }
}

/// LoRA under ZeRO stage 3 with the trunk frozen, whose units are gathered for every forward
/// but get no gradient and no optimizer state (adapters beside a trained trunk: the PPO test);
/// and under tensor parallelism, each adapter cut as its linear (TP=2, and TP=2 x DP=2 at stage 3).
#[test]
fn sft_with_lora_at_stage_3_and_under_tensor_parallelism_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (flags, what) = ("--lora-dim 4 --lora-learning-rate 4e-3 --only-optimize-lora", "LoRA on a frozen trunk");
    let single = dir.path().join("single");
    let mut a = sft_args(&single, 8, 0);
    a.extend(args(flags));
    run_ranks(dir.path(), "sft", 1, &a);
    for (world, per_device, stage, tp) in [(2, 4, 3u8, 1), (2, 8, 0, 2), (4, 4, 3, 2)] {
        let out = dir.path().join(format!("w{world}-s{stage}-tp{tp}"));
        let mut a = sft_args(&out, per_device, stage);
        a.extend(args(&format!("{flags} --tp-size {tp}")));
        let outs = run_ranks(dir.path(), "sft", world, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("LoRA: rank 4"), "{log}");
        if stage == 3 {
            assert!(log.contains("ZeRO stage 3"), "{log}");
            // Without TP the model is built sharded, adapters included, and saved block by block
            // with the adapters fused in: no rank holds it whole.
            assert_eq!(log.contains(", drawn sharded") || log.contains(", read by slices"), tp == 1, "{log}");
            assert_eq!(log.contains("written block by block"), tp == 1, "{log}");
        }
        let what = format!("SFT with {what} on {world} ranks, stage {stage}, TP={tp}");
        assert_same_weights(&out, &single, 1e-5, 0.0, &what);
        // The model directory has the adapters merged; a frozen trunk's adapters are also saved
        // on their own (PEFT), the same tensors on both runs: the adapters, no trunk weight.
        let adapter = |d: &Path| d.join("adapter/adapter_model.safetensors");
        let (a, b) = (weights_file(&adapter(&out)), weights_file(&adapter(&single)));
        assert!(a.keys().all(|n| n.contains("lora_")), "{what}: {:?}", a.keys());
        for (name, d) in tensor_distances(&a, &b) {
            assert!(d <= 1e-5, "{what}: adapter {name} differs by {d:.2e} relative");
        }
    }
}

/// Step 2 on 54 pairs, a multiple of 2 and 3 ranks (see [`sft_args`]; 7 eval pairs: uneven shares
/// on 2 and 3 ranks) at a global batch of 12 pairs with 2 micro-batches per step: 4 full
/// micro-batches, a last one of 6 pairs, and a final step flushed from one micro-batch. Large Adam
/// epsilon and no clipping, as [`sft_args`].
fn reward_args(start: &Path, out: &Path, per_device: usize, stage: u8) -> Vec<String> {
    let mut a = args("--data-path demo --data-split 9812,188,0 --max-seq-len 48 --learning-rate 2e-3 --num-train-epochs 1 --dropout 0 --gradient-accumulation-steps 2 --per-device-eval-batch-size 4 --device cpu --dist-timeout 60 --log-interval 100 --adam-eps 1e-2 --gradient-clipping 0");
    a.extend([
        "--per-device-train-batch-size".into(),
        per_device.to_string(),
        "--zero-stage".into(),
        stage.to_string(),
    ]);
    a.extend(["--model-name-or-path".into(), start.display().to_string()]);
    a.extend(["--output-dir".into(), out.display().to_string()]);
    a.extend(["--data-output-path".into(), out.with_extension("cache").display().to_string()]);
    a
}

/// The reward model's starting actor: the tiny preset with every bias lifted off zero, as a
/// step-1 actor has them. From zero, a bias's relative distance is the relative error of its few
/// updates alone, and the pairwise loss makes their gradients near-cancelling sums (opposite loss
/// gradients on the similar hidden states of the chosen and rejected rows): float reassociation
/// alone then moves the residual-stream biases by 5e-6 to 9e-6 relative (measured: one process at
/// another micro-batch size; 2 and 3 ranks), and `ln_f.bias`, whose exact gradient is zero (it
/// shifts every score alike), by 100%. From these biases the worst tensor moves by 2e-7, and a
/// gradient summed over ranks instead of averaged by 1e-2.
fn reward_start(dir: &Path) -> PathBuf {
    use hybrid_engine::model::reward_model::causal_lm_config;
    let cfg = hybrid_engine::Gpt2Config::tiny();
    let params = hybrid_engine::ParamStore::init(&cfg, 5, &candle_core::Device::Cpu).unwrap();
    for (i, (name, var)) in params.iter().enumerate() {
        if name.ends_with(".bias") {
            let n = var.elem_count();
            let bump: Vec<f32> = (0..n).map(|k| ((k * 7 + i * 13) % 17) as f32 * 0.01 - 0.08).collect();
            let bump = candle_core::Tensor::from_vec(bump, var.shape(), &candle_core::Device::Cpu).unwrap();
            var.set(&(var.as_tensor() + bump).unwrap()).unwrap();
        }
    }
    let start = dir.join("start");
    hybrid_engine::checkpoints::resume::save_model_dir(&start, &causal_lm_config(&cfg), &params, &|_| Ok(())).unwrap();
    start
}

fn reward_eval(model_dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(model_dir.join("reward_eval.json")).unwrap()).unwrap()
}

/// Every number of two `RewardEval`s within `tol` (absolute), pair counts and accuracy exactly.
fn assert_same_eval(a: &serde_json::Value, b: &serde_json::Value, tol: f64, what: &str) {
    assert_eq!(a["pairs"], b["pairs"], "{what}: {a} vs {b}");
    assert_eq!(a["accuracy"], b["accuracy"], "{what}: {a} vs {b}");
    let numbers = |v: &serde_json::Value| -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = ["chosen_mean_score", "rejected_mean_score", "score_length_correlation"]
            .iter()
            .map(|k| (k.to_string(), v[k].as_f64().unwrap()))
            .collect();
        let q = v["margin_quantiles"].as_object().unwrap();
        out.extend(q.iter().map(|(k, x)| (k.clone(), x.as_f64().unwrap())));
        out
    };
    let (na, nb) = (numbers(a), numbers(b));
    assert_eq!(na.len(), 10, "{what}: {a}");
    for ((k, x), (kb, y)) in na.iter().zip(&nb) {
        assert_eq!(k, kb, "{what}");
        assert!((x - y).abs() <= tol, "{what}: {k} is {x} vs {y} (tolerance {tol:.0e})");
    }
}

#[test]
fn reward_model_on_2_and_3_ranks_and_under_tensor_parallelism_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let start = reward_start(dir.path());
    let single = dir.path().join("single");
    run_ranks(dir.path(), "reward", 1, &reward_args(&start, &single, 12, 0));
    let one = reward_eval(&single);
    for (world, stage) in [(2, 0u8), (2, 1), (2, 2), (2, 3), (3, 0), (3, 1), (3, 2), (3, 3)] {
        let out = dir.path().join(format!("w{world}-s{stage}"));
        let outs = run_ranks(dir.path(), "reward", world, &reward_args(&start, &out, 12 / world, stage));
        let what = format!("reward model on {world} ranks, stage {stage}");
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains(&format!("data parallel: {world} ranks, ZeRO stage {stage}")), "{log}");
        let other = String::from_utf8_lossy(&outs[1].stdout);
        assert!(!other.contains("Evaluating reward") && !other.contains("saved the reward model"), "{other}");
        // Stage 3 builds the model sharded: each rank reads its shard of the step-1 model.
        assert_eq!(log.contains("read by slices"), stage == 3, "{log}");
        let d = distances(&out, &single);
        assert!(d.contains_key("score.weight"), "the score head is compared: {:?}", d.keys());
        assert_same_weights(&out, &single, 1e-5, 0.0, &what);
        // Rank 0 reports the evaluation of all the eval pairs, not of its share: before training
        // the weights are the same; after it they differ by the reassociation of sums.
        let many = reward_eval(&out);
        assert_same_eval(&many["before_training"], &one["before_training"], 1e-6, &what);
        assert_same_eval(&many["final"], &one["final"], 1e-5, &what);
    }
    // LoRA on a frozen trunk at stage 3 (the head and adapters trained): built sharded, the
    // adapters drawn whole and cut beside the head; against one rank with the same LoRA.
    let lora = "--lora-dim 4 --lora-learning-rate 4e-3 --only-optimize-lora";
    let single_lora = dir.path().join("single-lora");
    run_ranks(dir.path(), "reward", 1, &with(reward_args(&start, &single_lora, 12, 0), lora));
    let out = dir.path().join("w2-s3-lora");
    let outs = run_ranks(dir.path(), "reward", 2, &with(reward_args(&start, &out, 6, 3), lora));
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("read by slices") && log.contains("only LoRA is optimized"), "{log}");
    assert!(log.contains("written block by block"), "{log}");
    assert_same_weights(&out, &single_lora, 1e-5, 0.0, "reward model with LoRA on 2 ranks, stage 3");
    // Tensor parallelism (the tiny trunk's 4 heads over 2 ranks, the score head whole on each):
    // TP=2 alone and as 2 data-parallel groups (ZeRO 0 and 3).
    for (world, per_device, stage) in [(2, 12, 0), (4, 6, 0), (4, 6, 3)] {
        let out = dir.path().join(format!("tp2-w{world}-s{stage}"));
        let mut a = reward_args(&start, &out, per_device, stage);
        a.extend(args("--tensor-model-parallel-size 2"));
        let outs = run_ranks(dir.path(), "reward", world, &a);
        let what = format!("reward model at TP=2 x DP={} at ZeRO stage {stage}", world / 2);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(
            log.contains(&format!("tensor parallel: 2 ranks per layer, {} data-parallel groups", world / 2)),
            "{log}"
        );
        // Each rank reads its slices of the starting model's memory-mapped tensors.
        assert!(log.contains(&format!("pretrained weights from {}, read in TP slices", start.display())), "{log}");
        assert_same_weights(&out, &single, 1e-5, 0.0, &what);
        let many = reward_eval(&out);
        assert_same_eval(&many["before_training"], &one["before_training"], 1e-6, &what);
        assert_same_eval(&many["final"], &one["final"], 1e-5, &what);
    }
}

#[test]
fn a_killed_rank_fails_the_others_naming_it_and_mismatched_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // Stage 3 with a checkpoint every iteration: the kill lands in a step or in a save.
    let mut args = pretrain_args(&dir.path().join("k"), 2, 3);
    let at = args.iter().position(|a| a == "--train-iters").unwrap();
    args[at + 1] = "100000".into();
    args.extend(["--save-interval".into(), "1".into()]);
    let dist = args.iter().position(|a| a == "--dist-timeout").unwrap();
    args[dist + 1] = "20".into();
    let mut rank0 = start_rank(dir.path(), "sft", 0, 2, port, &args);
    let mut rank1 = start_rank(dir.path(), "sft", 1, 2, port, &args);
    // Killed once the first checkpoint is in place (polled, not a fixed sleep: on a loaded
    // machine the first save can take longer than any sleep), then a little later.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !dir.path().join("k/latest").exists() {
        if Instant::now() > deadline {
            let _ = (rank0.kill(), rank1.kill(), rank0.wait(), rank1.wait());
            panic!("no checkpoint within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(700));
    rank1.kill().unwrap();
    let _ = rank1.wait();
    let t0 = Instant::now();
    let out = wait(rank0, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("rank 1"), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "one line: {err}");
    assert!(t0.elapsed() < Duration::from_secs(25), "failed within the timeout");
    // The last checkpoint is whole: it loads and its optimizer shards restore.
    let ck = hybrid_engine::checkpoints::resume::load_checkpoint(&dir.path().join("k"), &candle_core::Device::Cpu)
        .expect("the checkpoint survives a killed rank");
    let params =
        hybrid_engine::ParamStore::from_tensors(&ck.model.config, &ck.model.tensors, &candle_core::Device::Cpu)
            .unwrap();
    let mut optimizer = hybrid_engine::training::optim::AdamW::new(Default::default(), &params).unwrap();
    let numels: Vec<usize> = params.vars.iter().map(|v| v.elem_count()).collect();
    ck.optimizer.restore(&mut optimizer, &params.names, &numels).expect("its optimizer state is complete");
    assert!(ck.state.iteration >= 1, "a checkpoint was written before the kill");

    // Ranks started with different flags: every rank is refused with a line naming rank 1.
    let port = free_port();
    let a = pretrain_args(&dir.path().join("m"), 2, 0);
    let mut b = a.clone();
    let lr = b.iter().position(|x| x == "--lr").unwrap();
    b[lr + 1] = "1e-3".into();
    let children = [start_rank(dir.path(), "sft", 0, 2, port, &a), start_rank(dir.path(), "sft", 1, 2, port, &b)];
    for (r, c) in children.into_iter().enumerate() {
        let out = wait(c, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("rank 1's training flags differ"), "rank {r}: {err}");
    }

    // A rank that never comes: rank 0 names it when the timeout ends.
    let mut lonely = pretrain_args(&dir.path().join("l"), 2, 0);
    let dist = lonely.iter().position(|a| a == "--dist-timeout").unwrap();
    lonely[dist + 1] = "2".into();
    let out = wait(start_rank(dir.path(), "sft", 0, 3, free_port(), &lonely), Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank(s) 1, 2 of 3 never arrived"), "{err}");
}

#[test]
fn train_single_node_runs_step_1_as_ranks_with_a_log_each() {
    let dir = tempfile::tempdir().unwrap();
    // A fast step-1 recipe in the layout of scripts/recipes: 1% of the demo for step 1, a few
    // optimizer steps (the launcher is the point).
    let recipes = dir.path().join("recipes/step1_sft");
    std::fs::create_dir_all(&recipes).unwrap();
    std::fs::write(
        recipes.join("single_node.sh"),
        // `train` passes '' when it is given no stage (the TP run below): the recipe's default.
        "exec sft --model-name-or-path=\"$3\" --zero-stage=\"${2:-0}\" --output-dir=\"$1\" --data-path demo \
         --data-split 1,98,1 --max-seq-len 48 --per-device-train-batch-size 4 --num-train-epochs 1 --dropout 0 \
         --data-output-path \"$1.cache\"\n",
    )
    .unwrap();
    let out = dir.path().join("out dir 'quoted'");
    let run = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--step", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--actor-zero-stage", "2"])
        .arg("--recipe-dir")
        .arg(dir.path().join("recipes"))
        .arg("--output-dir")
        .arg(&out)
        .args(["--actor-model", "tiny", "--device", "cpu"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("data parallel: 2 ranks, ZeRO stage 2"), "{stdout}");
    for r in 0..2 {
        let log = std::fs::read_to_string(out.join(format!("actor/rank-{r}.log"))).unwrap();
        assert!(log.contains("data parallel: 2 ranks"), "rank {r}: {log}");
    }
    assert!(out.join("actor/model.safetensors").is_file());
    // --tensor-model-parallel-size reaches the steps: the 2 ranks form one TP group.
    let tp_out = dir.path().join("tp");
    let train = |extra: &[&str], out: &Path| {
        Command::new(env!("CARGO_BIN_EXE_train"))
            .args(extra)
            .arg("--recipe-dir")
            .arg(dir.path().join("recipes"))
            .arg("--output-dir")
            .arg(out)
            .args(["--actor-model", "tiny", "--device", "cpu"])
            .output()
            .unwrap()
    };
    let run = train(&["--step", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--tp-size", "2"], &tp_out);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("tensor parallel: 2 ranks per layer, 1 data-parallel groups"), "{stdout}");
    assert!(tp_out.join("actor/model.safetensors").is_file());
    // Layouts it cannot run are one line before anything starts.
    for (extra, want) in [
        (&["--step", "1", "--tp-size", "2"][..], "add --deployment-type single_node"),
        (
            &["--step", "3", "--deployment-type", "single_node", "--tp-size", "2", "--inference-tp-size", "2"][..],
            "drop --inference-tp-size",
        ),
        (&["--step", "3", "--inference-tp-size", "2"][..], "add --deployment-type single_node"),
        (&["--step", "1", "--deployment-type", "single_node", "--inference-tp-size", "2"][..], "step 3 is not run"),
    ] {
        let refused = dir.path().join("refused");
        let run = train(extra, &refused);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success() && err.contains(want) && err.lines().count() == 1, "{extra:?}: {err}");
        assert!(!refused.exists(), "{extra:?}: a refused run writes nothing");
    }
    // A rank that fails stops the step: one line naming the rank and its log.
    let bad = dir.path().join("bad/step1_sft");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(
        bad.join("single_node.sh"),
        "exec sft --output-dir=\"$1\" --data-path /no/such/data --max-seq-len 48 --device cpu\n",
    )
    .unwrap();
    let failed = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--step", "1", "--deployment-type", "single_node", "--num-gpus", "2", "--actor-model", "tiny"])
        .arg("--recipe-dir")
        .arg(dir.path().join("bad"))
        .arg("--output-dir")
        .arg(dir.path().join("failing"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "{err}");
    assert!(err.contains("the others were stopped") && err.contains("rank-"), "{err}");
    assert!(err.contains("/no/such/data"), "the failing rank's own error is shown: {err}");
}

/// The whole pipeline under `train --deployment-type single_node`: steps 1, 2 and 3 each as 2
/// ranks (fast recipes in the layout of scripts/recipes, each step on 1-2% of the demo's rows),
/// every step's ranks logging and rank 0 saving its model. `--actor-zero-stage ''`
/// (e2e_rlhf.py's "the script's default") reaches the recipes as '', and their own default, 2,
/// applies.
#[test]
fn train_single_node_runs_all_three_steps_as_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let recipes = dir.path().join("recipes");
    let write = |step: &str, text: &str| {
        std::fs::create_dir_all(recipes.join(step)).unwrap();
        std::fs::write(recipes.join(step).join("single_node.sh"), text).unwrap();
    };
    write(
        "step1_sft",
        "exec sft --model-name-or-path=\"$3\" --zero-stage=\"${2:-2}\" --output-dir=\"$1\" --data-path demo \
         --data-split 2,97,1 --max-seq-len 48 --per-device-train-batch-size 8 --num-train-epochs 1 --dropout 0 \
         --data-output-path \"$1.cache\"\n",
    );
    write(
        "step2_reward",
        "exec reward --model-name-or-path=\"$3\" --zero-stage=\"$2\" --output-dir=\"$1\" --data-path demo \
         --data-split 97,2,1 --max-seq-len 48 --per-device-train-batch-size 8 --num-train-epochs 1 --dropout 0 \
         --data-output-path \"$1.cache\"\n",
    );
    write(
        "step3_ppo",
        "exec ppo --actor-model-name-or-path=\"$3\" --critic-model-name-or-path=\"$5\" --actor-zero-stage=\"${2:-2}\" \
         --critic-zero-stage=\"$6\" --output-dir=\"$1\" --data-path demo --data-split 97,1,2 --max-prompt-seq-len 24 \
         --max-answer-seq-len 6 --num-train-epochs 1 --per-device-generation-batch-size 4 \
         --per-device-training-batch-size 4 --do-sample --data-output-path \"$1.cache\"\n",
    );
    let out = dir.path().join("out");
    let run = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--step", "1", "2", "3", "--deployment-type", "single_node", "--num-gpus", "2"])
        .args(["--actor-zero-stage", "", "--reward-zero-stage", "1", "--actor-model", "tiny", "--device", "cpu"])
        .args(["--inference-tp-size", "2"])
        .arg("--reward-model")
        .arg("tiny")
        .arg("--recipe-dir")
        .arg(&recipes)
        .arg("--output-dir")
        .arg(&out)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    for (step, dir, stage) in [(1, "actor", 2), (2, "reward", 1), (3, "step3", 2)] {
        for r in 0..2 {
            let log = std::fs::read_to_string(out.join(format!("{dir}/rank-{r}.log"))).unwrap();
            assert!(
                log.contains(&format!("data parallel: 2 ranks, ZeRO stage {stage}")),
                "step {step} rank {r}: {log}"
            );
        }
    }
    assert!(out.join("actor/model.safetensors").is_file() && out.join("reward/model.safetensors").is_file());
    assert!(out.join("step3/actor/model.safetensors").is_file());
    // --inference-tp-size reached step 3: its 2 ranks generated each rollout as one TP group.
    let log = std::fs::read_to_string(out.join("step3/rank-1.log")).unwrap();
    assert!(log.contains("inference tensor parallel: each rollout generated by groups of 2 ranks"), "{log}");
}

/// Step 3's starting models, tiny, over GPT-2's vocabulary (written as steps 1 and 2 save them),
/// 35 prompts (32 train) and a PTX corpus. The actor (also the reference) samples EOS often
/// enough that about a quarter of its answers have at most one token and are dropped: ranks hold
/// unequal shares of global micro-batches, and some hold none of one (measured: 9 of 32 answers
/// dropped in the one-rank run of rollouts of 8).
fn ppo_setup(dir: &Path) {
    use hybrid_engine::checkpoints::resume::save_model_dir;
    use hybrid_engine::model::reward_model::{add_score_head, causal_lm_config, sequence_classification_config};
    let cpu = candle_core::Device::Cpu;
    let cfg = hybrid_engine::Gpt2Config {
        n_layer: 1,
        n_embd: 16,
        n_head: 2,
        n_positions: 64,
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        ..hybrid_engine::Gpt2Config::tiny()
    };
    let tok = data::Tokenizer::gpt2_default().unwrap();
    let eos = tok.eos_id() as usize;
    let write_tok = |d: &Path| tok.save(&d.join("tokenizer.json"));
    let actor = hybrid_engine::ParamStore::init(&cfg, 1, &cpu).unwrap();
    // The final hidden state gets 10 on its first dimension, and EOS's embedding reads it: an EOS
    // logit near 9 against 50k near-zero ones, prompt-dependent through the rest of the state.
    for (name, var) in actor.iter() {
        let mut v: Vec<f32> = var.flatten_all().unwrap().to_vec1().unwrap();
        match name {
            "ln_f.bias" => v[0] = 10.0,
            "wte.weight" => {
                v[eos * cfg.n_embd..(eos + 1) * cfg.n_embd].fill(0.0);
                v[eos * cfg.n_embd] = 0.85;
            }
            _ => continue,
        }
        var.set(&candle_core::Tensor::from_vec(v, var.shape(), &cpu).unwrap()).unwrap();
    }
    save_model_dir(&dir.join("actor"), &causal_lm_config(&cfg), &actor, &write_tok).unwrap();
    let mut rm = hybrid_engine::ParamStore::init(&cfg, 2, &cpu).unwrap();
    add_score_head(&mut rm, &cfg, 2, &cpu).unwrap();
    save_model_dir(&dir.join("reward"), &sequence_classification_config(&cfg, eos as u32), &rm, &write_tok).unwrap();
    let rows: Vec<String> = (0..35)
        .map(|i| {
            let prompt = format!("\n\nHuman: What is {i} plus one?\n\nAssistant:");
            serde_json::json!({"prompt": prompt, "chosen": " x", "rejected": " y"}).to_string()
        })
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows.join("\n")).unwrap();
    let sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank.\n";
    std::fs::write(dir.join("ptx.txt"), sentence.repeat(20)).unwrap();
}

/// A short PPO run: sampled rollouts, 2 PPO epochs over 2 buffered rollouts, accumulation over 2
/// micro-batches, PTX and EMA; dropout off, and `--adam-eps 1e-2` with no clipping so that a
/// gradient scaled wrongly changes the weights (see `sft_args`).
fn ppo_args(dir: &Path, out: &Path, generation: usize, training: usize, stages: (u8, u8)) -> Vec<String> {
    let mut a = args("--data-split 0,0,1 --no-data-cache --max-prompt-seq-len 24 --max-answer-seq-len 5 --actor-learning-rate 1e-3 --critic-learning-rate 1e-3 --num-warmup-steps 0 --do-sample --enable-ema --unsup-coef 0.5 --ppo-epochs 2 --generation-batches 2 --gradient-accumulation-steps 2 --print-answers-interval 0 --actor-dropout 0 --critic-dropout 0 --adam-eps 1e-2 --gradient-clipping 0 --device cpu --dist-timeout 60 --seed 7");
    let path = |name: &str| dir.join(name).display().to_string();
    a.extend(["--data-path".into(), path("prompts.jsonl"), "--unsupervised-dataset-name".into(), path("ptx.txt")]);
    a.extend([
        "--actor-model-name-or-path".into(),
        path("actor"),
        "--critic-model-name-or-path".into(),
        path("reward"),
    ]);
    a.extend(["--per-device-generation-batch-size".into(), generation.to_string()]);
    a.extend(["--per-device-training-batch-size".into(), training.to_string()]);
    a.extend(["--actor-zero-stage".into(), stages.0.to_string(), "--critic-zero-stage".into(), stages.1.to_string()]);
    a.extend(["--output-dir".into(), out.display().to_string()]);
    a
}

/// The records of a step-3 metrics.jsonl: one per rollout, then the summary.
fn ppo_metrics(out: &Path) -> (Vec<serde_json::Value>, serde_json::Value) {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps = records.iter().filter(|r| r.get("rollout").is_some()).cloned().collect();
    let end = records.iter().find(|r| r["event"] == "end").expect("an end record").clone();
    (steps, end["summary"].clone())
}

/// The N-rank run ended with the one-rank run's actor, critic and EMA, and logged its global
/// statistics: rank 0's log holds the whole rollout's reward, KL, losses and drop counts.
fn assert_same_ppo(out: &Path, single: &Path, what: &str) {
    for model in ["actor", "critic", "actor_ema"] {
        assert_same_weights(&out.join(model), &single.join(model), 1e-5, 0.0, &format!("{what}: {model}"));
    }
    let ((steps, summary), (want_steps, want_summary)) = (ppo_metrics(out), ppo_metrics(single));
    assert_eq!(steps.len(), want_steps.len(), "{what}: rollouts");
    assert_eq!(summary["answers_dropped_short"], want_summary["answers_dropped_short"], "{what}");
    assert_eq!(summary["rollouts_reused"], want_summary["rollouts_reused"], "{what}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()) + 1e-6;
    for (got, want) in steps.iter().zip(&want_steps) {
        for key in ["actor_loss", "critic_loss", "ratio_mean", "clip_fraction", "approx_kl", "entropy", "ptx_loss"] {
            let (a, b) = (got[key].as_f64(), want[key].as_f64());
            assert!(
                a.zip(b).is_none_or(|(a, b)| close(a, b)) && a.is_some() == b.is_some(),
                "{what}: {key} {got} vs {want}"
            );
        }
        for key in ["reward_mean", "reward_std", "kl_ref_k3", "explained_variance", "answer_len_mean", "rows"] {
            let (a, b) = (got["rollout"][key].as_f64().unwrap(), want["rollout"][key].as_f64().unwrap());
            assert!(close(a, b), "{what}: rollout {key} {got} vs {want}");
        }
    }
}

/// GRPO and RLOO on 2 ranks: the 4 answers to a prompt sit at consecutive rollout positions,
/// which the ranks share alternately, so every rank's advantages need the other rank's rewards
/// (summed over the ranks by position): the 2-rank run must end with the one-rank run's actor
/// and EMA and log its statistics. With --normalize-reward, whose moments span both ranks too,
/// and the losses per answer (GRPO Dr. GRPO's, RLOO DeepSeekMath's), whose shares are the ranks'
/// answers, with RLOO's advantages whitened over both ranks' tokens. (GRPO with DeepSeekMath's
/// loss agrees to 1e-6 in every gradient norm for 19 steps, until a rollout samples one other
/// token from weights 1e-7 apart; the pairing above samples the same answers throughout.)
/// REINFORCE++ normalises its discounted returns over both ranks' tokens.
#[test]
fn critic_free_algorithms_on_2_ranks_match_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let runs = [
        ("grpo", "--loss-type dr_grpo"),
        ("rloo", "--loss-type grpo --whiten-advantages"),
        ("reinforce_pp", "--gamma 0.9"),
    ];
    for (algorithm, extra) in runs {
        let run = |out: &Path, ranks: usize, generation: usize, training: usize| {
            let mut a = ppo_args(dir.path(), out, generation, training, (0, 0));
            // No critic: its flags are refused.
            for flag in ["--critic-learning-rate", "--critic-dropout"] {
                let at = a.iter().position(|x| x == flag).expect("ppo_args sets it");
                a.drain(at..at + 2);
            }
            a.extend(args(&format!("--algorithm {algorithm} --num-samples-per-prompt 4 --normalize-reward {extra}")));
            run_ranks(dir.path(), "ppo", ranks, &a);
        };
        let single = dir.path().join(format!("{algorithm}-1"));
        run(&single, 1, 8, 4);
        let out = dir.path().join(format!("{algorithm}-2"));
        run(&out, 2, 4, 2);
        let moved = distances(&single.join("actor"), &dir.path().join("actor")).into_values().fold(0f64, f64::max);
        assert!(moved > 1e-3, "{algorithm}: the actor barely trained ({moved:.1e})");
        for model in ["actor", "actor_ema"] {
            assert_same_weights(&out.join(model), &single.join(model), 1e-5, 0.0, &format!("{algorithm}: {model}"));
        }
        assert!(!out.join("critic").exists() && !single.join("critic").exists(), "{algorithm} has no critic");
        let ((steps, _), (want_steps, _)) = (ppo_metrics(&out), ppo_metrics(&single));
        assert_eq!(steps.len(), want_steps.len(), "{algorithm}: rollouts");
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()) + 1e-6;
        for (got, want) in steps.iter().zip(&want_steps) {
            // (None on a rollout that is only collected: --generation-batches 2.)
            for key in ["actor_loss", "ratio_mean", "clip_fraction", "approx_kl", "entropy"] {
                let (a, b) = (got[key].as_f64(), want[key].as_f64());
                assert!(a.zip(b).is_none_or(|(a, b)| close(a, b)) && a.is_some() == b.is_some(), "{algorithm}: {key}");
            }
            for key in ["reward_mean", "advantage_mean", "advantage_std", "rows"] {
                let (a, b) = (got["rollout"][key].as_f64().unwrap(), want["rollout"][key].as_f64().unwrap());
                assert!(close(a, b), "{algorithm}: rollout {key} {got} vs {want}");
            }
        }
    }
}

/// A scorer that fails for good on one rank stops every rank at the same rollout (the others
/// would otherwise wait in the next collective until --dist-timeout): all of them save the
/// rollouts done, with the actor sharded at ZeRO stage 3, each ends with one error line (rank
/// 0's naming the failed rank), and the same ranks resumed with --load end with the weights of
/// the run without the fault, byte for byte.
#[test]
fn a_scorer_failing_on_one_rank_stops_every_rank_with_a_checkpoint_to_resume_from() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let fail_at = dir.path().join("fail_at");
    // On rank 1 only, from line 40 on (rollout 3 or later: at most 16 answers a rank a rollout), while `fail_at`
    // is there: exit 1 before answering. Reward 1 for an answer with an "e" in it, else -1.
    let script = format!(
        r#"n=0; while IFS= read -r line; do n=$((n+1))
if [ "$RANK" = 1 ] && [ -f '{fail}' ] && [ $n -ge 40 ]; then exit 1; fi
case "${{line#*\"answer\":}}" in *e*) echo 1;; *) echo -1;; esac
done"#,
        fail = fail_at.display()
    );
    std::fs::write(dir.path().join("scorer.sh"), script).unwrap();
    let spec = format!("exec:sh {}", dir.path().join("scorer.sh").display());
    let ranks_args = |out: &Path| {
        let mut a = ppo_args(dir.path(), out, 4, 4, (3, 0));
        // One rollout an update and no accumulation across rollouts: every rollout's end is a
        // point to save at. GRPO trains no critic: its flags are refused.
        for flag in
            ["--generation-batches", "--gradient-accumulation-steps", "--critic-learning-rate", "--critic-dropout"]
        {
            let at = a.iter().position(|x| x == flag).expect("ppo_args sets it");
            a.drain(at..at + 2);
        }
        a.extend(args("--algorithm grpo --num-samples-per-prompt 4 --reward-fn-tries 1 --reward-fn"));
        a.push(spec.clone());
        a
    };
    let clean = dir.path().join("clean");
    run_ranks(dir.path(), "ppo", 2, &ranks_args(&clean));

    std::fs::write(&fail_at, "").unwrap();
    let broken = dir.path().join("broken");
    let port = free_port();
    let children: Vec<Child> =
        (0..2).map(|r| start_rank(dir.path(), "ppo", r, 2, port, &ranks_args(&broken))).collect();
    let outs: Vec<Output> = children.into_iter().map(|c| wait(c, Duration::from_secs(300))).collect();
    let root = broken.join("checkpoints");
    let mut saves = Vec::new();
    for (rank, out) in outs.iter().enumerate() {
        let said = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "rank {rank}: {said}");
        let errors: Vec<&str> = said.lines().filter(|l| l.starts_with("error")).collect();
        assert!(errors.len() == 1 && said.trim_end().ends_with(errors[0]), "rank {rank}: one error line:\n{said}");
        let why = if rank == 0 { "rank 1's --reward-fn failed" } else { "exited (exit status: 1)" };
        assert!(errors[0].contains(why), "rank {rank}: want {why:?} in {}", errors[0]);
        let saved = errors[0].split_once("saved a checkpoint of rollouts 1-").map(|(_, rest)| rest.to_string());
        assert!(errors[0].ends_with(&format!("--load {}", root.display())), "rank {rank}: {}", errors[0]);
        saves.push(saved.unwrap_or_else(|| panic!("rank {rank}: no checkpoint saved: {}", errors[0])));
    }
    assert_eq!(saves[0], saves[1], "the ranks stopped at the same rollout");
    std::fs::remove_file(&fail_at).unwrap();
    run_ranks(dir.path(), "ppo", 2, &with(ranks_args(&broken), &format!("--load {}", root.display())));
    for model in ["actor", "actor_ema"] {
        let (a, b) = (weights(&broken.join(model)), weights(&clean.join(model)));
        assert!(a == b, "{model}: the resumed run's weights differ from the run without the fault");
    }
}

/// `--inference-tp-size 2` (DS-Chat's hybrid engine): each rollout is generated by TP groups of 2
/// ranks, each group generating all its ranks' rows with the actor split by heads, and every rank
/// training on its own rows: the same rollouts and training as one rank generating alone. With
/// training at ZeRO 0 and at stage 3 (the gathered actor re-laid out each rollout), and on 4
/// ranks as 2 groups.
#[test]
fn ppo_with_inference_tensor_parallelism_gives_the_rollouts_of_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let single = dir.path().join("single-8");
    run_ranks(dir.path(), "ppo", 1, &ppo_args(dir.path(), &single, 8, 4, (0, 0)));
    for (world, stages) in [(2, (0u8, 0u8)), (2, (3, 3)), (4, (0, 0))] {
        let out = dir.path().join(format!("itp2-w{world}-s{}", stages.0));
        let mut a = ppo_args(dir.path(), &out, 8 / world, 4 / world, stages);
        a.extend(args("--inference-tp-size 2"));
        let outs = run_ranks(dir.path(), "ppo", world, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("inference tensor parallel: each rollout generated by groups of 2 ranks"), "{log}");
        assert_same_ppo(&out, &single, &format!("inference TP=2 on {world} ranks, stages {stages:?}"));
    }
}

/// Step 3 under tensor parallelism: all four models split over TP groups of 2 (the critic's and
/// the reward model's score heads whole), rollouts generated from the training slices in
/// lockstep, log-probs and entropies from the vocabulary slices. TP=2 on 2 ranks and TP=2 x DP=2
/// on 4 ranks (ZeRO 2 and 1, and 3 and 3, across the data-parallel groups) end with the one-rank
/// run's actor, critic and EMA; the consolidated checkpoints resume on one rank and on 2
/// data-parallel ranks on the same trajectory.
#[test]
fn ppo_with_tensor_parallelism_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let single = dir.path().join("single-8");
    run_ranks(dir.path(), "ppo", 1, &ppo_args(dir.path(), &single, 8, 4, (0, 0)));
    let tp2 = dir.path().join("tp2");
    let mut a = ppo_args(dir.path(), &tp2, 8, 4, (0, 0));
    a.extend(args("--tensor-model-parallel-size 2 --save-interval 2"));
    let outs = run_ranks(dir.path(), "ppo", 2, &a);
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("tensor parallel: 2 ranks per layer, 1 data-parallel groups"), "{log}");
    let sliced = "tensor parallel: the actor, reference, reward model, critic read in this rank's slices";
    assert!(log.contains(sliced), "{log}");
    assert_same_ppo(&tp2, &single, "PPO at TP=2");
    // Per-device batch sizes count rows per data-parallel group: 4 and 2 each, as 2 DP ranks.
    // At stage 3 each TP rank's slices are sharded over its data-parallel group: the rollout
    // gathers the actor's slices, the EMA follows the shards.
    for stages in [(2u8, 1u8), (3, 3)] {
        let tp2dp2 = dir.path().join(format!("tp2-dp2-s{}", stages.0));
        let mut a = ppo_args(dir.path(), &tp2dp2, 4, 2, stages);
        a.extend(args("--tp-size 2 --save-interval 2"));
        a.extend(["--eval-prompts".into(), dir.path().join("prompts.jsonl").display().to_string()]);
        let outs = run_ranks(dir.path(), "ppo", 4, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("tensor parallel: 2 ranks per layer, 2 data-parallel groups"), "{log}");
        assert!(log.contains(&format!("actor: data parallel: 2 ranks, ZeRO stage {}", stages.0)), "{log}");
        assert!(log.contains("held-out prompts (35)"), "{log}");
        assert_same_ppo(&tp2dp2, &single, &format!("PPO at TP=2 x DP=2, ZeRO stages {stages:?}"));
    }
    // Resharding: the TP=2 checkpoint after rollout 2 on one rank and on 2 DP ranks, and that
    // of TP=2 x DP=2 at stage 3 on one rank.
    for (from, world, generation, training) in
        [(&tp2, 1, 8, 4), (&tp2, 2, 4, 2), (&dir.path().join("tp2-dp2-s3"), 1, 8, 4)]
    {
        let ckpts = from.join("checkpoints");
        std::fs::write(ckpts.join("latest"), "iter_0000002\n").unwrap();
        let name = from.file_name().unwrap().to_str().unwrap();
        let resumed = dir.path().join(format!("resumed-{world}-from-{name}"));
        let mut a = ppo_args(dir.path(), &resumed, generation, training, (0, 0));
        a.extend(["--load".into(), ckpts.display().to_string()]);
        let outs = run_ranks(dir.path(), "ppo", world, &a);
        assert!(String::from_utf8_lossy(&outs[0].stdout).contains("at rollout 2"));
        for model in ["actor", "critic", "actor_ema"] {
            let what = format!("{name} checkpoint resumed on {world} data-parallel ranks: {model}");
            assert_same_weights(&resumed.join(model), &single.join(model), 1e-5, 0.0, &what);
        }
    }
}

#[test]
fn ppo_on_2_and_3_ranks_matches_one_rank_at_every_zero_stage() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    // 32 train prompts in rollouts of 8, global micro-batches of 4: one rank, or 2 ranks with 4
    // and 2 each.
    let single = dir.path().join("single-8");
    run_ranks(dir.path(), "ppo", 1, &ppo_args(dir.path(), &single, 8, 4, (0, 0)));
    let (_, summary) = ppo_metrics(&single);
    assert!(summary["answers_dropped_short"].as_u64().unwrap() > 0, "rows must be dropped: {summary}");
    // Equal weights must not be the equality of nothing happening.
    for (model, start) in [("actor", "actor"), ("critic", "reward")] {
        let moved = distances(&single.join(model), &dir.path().join(start));
        let moved = moved.into_values().fold(0f64, f64::max);
        assert!(moved > 1e-3, "the {model} barely trained ({moved:.1e}): the comparison would mean nothing");
    }
    // Stage 3 shards the four models at rest, each built from its shards (read by slices):
    // generation gathers the whole actor once per rollout, the EMA is kept shard by shard, the
    // reference's and reward model's forwards gather their units, and a rank without rows runs
    // filler forwards.
    for stage in [0u8, 1, 2, 3] {
        let out = dir.path().join(format!("w2-s{stage}"));
        let mut a = ppo_args(dir.path(), &out, 4, 2, (stage, stage));
        a.extend(args("--save-interval 2"));
        let outs = run_ranks(dir.path(), "ppo", 2, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        for model in ["actor", "critic"] {
            assert!(log.contains(&format!("{model}: data parallel: 2 ranks, ZeRO stage {stage}")), "{log}");
        }
        // At stage 3 all four models are built sharded: no rank reads any of them whole.
        let built_sharded = "ZeRO stage 3: the actor, reference, critic, reward model built sharded over 2 ranks";
        assert_eq!(log.contains(built_sharded), stage == 3, "{log}");
        assert_same_ppo(&out, &single, &format!("PPO on 2 ranks, stage {stage}"));
    }
    // The 2 ranks' stage-2 and stage-3 checkpoints after rollout 2 (optimizers gathered from
    // the shards; at stage 3 the weights and the EMA too) resume on one rank at the same global
    // batch and end with the one-rank run's models.
    for stage in [2u8, 3] {
        let ckpts = dir.path().join(format!("w2-s{stage}/checkpoints"));
        std::fs::write(ckpts.join("latest"), "iter_0000002\n").unwrap();
        let resumed = dir.path().join(format!("resumed-1-from-s{stage}"));
        let mut a = ppo_args(dir.path(), &resumed, 8, 4, (0, 0));
        a.extend(["--load".into(), ckpts.display().to_string()]);
        let outs = run_ranks(dir.path(), "ppo", 1, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("resumed from") && log.contains("at rollout 2"), "{log}");
        for model in ["actor", "critic", "actor_ema"] {
            let what = format!("2 ranks at stage {stage} resumed on 1: {model}");
            assert_same_weights(&resumed.join(model), &single.join(model), 1e-5, 0.0, &what);
        }
    }
    // The stage-3 checkpoint holds no model whole on any rank: each rank wrote its optimizer
    // shards, rank 0 the HF directories unit by unit (no raw-parameter files). Resumed on 2 ranks
    // at stage 3, each rank reads only its shards of the models, the EMA and the optimizers.
    let saved = dir.path().join("w2-s3/checkpoints/iter_0000002");
    for model in ["actor", "critic"] {
        assert!(saved.join(format!("{model}_optimizer/optimizer-rank-001-of-002.safetensors")).is_file(), "{model}");
        assert!(!saved.join(format!("{model}_params.safetensors")).exists(), "{model}");
    }
    assert!(saved.join("actor_ema/model.safetensors").is_file());
    let resumed = dir.path().join("resumed-2-s3-from-s3");
    let mut a = ppo_args(dir.path(), &resumed, 4, 2, (3, 3));
    a.extend(["--load".into(), dir.path().join("w2-s3/checkpoints").display().to_string()]);
    let outs = run_ranks(dir.path(), "ppo", 2, &a);
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("at rollout 2"), "{log}");
    assert!(
        log.contains("ZeRO stage 3: the actor, reference, critic, reward model built sharded over 2 ranks"),
        "{log}"
    );
    for model in ["actor", "critic", "actor_ema"] {
        let what = format!("a stage-3 checkpoint resumed on 2 ranks at stage 3: {model}");
        assert_same_weights(&resumed.join(model), &single.join(model), 1e-5, 0.0, &what);
    }
    // And into stage 3: the optimizer state and the EMA are cut into the ranks' shards.
    let resumed = dir.path().join("resumed-2-s3");
    let mut a = ppo_args(dir.path(), &resumed, 4, 2, (3, 3));
    a.extend(["--load".into(), dir.path().join("w2-s2/checkpoints").display().to_string()]);
    let outs = run_ranks(dir.path(), "ppo", 2, &a);
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("at rollout 2"), "{log}");
    // The trained models take the checkpoint's whole values; the frozen ones are read sharded.
    assert!(log.contains("ZeRO stage 3: the reference, reward model built sharded over 2 ranks"), "{log}");
    for model in ["actor", "critic", "actor_ema"] {
        let what = format!("a stage-2 checkpoint resumed on 2 ranks at stage 3: {model}");
        assert_same_weights(&resumed.join(model), &single.join(model), 1e-5, 0.0, &what);
    }
    // 3 ranks (uneven ZeRO shards), each model at its own stage: rollouts of 6 prompts in
    // global micro-batches of 3, one row per rank; the last rollout has 2 prompts: rank 2 none
    // (its sharded actor still joins every gather, generating nothing).
    let single = dir.path().join("single-6");
    run_ranks(dir.path(), "ppo", 1, &ppo_args(dir.path(), &single, 6, 3, (0, 0)));
    let out = dir.path().join("w3");
    let mut a = ppo_args(dir.path(), &out, 2, 1, (3, 2));
    a.extend(["--eval-prompts".into(), dir.path().join("prompts.jsonl").display().to_string()]);
    let outs = run_ranks(dir.path(), "ppo", 3, &a);
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("actor: data parallel: 3 ranks, ZeRO stage 3"), "{log}");
    assert!(log.contains("critic: data parallel: 3 ranks, ZeRO stage 2"), "{log}");
    assert!(log.contains("ZeRO stage 3: the actor, reference built sharded over 3 ranks"), "{log}");
    assert_same_ppo(&out, &single, "PPO on 3 ranks, stages 3 and 2");
    // Only rank 0 logs and evaluates the held-out prompts, after the others have ended.
    assert!(log.contains("held-out prompts (35)"), "{log}");
    let other = String::from_utf8_lossy(&outs[1].stdout);
    assert!(!other.contains(" step ") && !other.contains("held-out"), "rank 1: {other}");
    // The critic sharded at rest over 3 ranks: rank 2, without a prompt in the last rollout,
    // runs its rollout forward on a filler row.
    let out = dir.path().join("w3-s1-s3");
    let outs = run_ranks(dir.path(), "ppo", 3, &ppo_args(dir.path(), &out, 2, 1, (1, 3)));
    let log = String::from_utf8_lossy(&outs[0].stdout);
    assert!(log.contains("critic: data parallel: 3 ranks, ZeRO stage 3"), "{log}");
    assert!(log.contains("ZeRO stage 3: the critic, reward model built sharded over 3 ranks"), "{log}");
    assert_same_ppo(&out, &single, "PPO on 3 ranks, stages 1 and 3");
}

/// Step 3 in bf16 with the actor at ZeRO stage 1 and the critic at stage 2 on 2 ranks: both keep
/// only their shard of the fp32 masters, the rollouts generate from the bf16 copy, the EMA is
/// kept shard by shard; the run ends with the models of whole masters (stage 0, same ranks), and
/// its checkpoint (masters and EMA gathered on rank 0, optimizer shards) resumes on the same
/// trajectory. With LoRA too (also at stage 3), and under tensor parallelism.
#[test]
fn ppo_in_bf16_at_stages_1_and_2_keeps_master_shards_and_trains_as_stage_0() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let run = |name: &str, stages: (u8, u8), extra: &str| {
        let out = dir.path().join(name);
        let a = with(ppo_args(dir.path(), &out, 4, 2, stages), &format!("--dtype bf16 --save-interval 2 {extra}"));
        let outs = run_ranks(dir.path(), "ppo", 2, &a);
        (out, String::from_utf8_lossy(&outs[0].stdout).into_owned())
    };
    let (whole, log) = run("s0", (0, 0), "");
    assert!(!log.contains("fp32 masters"), "{log}");
    let (sharded, log) = run("s1-s2", (1, 2), "");
    for stage in [1, 2] {
        let line = format!("ZeRO stage {stage} in bf16: each rank keeps 1/2 of the fp32 masters");
        assert!(log.contains(&line), "{log}");
    }
    for (model, start) in [("actor", "actor"), ("critic", "reward")] {
        let moved = distances(&whole.join(model), &dir.path().join(start)).into_values().fold(0f64, f64::max);
        assert!(moved > 1e-3, "the {model} barely trained ({moved:.1e}): the comparison would mean nothing");
    }
    assert_same_ppo(&sharded, &whole, "PPO in bf16 at stages 1 and 2 against stage 0");
    let ckpts = sharded.join("checkpoints");
    std::fs::write(ckpts.join("latest"), "iter_0000002\n").unwrap();
    let (resumed, log) = run("resumed", (1, 2), &format!("--load {}", ckpts.display()));
    assert!(log.contains("at rollout 2"), "{log}");
    for model in ["actor", "critic", "actor_ema"] {
        let what = format!("PPO in bf16 at stages 1 and 2 resumed at rollout 2: {model}");
        assert_same_weights(&resumed.join(model), &whole.join(model), 1e-5, 0.0, &what);
    }
    // Under tensor parallelism (TP=2 x DP=2): rollouts from each rank's bf16 slices, the EMA of
    // its shard of them.
    let tp = |name: &str, stages: (u8, u8)| {
        let out = dir.path().join(name);
        let a = with(ppo_args(dir.path(), &out, 4, 2, stages), "--dtype bf16 --tp-size 2");
        let outs = run_ranks(dir.path(), "ppo", 4, &a);
        (out, String::from_utf8_lossy(&outs[0].stdout).into_owned())
    };
    let (tp_whole, _) = tp("tp-s0", (0, 0));
    let (tp_sharded, log) = tp("tp-s1-s2", (1, 2));
    assert!(log.contains("ZeRO stage 2 in bf16: each rank keeps 1/2 of the fp32 masters"), "{log}");
    assert_same_ppo(&tp_sharded, &tp_whole, "PPO in bf16 at TP=2 x DP=2, stages 1 and 2 against stage 0");
    // With LoRA adapters beside the trained weights the masters stay sharded too: each rollout
    // fuses the adapters on the fp32 shards and all-gathers the fused weights in bf16 (stage 0's
    // fused masters cast, bit for bit); the saves put the masters together and merge.
    let lora = "--actor-lora-dim 4 --critic-lora-dim 4 --actor-lora-learning-rate 2e-3";
    let (lora_whole, _) = run("lora-s0", (0, 0), lora);
    let (lora_sharded, log) = run("lora-s1-s2", (1, 2), lora);
    for stage in [1, 2] {
        let line = format!("ZeRO stage {stage} in bf16: each rank keeps 1/2 of the fp32 masters");
        assert!(log.contains(&line), "{log}");
    }
    let saved = weights_file(&lora_sharded.join("actor/model.safetensors"));
    assert!(saved.keys().all(|n| !n.contains("lora_")), "adapters merged: {:?}", saved.keys());
    assert_same_ppo(&lora_sharded, &lora_whole, "PPO with LoRA in bf16 at stages 1 and 2 against stage 0");
    // At stage 3 the same fusion: the fused weights gathered in bf16 for generation, the unfused
    // ones in bf16 for the old log-probs, nothing in fp32. Stage 3 in bf16 forms and sums the
    // gradients otherwise than stage 0 (unit by unit, the tied embedding's two parts apart), and
    // sampling from bf16 weights that differ by that rounding can draw another token, after
    // which the two runs train on other rollouts (seen at rollout 3 of 4). So the runs stop
    // after rollout 2, whose samples are the same (asserted through their rewards).
    let two_rollouts = format!("{lora} --enable-test-mode --test-stop-step 2");
    let (lora_whole, _) = run("lora-s0-2", (0, 0), &two_rollouts);
    let (lora_stage_3, _) = run("lora-s3-2", (3, 3), &two_rollouts);
    let rewards =
        |out: &Path| ppo_metrics(out).0.iter().map(|s| s["rollout"]["reward_mean"].clone()).collect::<Vec<_>>();
    assert_eq!(rewards(&lora_stage_3), rewards(&lora_whole), "the same samples at stages 3 and 0");
    assert_eq!(rewards(&lora_whole).len(), 2);
    for model in ["actor", "critic", "actor_ema"] {
        let what = format!("PPO with LoRA in bf16 at stage 3 against stage 0: {model}");
        assert_same_weights(&lora_stage_3.join(model), &lora_whole.join(model), 1e-3, 2.6e-4, &what);
    }
}

/// LoRA adapters beside trained weights under ZeRO stage 3 in both of step 3's models: the
/// rollout gathers the actor with its adapters, the old log-probs read them unfused as training
/// does, and the saved actor, critic and EMA have them merged; and under tensor parallelism
/// (TP=2, and TP=2 x DP=2 at stage 3).
#[test]
fn ppo_with_lora_at_stage_3_and_under_tensor_parallelism_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    ppo_setup(dir.path());
    let lora = args("--actor-lora-dim 4 --critic-lora-dim 4 --actor-lora-learning-rate 2e-3");
    let single = dir.path().join("single");
    let mut a = ppo_args(dir.path(), &single, 8, 4, (0, 0));
    a.extend(lora.clone());
    let outs = run_ranks(dir.path(), "ppo", 1, &a);
    assert!(String::from_utf8_lossy(&outs[0].stdout).contains("LoRA"));
    let out = dir.path().join("w2-s3");
    let mut a = ppo_args(dir.path(), &out, 4, 2, (3, 3));
    a.extend(lora.clone());
    a.extend(args("--save-interval 2"));
    let outs = run_ranks(dir.path(), "ppo", 2, &a);
    // All four models built sharded, the adapters beside the actor's and critic's trunks.
    let log = String::from_utf8_lossy(&outs[0].stdout);
    let built = "ZeRO stage 3: the actor, reference, critic, reward model built sharded over 2 ranks";
    assert!(log.contains(built) && log.contains("actor LoRA: rank 4") && log.contains("critic LoRA: rank 4"), "{log}");
    assert_same_ppo(&out, &single, "PPO with LoRA on 2 ranks, stage 3");
    // Under tensor parallelism each adapter is cut as its linear; rollouts fuse the slices.
    for (world, generation, training, stage) in [(2, 8, 4, 0u8), (4, 4, 2, 3)] {
        let out = dir.path().join(format!("tp2-w{world}-s{stage}"));
        let mut a = ppo_args(dir.path(), &out, generation, training, (stage, stage));
        a.extend(lora.clone());
        a.extend(args("--tp-size 2"));
        run_ranks(dir.path(), "ppo", world, &a);
        assert_same_ppo(&out, &single, &format!("PPO with LoRA at TP=2 on {world} ranks, stage {stage}"));
    }
    // Its checkpoint after rollout 2, written sharded (each model's trunk and adapters apart,
    // gathered block by block; the optimizers' shards per rank), resumes on one rank and, read by
    // slices with the adapters restored beside the trunks, on 2 ranks at stage 3, on the same
    // trajectory.
    let ckpts = out.join("checkpoints");
    std::fs::write(ckpts.join("latest"), "iter_0000002\n").unwrap();
    let saved = weights_file(&ckpts.join("iter_0000002/actor/model.safetensors"));
    assert!(saved.keys().any(|n| n.contains("lora_A")), "{:?}", saved.keys());
    for (world, stage) in [(1, 0u8), (2, 3)] {
        let resumed = dir.path().join(format!("resumed-w{world}"));
        let (generation, training) = (8 / world, 4 / world);
        let mut a = ppo_args(dir.path(), &resumed, generation, training, (stage, stage));
        a.extend(lora.clone());
        a.extend(["--load".into(), ckpts.display().to_string()]);
        let outs = run_ranks(dir.path(), "ppo", world, &a);
        let log = String::from_utf8_lossy(&outs[0].stdout);
        assert!(log.contains("at rollout 2"), "{log}");
        if stage == 3 {
            assert!(log.contains("actor LoRA: rank 4") && log.contains("restored from the checkpoint"), "{log}");
        }
        for model in ["actor", "critic", "actor_ema"] {
            let what = format!("PPO with LoRA, 2 ranks at stage 3 resumed on {world} at stage {stage}: {model}");
            assert_same_weights(&resumed.join(model), &single.join(model), 1e-5, 0.0, &what);
        }
    }
}

/// Each optimizer step of an SFT run: (loss, gradient norm, skipped, loss scale).
fn sft_steps(out: &Path) -> Vec<(f64, Option<f64>, bool, Option<f64>)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("step").is_some() && r.get("loss").is_some())
        .map(|r| (r["loss"].as_f64().unwrap(), r["grad_norm"].as_f64(), r["skipped"] == true, r["loss_scale"].as_f64()))
        .collect()
}

/// Mixed precision under ZeRO stages 2 (fp16; the fp32 masters sharded) and 3: weights gathered in the compute dtype, fp32 gradient
/// shards, and fp16's overflow decision taken on the global gradient norm, so every rank skips
/// the same steps. Half of step 1's data (`--data-split 1,18,1`, 12 optimizer steps: these runs
/// are the slowest on the CPU); fp16 starts at a loss scale of 2^21, which overflows for the
/// first 5 of them (measured on one rank).
/// The ranks compute their halves of each batch in 16 bits and sum them in fp32, the one rank
/// sums the whole batch in its own order: measured over 50 steps on the demo's step-1 rows, the losses
/// agree within 4.2e-4 relative (bf16, 8 mantissa bits) and the gradient norms within 4.7e-3; a
/// gradient left scaled or summed where it should be averaged would be off by orders of
/// magnitude or 2x.
#[test]
fn sft_in_fp16_and_bf16_on_2_ranks_at_stages_2_and_3_matches_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    for (dtype, extra) in [("fp16", " --initial-scale-power 21"), ("bf16", "")] {
        let flags = args(&format!("--dtype {dtype}{extra}"));
        let half_data = |a: Vec<String>| with_data_split(a, "1,18,1");
        let single = dir.path().join(format!("{dtype}-single"));
        let mut a = half_data(sft_args(&single, 8, 0));
        a.extend(flags.clone());
        run_ranks(dir.path(), "sft", 1, &a);
        // fp16 at stage 2 too: the masters sharded beside the fp16 copy, the overflow skips
        // leaving the shards as they were.
        let stages: &[u8] = if dtype == "fp16" { &[2, 3] } else { &[3] };
        for &stage in stages {
            let out = dir.path().join(format!("{dtype}-w2-s{stage}"));
            let mut a = half_data(sft_args(&out, 4, stage));
            a.extend(flags.clone());
            let outs = run_ranks(dir.path(), "sft", 2, &a);
            let log = String::from_utf8_lossy(&outs[0].stdout);
            assert_eq!(log.contains("each rank keeps 1/2 of the fp32 masters"), stage == 2, "{log}");
            let (got, want) = (sft_steps(&out), sft_steps(&single));
            assert_eq!(got.len(), want.len(), "{dtype}: steps");
            if dtype == "fp16" {
                let skipped = want.iter().take_while(|s| s.2).count();
                assert!(skipped >= 4 && want.iter().skip(skipped).any(|s| !s.2), "{dtype}: skips {want:?}");
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!((g.2, g.3), (w.2, w.3), "{dtype} step {}: skipped and loss scale", i + 1);
                assert!((g.0 - w.0).abs() <= 2e-3 * w.0.abs(), "{dtype} step {}: loss {} vs {}", i + 1, g.0, w.0);
                match (g.1, w.1) {
                    (Some(a), Some(b)) => {
                        assert!((a - b).abs() <= 2e-2 * b, "{dtype} step {}: grad norm {a} vs {b}", i + 1)
                    }
                    (a, b) => assert_eq!(a.is_some(), b.is_some(), "{dtype} step {}", i + 1),
                }
            }
        }
    }
}

/// Two ranks as the other launchers start them, without Python: torchrun's environment with its
/// elastic agent's TCPStore already listening on MASTER_PORT (a listener stands in for it; our
/// store goes on the next port), Open MPI's `mpirun` (no master given: one machine) and MPICH's.
/// Each trains step 1 as one rank does.
#[test]
fn torchrun_mpirun_and_mpich_environments_start_the_ranks() {
    let dir = tempfile::tempdir().unwrap();
    // A tenth of sft_args' rows (40: 3 optimizer steps, the last of one micro-batch): the
    // launchers' environments are the point.
    let sft_args = |out: &Path, per_device| with_data_split(sft_args(out, per_device, 0), "1,98,1");
    let single = dir.path().join("single");
    run_ranks(dir.path(), "sft", 1, &sft_args(&single, 8));
    // A port whose next one is free too: the agent's store holds the first.
    let port = (0..50)
        .map(|_| free_port())
        .find(|&p| p < u16::MAX && std::net::TcpListener::bind(("0.0.0.0", p + 1)).is_ok())
        .expect("two free neighbouring ports");
    let agent_store = std::net::TcpListener::bind(("0.0.0.0", port)).expect("the agent's store");
    // Each launcher's environment of a rank, given the master port.
    type Environment = fn(usize, u16) -> Vec<(String, String)>;
    let launchers: [(&str, Environment); 3] = [
        ("torchrun", |r, port| {
            let mut env = rlhf::ranks::rank_env(r, 2, port);
            env.push(("TORCHELASTIC_USE_AGENT_STORE", "True".into()));
            env.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
        }),
        ("mpirun", |r, port| {
            let vars = [("OMPI_COMM_WORLD_RANK", r), ("OMPI_COMM_WORLD_SIZE", 2), ("OMPI_COMM_WORLD_LOCAL_RANK", r)];
            let mut env: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            env.extend([("OMPI_COMM_WORLD_LOCAL_SIZE".into(), "2".into()), ("MASTER_PORT".into(), port.to_string())]);
            env
        }),
        ("mpich", |r, port| {
            let vars = [("PMI_RANK", r), ("PMI_SIZE", 2), ("MPI_LOCALRANKID", r), ("MPI_LOCALNRANKS", 2)];
            let mut env: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            env.push(("MASTER_PORT".into(), port.to_string()));
            env
        }),
    ];
    for (name, env_of) in launchers {
        let out = dir.path().join(name);
        // torchrun's store is on `port`; the MPI runs use the next one as their master port.
        let master = if name == "torchrun" { port } else { port + 1 };
        let children: Vec<Child> = (0..2)
            .map(|r| {
                let env = env_of(r, master);
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                start_rank_with(dir.path(), "sft", (r, 1, 0), &sft_args(&out, 4), &env)
            })
            .collect();
        for (r, o) in children.into_iter().map(|c| wait(c, Duration::from_secs(300))).enumerate() {
            let log = format!("{}\n{}", String::from_utf8_lossy(&o.stderr), String::from_utf8_lossy(&o.stdout));
            assert!(o.status.success(), "{name}: rank {r} failed: {log}");
        }
        assert_same_weights(&out, &single, 1e-5, 0.0, &format!("SFT on 2 ranks started as {name} starts them"));
    }
    drop(agent_store);
}
