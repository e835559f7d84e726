//! The three phase datasets of DS-Chat (`dschat/utils/data/data_utils.py`: `create_dataset`,
//! `create_dataset_split`, `create_prompt_dataset`), built from the raw preference rows:
//!
//! - phase 1 (SFT): `prompt + chosen + EOS`, truncated to `max_seq_len`; the loss covers the
//!   answer and EOS (`--train-on-prompt`: every token, as DS-Chat);
//! - phase 2 (reward): the pair `prompt + chosen + EOS`, `prompt + rejected + EOS`;
//! - phase 3 (PPO): the prompt alone; prompts longer than `max_prompt_seq_len` are dropped.
//!
//! Every `--data-path` gives each phase its `--data-split` share of its train and of its eval
//! rows; several are blended (concatenated, then a seeded shuffle); `--sft-only-data-path`
//! datasets go wholly to phase 1; the embedded demo's rows about its held-out countries
//! (`crate::demo::heldout_countries`) go to phase 1 only. Rows with a missing field or empty
//! text are skipped and counted, never silently. Tokenized datasets are cached (see
//! [`crate::cache`]).

use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::Serialize;
use serde_json::json;

use crate::cache::{self, Columns};
use crate::sources::{self, ColumnKeys, PreferenceRow, RawDataset};
use crate::split::phase_indices;
use crate::tokenizer::Tokenizer;

/// One SFT row: `prompt + answer + EOS` (truncated to `max_seq_len`), and where the answer starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SftSample {
    pub ids: Vec<u32>,
    /// Tokens of the prompt at the start of `ids`; the loss covers the tokens after it.
    pub prompt_len: usize,
}

/// One reward-model pair: both `prompt + answer + EOS`, truncated to `max_seq_len`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairSample {
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    /// Tokens of the prompt at the start of both (for answer-length statistics).
    pub prompt_len: usize,
}

/// One PPO prompt, unpadded (batches left-pad it to `max_prompt_seq_len`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptSample {
    pub ids: Vec<u32>,
}

/// Why rows were left out (or cut), per phase; printed as one line and kept in the cache.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RowCounts {
    /// Rows that made it into the phase dataset (train and eval).
    pub kept: usize,
    /// A field the phase needs was absent.
    pub missing_field: usize,
    /// A field the phase needs was empty (or whitespace).
    pub empty_text: usize,
    /// Phase 1: the prompt fills `max_seq_len`, leaving no answer token to learn; phase 3: the
    /// prompt is longer than `max_prompt_seq_len` (DS-Chat drops these too).
    pub too_long: usize,
    /// Kept, but cut at `max_seq_len` (so without their EOS).
    pub truncated: usize,
}

impl RowCounts {
    /// "skipped 5 (missing field 2, empty text 3, too long 0), truncated 1"
    pub fn describe(&self) -> String {
        let skipped = self.missing_field + self.empty_text + self.too_long;
        format!(
            "skipped {skipped} (missing field {}, empty text {}, too long {}), truncated {}",
            self.missing_field, self.empty_text, self.too_long, self.truncated
        )
    }

    fn from_json(v: &serde_json::Value) -> Self {
        let n = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
        Self {
            kept: n("kept"),
            missing_field: n("missing_field"),
            empty_text: n("empty_text"),
            too_long: n("too_long"),
            truncated: n("truncated"),
        }
    }
}

/// The text of a field, or why the row cannot be used.
fn field<'a>(value: &'a Option<String>, counts: &mut RowCounts) -> Option<&'a str> {
    match value.as_deref() {
        None => {
            counts.missing_field += 1;
            None
        }
        Some(s) if s.trim().is_empty() => {
            counts.empty_text += 1;
            None
        }
        Some(s) => Some(s),
    }
}

/// Length of the common prefix: the prompt's tokens inside `prompt + answer`. GPT-2's BPE
/// never merges across the space that starts an answer, so this is the prompt's own length;
/// when a tokenizer does merge there, the merged token counts as answer.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// `ids + EOS` cut to `max_len`; also says whether it was cut.
fn with_eos(mut ids: Vec<u32>, eos: u32, max_len: usize) -> (Vec<u32>, bool) {
    ids.push(eos);
    let cut = ids.len() > max_len;
    ids.truncate(max_len);
    (ids, cut)
}

/// Phase 1 rows. With the prompt masked, a row whose prompt fills `max_seq_len` has nothing
/// to learn and counts as too long; with `train_on_prompt` it is kept (DS-Chat behaviour).
pub fn sft_samples(
    rows: &[PreferenceRow],
    tok: &Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    counts: &mut RowCounts,
) -> Result<Vec<SftSample>> {
    let usable: Vec<(&str, &str)> = rows
        .iter()
        .filter_map(|r| {
            let p = field(&r.prompt, counts)?;
            let c = field(&r.chosen, counts)?;
            Some((p, c))
        })
        .collect();
    let prompts = tok.encode_batch(&usable.iter().map(|(p, _)| p.to_string()).collect::<Vec<_>>())?;
    let full = tok.encode_batch(&usable.iter().map(|(p, c)| format!("{p}{c}")).collect::<Vec<_>>())?;
    let mut out = Vec::with_capacity(usable.len());
    for (prompt, ids) in prompts.iter().zip(full) {
        let prompt_len = common_prefix(prompt, &ids);
        let (ids, cut) = with_eos(ids, tok.eos_id(), max_seq_len);
        if prompt_len >= ids.len() && !train_on_prompt {
            counts.too_long += 1;
            continue;
        }
        counts.truncated += usize::from(cut);
        counts.kept += 1;
        out.push(SftSample { prompt_len: prompt_len.min(ids.len()), ids });
    }
    Ok(out)
}

/// Phase 2 rows.
pub fn pair_samples(
    rows: &[PreferenceRow],
    tok: &Tokenizer,
    max_seq_len: usize,
    counts: &mut RowCounts,
) -> Result<Vec<PairSample>> {
    let usable: Vec<(&str, String, String)> = rows
        .iter()
        .filter_map(|r| {
            let p = field(&r.prompt, counts)?;
            let c = field(&r.chosen, counts)?;
            let rj = field(&r.rejected, counts)?;
            Some((p, format!("{p}{c}"), format!("{p}{rj}")))
        })
        .collect();
    let prompts = tok.encode_batch(&usable.iter().map(|(p, _, _)| p.to_string()).collect::<Vec<_>>())?;
    let chosen = tok.encode_batch(&usable.iter().map(|(_, c, _)| c.clone()).collect::<Vec<_>>())?;
    let rejected = tok.encode_batch(&usable.iter().map(|(_, _, r)| r.clone()).collect::<Vec<_>>())?;
    let mut out = Vec::with_capacity(usable.len());
    for ((prompt, c), r) in prompts.iter().zip(chosen).zip(rejected) {
        let prompt_len = common_prefix(prompt, &c);
        let (chosen, cut_c) = with_eos(c, tok.eos_id(), max_seq_len);
        let (rejected, cut_r) = with_eos(r, tok.eos_id(), max_seq_len);
        counts.truncated += usize::from(cut_c || cut_r);
        counts.kept += 1;
        out.push(PairSample { prompt_len: prompt_len.min(chosen.len()), chosen, rejected });
    }
    Ok(out)
}

/// Phase 3 rows: prompts of at most `max_prompt_seq_len` tokens.
pub fn prompt_samples(
    rows: &[PreferenceRow],
    tok: &Tokenizer,
    max_prompt_seq_len: usize,
    counts: &mut RowCounts,
) -> Result<Vec<PromptSample>> {
    let usable: Vec<String> = rows.iter().filter_map(|r| field(&r.prompt, counts).map(str::to_string)).collect();
    let mut out = Vec::with_capacity(usable.len());
    for ids in tok.encode_batch(&usable)? {
        if ids.len() > max_prompt_seq_len {
            counts.too_long += 1;
            continue;
        }
        counts.kept += 1;
        out.push(PromptSample { ids });
    }
    Ok(out)
}

/// Which phase a dataset is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Sft = 1,
    Reward = 2,
    Ppo = 3,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Sft => "phase 1 (SFT)",
            Phase::Reward => "phase 2 (reward)",
            Phase::Ppo => "phase 3 (PPO prompts)",
        }
    }
}

/// Everything that decides the phase datasets (DS-Chat's data flags).
#[derive(Clone, Debug)]
pub struct DataConfig {
    /// `--data-path` values: DS-Chat dataset names, local files or directories, hub ids, or
    /// `demo` (the embedded demo data).
    pub data_paths: Vec<String>,
    /// `--sft-only-data-path`: used wholly, and only, by phase 1.
    pub sft_only_data_paths: Vec<String>,
    /// `--data-split` as fractions of phases 1, 2, 3.
    pub data_split: [f64; 3],
    pub keys: ColumnKeys,
    pub seed: u64,
    /// Phases 1 and 2: tokens per sequence (`--max-seq-len`).
    pub max_seq_len: usize,
    /// Phase 3: tokens per prompt (`--max-prompt-seq-len`).
    pub max_prompt_seq_len: usize,
    /// Phase 1: put the prompt inside the loss, as DS-Chat does.
    pub train_on_prompt: bool,
    /// `--data-output-path`: where tokenized datasets are cached (`None`: no cache).
    pub data_output_path: Option<PathBuf>,
}

/// A phase's train and eval samples and how the rows fared.
#[derive(Clone, Debug)]
pub struct PhaseData<T> {
    pub train: Vec<T>,
    pub eval: Vec<T>,
    pub counts: RowCounts,
    /// The cache file used or written, and whether it was a hit.
    pub cache: Option<(PathBuf, bool)>,
    /// A one-line account for the log.
    pub summary: String,
}

/// The name of the embedded demo dataset as a `--data-path` value.
pub const DEMO_DATA: &str = "demo";

fn load_source(spec: &str, keys: &ColumnKeys, seed: u64) -> Result<RawDataset> {
    if spec == DEMO_DATA {
        let keys = ColumnKeys::default();
        let train = sources::rows_from_json_bytes(crate::demo::TRAIN_JSONL, "embedded demo train.jsonl", &keys)?;
        let eval = sources::rows_from_json_bytes(crate::demo::EVAL_JSONL, "embedded demo eval.jsonl", &keys)?;
        // `heldout-countries`: phases 2 and 3 leave out the rows about the held-out countries.
        let fingerprint = format!(
            "demo:heldout-countries:{:016x}:{:016x}",
            cache::fnv1a64(crate::demo::TRAIN_JSONL),
            cache::fnv1a64(crate::demo::EVAL_JSONL)
        );
        return Ok(RawDataset { name: "demo".into(), train, eval, fingerprint });
    }
    if spec == crate::arithmetic::ARITHMETIC_DATA {
        let (train, eval) = crate::arithmetic::rows();
        // The generator's version: a change to the task must miss every cache.
        let fingerprint =
            format!("arithmetic:v4:{}:{}", crate::arithmetic::MAX_OPERAND, crate::arithmetic::DEMOS_PER_PROMPT);
        return Ok(RawDataset { name: spec.into(), train, eval, fingerprint });
    }
    sources::load_raw_dataset(spec, keys, seed)
}

/// The raw rows of `phase`, train and eval, blended over the sources; and the sources'
/// fingerprints for the cache key.
fn phase_rows(cfg: &DataConfig, phase: Phase) -> Result<(Vec<PreferenceRow>, Vec<PreferenceRow>, Vec<String>)> {
    let sft_only_feeds_it = phase == Phase::Sft && !cfg.sft_only_data_paths.is_empty();
    if cfg.data_paths.is_empty() && !sft_only_feeds_it {
        bail!("no --data-path given: pass a dataset name, a local file or directory, or `demo`");
    }
    let (mut train, mut eval, mut fingerprints) = (Vec::new(), Vec::new(), Vec::new());
    let sft_only: &[String] = if phase == Phase::Sft { &cfg.sft_only_data_paths } else { &[] };
    let everything = [1.0, 0.0, 0.0]; // DS-Chat's "10,0,0" for SFT-only data
    for (spec, split) in
        cfg.data_paths.iter().map(|s| (s, &cfg.data_split)).chain(sft_only.iter().map(|s| (s, &everything)))
    {
        let raw = load_source(spec, &cfg.keys, cfg.seed)?;
        let p = phase as usize;
        let train_idx = phase_indices(raw.train.len(), split, p, cfg.seed);
        if train_idx.is_empty() {
            bail!(
                "--data-split gives {} none of the {} training rows of {}: give phase {p} a positive weight (e.g. --data-split 2,4,4) or add data",
                phase.name(),
                raw.train.len(),
                raw.name
            );
        }
        // The demo's held-out countries are step 1's only (`crate::demo::heldout_countries`).
        let kept = |row: &PreferenceRow| {
            !(spec == DEMO_DATA
                && phase != Phase::Sft
                && crate::demo::asks_about_heldout_country(row.prompt.as_deref().unwrap_or("")))
        };
        train.extend(train_idx.into_iter().map(|i| &raw.train[i]).filter(|r| kept(r)).cloned());
        let eval_idx = phase_indices(raw.eval.len(), split, p, cfg.seed);
        eval.extend(eval_idx.into_iter().map(|i| &raw.eval[i]).filter(|r| kept(r)).cloned());
        fingerprints.push(raw.fingerprint);
    }
    if fingerprints.len() > 1 {
        // Blend: DS-Chat concatenates the datasets and shuffles the whole with the seed.
        let shuffle = |rows: Vec<PreferenceRow>| -> Vec<PreferenceRow> {
            crate::pretrain::epoch_order(&(0..rows.len()), cfg.seed, BLEND_STREAM)
                .into_iter()
                .map(|i| rows[i].clone())
                .collect()
        };
        (train, eval) = (shuffle(train), shuffle(eval));
    }
    Ok((train, eval, fingerprints))
}

/// The shuffle stream of blending, apart from the split's and the epochs'.
const BLEND_STREAM: u64 = u64::MAX - 2;

/// The cache key: every input that shapes a phase dataset.
fn cache_key(cfg: &DataConfig, phase: Phase, fingerprints: &[String], tok: &Tokenizer) -> serde_json::Value {
    json!({
        "format": cache::CACHE_FORMAT_VERSION,
        "phase": phase as u8,
        "sources": fingerprints,
        "data_paths": cfg.data_paths,
        "sft_only_data_paths": if phase == Phase::Sft { cfg.sft_only_data_paths.clone() } else { vec![] },
        "data_split": cfg.data_split,
        "keys": [cfg.keys.prompt, cfg.keys.chosen, cfg.keys.rejected],
        "seed": cfg.seed,
        "tokenizer": format!("{:016x}", tok.fingerprint()),
        "max_seq_len": if phase == Phase::Ppo { 0 } else { cfg.max_seq_len },
        "max_prompt_seq_len": if phase == Phase::Ppo { cfg.max_prompt_seq_len } else { 0 },
        "train_on_prompt": phase == Phase::Sft && cfg.train_on_prompt,
    })
}

/// Builds (or reads from the cache) one phase's dataset. `build` turns raw rows into samples,
/// `to_columns`/`from_columns` are its cache layout.
fn phase_data<T>(
    cfg: &DataConfig,
    tok: &Tokenizer,
    phase: Phase,
    column_names: &[&str],
    build: impl Fn(&[PreferenceRow], &mut RowCounts) -> Result<Vec<T>>,
    to_columns: impl Fn(&[T]) -> Vec<Vec<Vec<u32>>>,
    from_columns: impl Fn(Vec<Vec<Vec<u32>>>) -> Vec<T>,
) -> Result<PhaseData<T>> {
    let (train_rows, eval_rows, fingerprints) = phase_rows(cfg, phase)?;
    let key = cache_key(cfg, phase, &fingerprints, tok);
    let path = cfg.data_output_path.as_ref().map(|d| cache::cache_path(d, &format!("phase{}", phase as u8), &key));
    let all_names: Vec<String> =
        ["train", "eval"].iter().flat_map(|s| column_names.iter().map(move |c| format!("{s}.{c}"))).collect();
    let all_refs: Vec<&str> = all_names.iter().map(String::as_str).collect();

    if let Some(dir) = &cfg.data_output_path {
        cache::check_cache_dir(dir)?;
    }
    let cached = path.as_ref().and_then(|p| cache::load(p, &key, &all_refs));
    let (train, eval, counts, hit) = match cached {
        Some((columns, info)) => {
            let mut cols: Vec<Vec<Vec<u32>>> = columns.into_iter().map(|(_, c)| c).collect();
            let eval_cols = cols.split_off(column_names.len());
            (from_columns(cols), from_columns(eval_cols), RowCounts::from_json(&info), true)
        }
        None => {
            let mut counts = RowCounts::default();
            let train = build(&train_rows, &mut counts)?;
            let eval = build(&eval_rows, &mut counts)?;
            if let Some(p) = &path {
                let columns: Columns =
                    all_names.iter().cloned().zip(to_columns(&train).into_iter().chain(to_columns(&eval))).collect();
                cache::save(p, &key, &columns, &json!(counts))?;
            }
            (train, eval, counts, false)
        }
    };
    if train.is_empty() {
        bail!(
            "{} has no usable training rows in {} ({}): check --prompt-key/--chosen-key/--rejected-key and --max-seq-len",
            phase.name(),
            cfg.data_paths.join(", "),
            counts.describe()
        );
    }
    let cache_note = match &path {
        Some(p) => format!("; cache {} {}", if hit { "hit" } else { "written" }, p.display()),
        None => String::new(),
    };
    let summary = format!(
        "data {}: {} train / {} eval rows from {}; {}{cache_note}",
        phase.name(),
        train.len(),
        eval.len(),
        cfg.data_paths
            .iter()
            .chain(if phase == Phase::Sft { &cfg.sft_only_data_paths[..] } else { &[] })
            .cloned()
            .collect::<Vec<_>>()
            .join(" + "),
        counts.describe()
    );
    Ok(PhaseData { train, eval, counts, cache: path.map(|p| (p, hit)), summary })
}

/// Phase 1 (SFT) train and eval samples.
pub fn sft_data(cfg: &DataConfig, tok: &Tokenizer) -> Result<PhaseData<SftSample>> {
    phase_data(
        cfg,
        tok,
        Phase::Sft,
        &["ids", "prompt_len"],
        |rows, counts| sft_samples(rows, tok, cfg.max_seq_len, cfg.train_on_prompt, counts),
        |s| vec![s.iter().map(|x| x.ids.clone()).collect(), s.iter().map(|x| vec![x.prompt_len as u32]).collect()],
        |mut c| {
            let lens = c.pop().unwrap_or_default();
            let ids = c.pop().unwrap_or_default();
            ids.into_iter()
                .zip(lens)
                .map(|(ids, l)| SftSample { ids, prompt_len: l.first().copied().unwrap_or(0) as usize })
                .collect()
        },
    )
}

/// Phase 2 (reward) train and eval pairs.
pub fn reward_data(cfg: &DataConfig, tok: &Tokenizer) -> Result<PhaseData<PairSample>> {
    phase_data(
        cfg,
        tok,
        Phase::Reward,
        &["chosen", "rejected", "prompt_len"],
        |rows, counts| pair_samples(rows, tok, cfg.max_seq_len, counts),
        |s| {
            vec![
                s.iter().map(|x| x.chosen.clone()).collect(),
                s.iter().map(|x| x.rejected.clone()).collect(),
                s.iter().map(|x| vec![x.prompt_len as u32]).collect(),
            ]
        },
        |mut c| {
            let lens = c.pop().unwrap_or_default();
            let rejected = c.pop().unwrap_or_default();
            let chosen = c.pop().unwrap_or_default();
            chosen
                .into_iter()
                .zip(rejected)
                .zip(lens)
                .map(|((chosen, rejected), l)| PairSample {
                    chosen,
                    rejected,
                    prompt_len: l.first().copied().unwrap_or(0) as usize,
                })
                .collect()
        },
    )
}

/// Phase 3 (PPO) train and eval prompts.
pub fn prompt_data(cfg: &DataConfig, tok: &Tokenizer) -> Result<PhaseData<PromptSample>> {
    phase_data(
        cfg,
        tok,
        Phase::Ppo,
        &["ids"],
        |rows, counts| prompt_samples(rows, tok, cfg.max_prompt_seq_len, counts),
        |s| vec![s.iter().map(|x| x.ids.clone()).collect()],
        |mut c| c.pop().unwrap_or_default().into_iter().map(|ids| PromptSample { ids }).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(p: Option<&str>, c: Option<&str>, r: Option<&str>) -> PreferenceRow {
        PreferenceRow { prompt: p.map(String::from), chosen: c.map(String::from), rejected: r.map(String::from) }
    }

    fn tok() -> Tokenizer {
        Tokenizer::gpt2_default().expect("embedded tokenizer")
    }

    #[test]
    fn the_embedded_tasks_load_by_name_and_their_held_out_prompts_are_none_of_their_rows() -> Result<()> {
        let raw = load_source(crate::arithmetic::ARITHMETIC_DATA, &ColumnKeys::default(), 1)?;
        assert_eq!(raw.name, "arithmetic");
        assert!(raw.train.len() > 300 && !raw.eval.is_empty(), "{} / {}", raw.train.len(), raw.eval.len());
        let heldout = crate::prompts::read_prompts(crate::arithmetic::ARITHMETIC_DATA, usize::MAX)?;
        let prompts: std::collections::HashSet<&str> =
            raw.train.iter().chain(&raw.eval).filter_map(|r| r.prompt.as_deref()).collect();
        assert!(!heldout.is_empty() && heldout.iter().all(|p| !prompts.contains(p.as_str())));
        Ok(())
    }

    #[test]
    fn only_step_1_asks_about_the_demos_held_out_countries() -> Result<()> {
        // The demo recipes' split: step 1 holds rows about the held-out countries (their facts);
        // the reward pairs and the PPO prompts hold none, train or eval, and lose nothing else.
        let cfg = DataConfig {
            data_paths: vec![DEMO_DATA.into()],
            data_split: [0.2, 0.6, 0.2],
            seed: 1234,
            ..config(&[], std::path::Path::new("unused"), 48)
        };
        let asks = |rows: &[PreferenceRow]| {
            rows.iter().filter(|r| crate::demo::asks_about_heldout_country(r.prompt.as_deref().unwrap())).count()
        };
        let raw = load_source(DEMO_DATA, &ColumnKeys::default(), cfg.seed)?;
        for phase in [Phase::Sft, Phase::Reward, Phase::Ppo] {
            let (train, eval, _) = phase_rows(&cfg, phase)?;
            let whole = |n: usize| phase_indices(n, &cfg.data_split, phase as usize, cfg.seed).len();
            let (all_train, all_eval) = (whole(raw.train.len()), whole(raw.eval.len()));
            if phase == Phase::Sft {
                assert_eq!((train.len(), eval.len()), (all_train, all_eval));
                assert!(asks(&train) > all_train / 10 && asks(&eval) > 0, "{} of {all_train}", asks(&train));
            } else {
                assert_eq!((asks(&train), asks(&eval)), (0, 0), "{}", phase.name());
                // About 8 of the 48 countries' rows left out.
                assert!(train.len() * 6 > all_train * 4 && train.len() * 8 < all_train * 7, "{}", train.len());
                assert!(eval.len() < all_eval);
            }
        }
        Ok(())
    }

    #[test]
    fn sft_rows_mask_the_prompt_count_skips_and_truncate() -> Result<()> {
        let tok = tok();
        let prompt = "\n\nHuman: Hi\n\nAssistant:";
        let rows = [
            row(Some(prompt), Some(" Hello world"), None),
            row(Some(prompt), None, Some(" x")),
            row(Some(prompt), Some("   "), None),
            row(None, Some(" a"), None),
        ];
        let mut counts = RowCounts::default();
        let samples = sft_samples(&rows, &tok, 64, false, &mut counts)?;
        assert_eq!(counts, RowCounts { kept: 1, missing_field: 2, empty_text: 1, too_long: 0, truncated: 0 });
        let p = tok.encode(prompt)?;
        let mut want = p.clone();
        want.extend(tok.encode(" Hello world")?);
        want.push(tok.eos_id());
        assert_eq!(samples, [SftSample { ids: want.clone(), prompt_len: p.len() }]);

        // Cut inside the answer: kept, counted as truncated, EOS lost.
        let mut counts = RowCounts::default();
        let cut = sft_samples(&rows[..1], &tok, p.len() + 1, false, &mut counts)?;
        assert_eq!(cut[0].ids, want[..p.len() + 1]);
        assert_eq!((counts.kept, counts.truncated), (1, 1));
        // An exact fit keeps its EOS and is not truncated; one token less cuts the EOS.
        let mut counts = RowCounts::default();
        assert_eq!(sft_samples(&rows[..1], &tok, want.len(), false, &mut counts)?[0].ids, want);
        assert_eq!((counts.kept, counts.truncated), (1, 0));
        let mut counts = RowCounts::default();
        assert_eq!(sft_samples(&rows[..1], &tok, want.len() - 1, false, &mut counts)?[0].ids, want[..want.len() - 1]);
        assert_eq!((counts.kept, counts.truncated), (1, 1));
        // The prompt fills the whole length: nothing to learn unless the prompt is trained on.
        let mut counts = RowCounts::default();
        assert!(sft_samples(&rows[..1], &tok, p.len(), false, &mut counts)?.is_empty());
        assert_eq!(counts.too_long, 1);
        let mut counts = RowCounts::default();
        assert_eq!(sft_samples(&rows[..1], &tok, p.len(), true, &mut counts)?.len(), 1);
        Ok(())
    }

    #[test]
    fn pairs_need_all_three_fields_and_prompts_drop_long_ones() -> Result<()> {
        let tok = tok();
        let rows = [row(Some("Q:"), Some(" yes"), Some(" no")), row(Some("Q:"), Some(" yes"), None)];
        let mut counts = RowCounts::default();
        let pairs = pair_samples(&rows, &tok, 16, &mut counts)?;
        assert_eq!((pairs.len(), counts.missing_field), (1, 1));
        assert_eq!(pairs[0].prompt_len, tok.encode("Q:")?.len());
        assert_eq!(*pairs[0].chosen.last().unwrap(), tok.eos_id());
        assert_eq!(*pairs[0].rejected.last().unwrap(), tok.eos_id());

        // A pair counts as truncated when either answer is cut: only the rejected (row 0), only
        // the chosen (row 1), neither (row 2, the shorter pair).
        let rows = [
            row(Some("Q:"), Some(" yes"), Some(" no, not at all")),
            row(Some("Q:"), Some(" no, not at all"), Some(" yes")),
            row(Some("Q:"), Some(" ok"), Some(" no")),
        ];
        let fit = tok.encode("Q: yes")?.len() + 1;
        assert!(tok.encode("Q: no, not at all")?.len() + 1 > fit);
        let mut counts = RowCounts::default();
        let pairs = pair_samples(&rows, &tok, fit, &mut counts)?;
        assert_eq!(counts, RowCounts { kept: 3, truncated: 2, ..Default::default() });
        let mut whole = tok.encode("Q: yes")?;
        whole.push(tok.eos_id());
        assert_eq!(pairs[0].chosen, whole, "an exact fit keeps its EOS");
        assert_eq!(pairs[0].rejected, tok.encode("Q: no, not at all")?[..fit], "the cut answer loses its EOS");

        // A prompt of exactly --max-prompt-seq-len tokens is kept, one token more is too long.
        let rows = [row(Some("short"), None, None), row(Some("a much longer prompt than that"), None, None)];
        let short = tok.encode("short")?.len();
        let mut counts = RowCounts::default();
        let prompts = prompt_samples(&rows, &tok, short, &mut counts)?;
        assert_eq!(prompts, [PromptSample { ids: tok.encode("short")? }]);
        assert_eq!((counts.kept, counts.too_long), (1, 1));
        let mut counts = RowCounts::default();
        assert!(prompt_samples(&rows[..1], &tok, short - 1, &mut counts)?.is_empty());
        assert_eq!((counts.kept, counts.too_long), (0, 1));
        Ok(())
    }

    #[test]
    fn row_counts_describe_the_skips_and_their_sum() {
        let counts = RowCounts { kept: 7, missing_field: 2, empty_text: 3, too_long: 4, truncated: 1 };
        assert_eq!(counts.describe(), "skipped 9 (missing field 2, empty text 3, too long 4), truncated 1");
    }

    fn write_jsonl(path: &std::path::Path, n: usize, answer: &str) -> Result<()> {
        let lines: Vec<String> = (0..n)
            .map(|i| json!({"prompt": format!("Q{i}:"), "chosen": answer, "rejected": " no"}).to_string())
            .collect();
        std::fs::write(path, lines.join("\n"))?;
        Ok(())
    }

    fn config(paths: &[&std::path::Path], cache: &std::path::Path, max_seq_len: usize) -> DataConfig {
        DataConfig {
            data_paths: paths.iter().map(|p| p.display().to_string()).collect(),
            sft_only_data_paths: vec![],
            data_split: [0.2, 0.4, 0.4],
            keys: ColumnKeys::default(),
            seed: 1,
            max_seq_len,
            max_prompt_seq_len: 8,
            train_on_prompt: false,
            data_output_path: Some(cache.to_path_buf()),
        }
    }

    #[test]
    fn the_cache_is_reused_and_rebuilt_when_an_input_changes() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (src, cache) = (dir.path().join("train.jsonl"), dir.path().join("cache"));
        write_jsonl(&src, 50, " yes")?;
        let tok = tok();
        let first = sft_data(&config(&[&src], &cache, 16), &tok)?;
        assert_eq!(first.cache.as_ref().map(|c| c.1), Some(false), "first run builds");
        let second = sft_data(&config(&[&src], &cache, 16), &tok)?;
        assert_eq!(second.cache.as_ref().map(|c| c.1), Some(true), "same inputs: cache hit");
        assert_eq!((second.train, second.eval, second.counts), (first.train.clone(), first.eval.clone(), first.counts));

        let longer = sft_data(&config(&[&src], &cache, 17), &tok)?;
        assert_eq!(longer.cache.as_ref().map(|c| c.1), Some(false), "another --max-seq-len: rebuilt");
        let reward = reward_data(&config(&[&src], &cache, 16), &tok)?;
        assert_eq!(reward.cache.as_ref().map(|c| c.1), Some(false), "another phase: its own file");

        std::thread::sleep(std::time::Duration::from_millis(20)); // a visibly newer mtime
        write_jsonl(&src, 50, " yes indeed")?;
        let changed = sft_data(&config(&[&src], &cache, 16), &tok)?;
        assert_eq!(changed.cache.as_ref().map(|c| c.1), Some(false), "edited source: rebuilt");
        assert_ne!(changed.train, first.train);
        Ok(())
    }

    /// Every input in the cache key, changed alone, rebuilds the phase that reads it (one
    /// assertion per key), and an input a phase does not read leaves its cache in use.
    #[test]
    fn every_cache_key_input_rebuilds_the_phases_that_read_it() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let (src, other, cache) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"), dir.path().join("cache"));
        let rows: Vec<String> = (0..50)
            .map(|i| {
                json!({"prompt": format!("Q{i}:"), "question": format!("R{i}:"), "chosen": " yes", "rejected": " no"})
                    .to_string()
            })
            .collect();
        std::fs::write(&src, rows.join("\n"))?;
        std::fs::copy(&src, &other)?;
        let tok = tok();
        let base = config(&[&src], &cache, 16);
        type Build = fn(&DataConfig, &Tokenizer) -> Result<Option<bool>>;
        let sft: Build = |c, t| Ok(sft_data(c, t)?.cache.map(|c| c.1));
        let reward: Build = |c, t| Ok(reward_data(c, t)?.cache.map(|c| c.1));
        let ppo: Build = |c, t| Ok(prompt_data(c, t)?.cache.map(|c| c.1));
        for build in [sft, reward, ppo] {
            build(&base, &tok)?;
            assert_eq!(build(&base, &tok)?, Some(true), "same inputs: a cache hit");
        }
        let changed = |what: &str, edit: &dyn Fn(&mut DataConfig)| {
            let mut c = base.clone();
            edit(&mut c);
            (what.to_string(), c)
        };
        let cases = [
            changed("--data-path (another file of the same content)", &|c| {
                c.data_paths = vec![other.display().to_string()]
            }),
            changed("--data-split", &|c| c.data_split = [0.3, 0.3, 0.4]),
            changed("--prompt-key", &|c| c.keys.prompt = "question".into()),
            changed("--seed", &|c| c.seed = 2),
        ];
        for (what, cfg) in &cases {
            for (phase, build) in [("sft", sft), ("reward", reward), ("ppo", ppo)] {
                assert_eq!(build(cfg, &tok)?, Some(false), "{what} must rebuild phase {phase}");
            }
        }
        // Inputs read by some phases only.
        let mut c = base.clone();
        c.sft_only_data_paths = vec![other.display().to_string()];
        assert_eq!(
            (sft(&c, &tok)?, reward(&c, &tok)?),
            (Some(false), Some(true)),
            "--sft-only-data-path: phase 1 only"
        );
        let mut c = base.clone();
        c.train_on_prompt = true;
        assert_eq!((sft(&c, &tok)?, reward(&c, &tok)?), (Some(false), Some(true)), "--train-on-prompt: phase 1 only");
        let mut c = base.clone();
        c.max_seq_len = 17;
        assert_eq!(
            (sft(&c, &tok)?, reward(&c, &tok)?, ppo(&c, &tok)?),
            (Some(false), Some(false), Some(true)),
            "--max-seq-len: phases 1 and 2"
        );
        let mut c = base.clone();
        c.max_prompt_seq_len = 9;
        assert_eq!((sft(&c, &tok)?, ppo(&c, &tok)?), (Some(true), Some(false)), "--max-prompt-seq-len: phase 3 only");
        // Another tokenizer (one added token changes its fingerprint, not these texts' ids).
        let mut json: serde_json::Value = serde_json::from_slice(crate::GPT2_TOKENIZER_JSON)?;
        let added = json["added_tokens"].as_array_mut().expect("added_tokens");
        let mut pad = added[0].clone();
        (pad["id"], pad["content"]) = (json!(50257), json!("<|pad|>"));
        added.push(pad);
        let other_tok_path = dir.path().join("tokenizer.json");
        std::fs::write(&other_tok_path, serde_json::to_vec(&json)?)?;
        let other_tok = Tokenizer::from_file(&other_tok_path)?;
        assert_ne!(other_tok.fingerprint(), tok.fingerprint());
        for (phase, build) in [("sft", sft), ("reward", reward), ("ppo", ppo)] {
            assert_eq!(build(&base, &other_tok)?, Some(false), "another tokenizer must rebuild phase {phase}");
        }
        // The source's content (its size and mtime in the fingerprint).
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&src, rows[..40].join("\n"))?;
        for (phase, build) in [("sft", sft), ("reward", reward), ("ppo", ppo)] {
            assert_eq!(build(&base, &tok)?, Some(false), "an edited source must rebuild phase {phase}");
        }
        Ok(())
    }

    /// Two local sources in `dir`: `a.jsonl` of 100 rows and `b.jsonl` of 50.
    fn two_sources(dir: &std::path::Path) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
        let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
        write_jsonl(&a, 100, " yes")?;
        write_jsonl(&b, 50, " sure")?;
        Ok((a, b))
    }

    #[test]
    fn one_source_keeps_its_split_order_and_several_are_shuffled_together() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let ((a, b), cache) = (two_sources(dir.path())?, dir.path().join("cache"));
        let cfg = config(&[&a], &cache, 16);
        // One source: phase 1's rows of its train split, in the split's order.
        let raw = load_source(&a.display().to_string(), &cfg.keys, cfg.seed)?;
        let (train, _, _) = phase_rows(&cfg, Phase::Sft)?;
        let want: Vec<_> = phase_indices(raw.train.len(), &cfg.data_split, 1, cfg.seed)
            .into_iter()
            .map(|i| raw.train[i].clone())
            .collect();
        assert_eq!(train, want);
        // Two sources: the same rows as each alone, shuffled together (DS-Chat's blend).
        let blended = phase_rows(&config(&[&a, &b], &cache, 16), Phase::Sft)?.0;
        let alone_b = phase_rows(&config(&[&b], &cache, 16), Phase::Sft)?.0;
        let prompts = |rows: &[PreferenceRow]| rows.iter().filter_map(|r| r.prompt.clone()).collect::<Vec<_>>();
        let (mut got, concatenated) = (prompts(&blended), [prompts(&train), prompts(&alone_b)].concat());
        assert_ne!(got, concatenated, "several sources are shuffled together");
        got.sort();
        let mut sorted = concatenated;
        sorted.sort();
        assert_eq!(got, sorted);

        // No --data-path: refused, unless phase 1 has --sft-only-data-path.
        let mut none = config(&[], &cache, 16);
        for phase in [Phase::Sft, Phase::Reward, Phase::Ppo] {
            let e = phase_rows(&none, phase).unwrap_err().to_string();
            assert!(e.starts_with("no --data-path given"), "{e}");
        }
        none.sft_only_data_paths = vec![b.display().to_string()];
        assert_eq!(phase_rows(&none, Phase::Sft)?.0.len(), 45);
        for phase in [Phase::Reward, Phase::Ppo] {
            assert!(phase_rows(&none, phase).is_err(), "SFT-only data feeds phase 1 only");
        }
        Ok(())
    }

    #[test]
    fn phases_get_their_shares_and_sources_blend() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let ((a, b), cache) = (two_sources(dir.path())?, dir.path().join("cache"));
        let tok = tok();
        let one = sft_data(&config(&[&a], &cache, 16), &tok)?;
        let cache_file = one.cache.as_ref().map(|c| c.0.display().to_string()).unwrap_or_default();
        let none_skipped = "skipped 0 (missing field 0, empty text 0, too long 0), truncated 0";
        let want = format!("data phase 1 (SFT): 18 train / 2 eval rows from {}; {none_skipped}", a.display());
        assert_eq!(one.summary, format!("{want}; cache written {cache_file}"));
        let both = sft_data(&config(&[&a, &b], &cache, 16), &tok)?;
        // a single file is split 9:1 into train/eval, then each phase takes its 2/10.
        assert_eq!(one.train.len(), 18);
        assert_eq!(both.train.len(), 18 + 9);
        let prompts = prompt_data(&config(&[&a], &cache, 16), &tok)?;
        assert_eq!(prompts.train.len(), 36);
        assert!(
            prompts.summary.starts_with("data phase 3 (PPO prompts): 36 train / 4 eval rows"),
            "{}",
            prompts.summary
        );

        // SFT-only data goes wholly to phase 1 (its 9:1 train share: 45 rows) and nowhere else.
        let mut with_sft_only = config(&[&a], &cache, 16);
        with_sft_only.sft_only_data_paths = vec![b.display().to_string()];
        assert_eq!(sft_data(&with_sft_only, &tok)?.train.len(), 18 + 45);
        let reward = reward_data(&with_sft_only, &tok)?;
        assert_eq!(reward.train.len(), 36);
        let from_a = format!("data phase 2 (reward): 36 train / 4 eval rows from {}; ", a.display());
        assert!(reward.summary.starts_with(&from_a), "{}", reward.summary);

        let mut nothing = config(&[&a], &cache, 16);
        nothing.data_split = [0.5, 0.5, 0.0];
        let err = prompt_data(&nothing, &tok).unwrap_err().to_string();
        assert!(err.contains("--data-split gives phase 3 (PPO prompts) none of the 90 training rows"), "{err}");
        assert!(err.contains("give phase 3 a positive weight"), "{err}");
        Ok(())
    }
}
