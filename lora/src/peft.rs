//! LoRA adapters on disk in Hugging Face PEFT's layout, so that
//! `peft.PeftModel.from_pretrained(base, dir)` applies ours and we can read theirs:
//! `adapter_config.json` (`peft_type` LORA, `r`, `lora_alpha`, `target_modules`,
//! `fan_in_fan_out` true for GPT-2's Conv1D) and `adapter_model.safetensors` with PEFT's names,
//! `base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` (r, in) and `...lora_B.weight`
//! (out, r). Whole tensors trained beside the adapters (a reward model's `score.weight`) are
//! PEFT's `modules_to_save`, stored as `base_model.model.score.weight`.
//!
//! Reading is defensive: only JSON and safetensors are parsed (never PEFT's pickle
//! `adapter_model.bin`), every shape is checked, and features we do not implement (rsLoRA, DoRA,
//! per-module ranks, trained biases) are refused with one clear line instead of being ignored.

use crate::{Adapter, LoraConfig, LORA_A, LORA_B};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// PEFT's prefix on every saved tensor: `PeftModel.base_model` (the LoRA model) `.model`.
const PREFIX: &str = "base_model.model.";
/// Where HF nests GPT-2's blocks inside `GPT2LMHeadModel` / `GPT2ForSequenceClassification`.
const TRUNK: &str = "transformer.";

/// A PEFT LoRA adapter: the pairs, their scaling, and the whole tensors saved beside them.
#[derive(Clone, Debug)]
pub struct PeftAdapter {
    /// r, the same for every pair.
    pub rank: usize,
    /// PEFT's `lora_alpha`: scaling = lora_alpha / r (1.0 for DS-Chat's 1/r).
    pub lora_alpha: f64,
    /// The model the adapter applies to (what `--model-name-or-path` named).
    pub base_model_name_or_path: String,
    /// PEFT's `task_type`: `CAUSAL_LM` for an actor, `SEQ_CLS` for a reward model or critic.
    pub task_type: String,
    /// One pair per adapted linear, named by module (`h.0.attn.c_attn`, no `transformer.`).
    pub adapters: Vec<Adapter>,
    /// Whole tensors trained with the adapters, by HF name (`score.weight`).
    pub modules_to_save: Vec<(String, Tensor)>,
}

impl PeftAdapter {
    /// An adapter trained with `cfg` (which fixes r and the scaling).
    pub fn new(cfg: &LoraConfig, base_model_name_or_path: &str, task_type: &str, adapters: Vec<Adapter>) -> Self {
        Self {
            rank: cfg.dim,
            lora_alpha: cfg.peft_alpha(),
            base_model_name_or_path: base_model_name_or_path.to_string(),
            task_type: task_type.to_string(),
            adapters,
            modules_to_save: Vec::new(),
        }
    }

    pub fn scaling(&self) -> f64 {
        self.lora_alpha / self.rank as f64
    }
}

/// Writes `dir/adapter_config.json` and `dir/adapter_model.safetensors` (creating `dir`). Not
/// atomic on its own: callers write it inside a directory being assembled by the engine's
/// `durable::write_dir_atomically` (a step's model directory holds its adapter in `adapter/`),
/// which syncs it and puts it in place as a whole.
pub fn save_peft_adapter(dir: &Path, adapter: &PeftAdapter) -> Result<()> {
    for ad in &adapter.adapters {
        check_pair(&ad.module, &ad.a, &ad.b, adapter.rank)?;
    }
    let target_modules: Vec<&str> = adapter.adapters.iter().map(|a| a.module.as_str()).collect();
    let modules_to_save: Vec<&str> =
        adapter.modules_to_save.iter().map(|(n, _)| n.strip_suffix(".weight").unwrap_or(n)).collect();
    let config = json!({
        "peft_type": "LORA",
        "task_type": adapter.task_type,
        "base_model_name_or_path": adapter.base_model_name_or_path,
        "r": adapter.rank,
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": 0.0,
        // PEFT matches a module when its name equals or ends with `.` + an entry; the full names
        // (`h.0.attn.c_attn`) select exactly the linears we adapted.
        "target_modules": target_modules,
        // GPT-2's Conv1D stores its weight (in, out): PEFT transposes the update when merging.
        "fan_in_fan_out": true,
        "bias": "none",
        "modules_to_save": if modules_to_save.is_empty() { Value::Null } else { json!(modules_to_save) },
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "inference_mode": true,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for ad in &adapter.adapters {
        let (a, b) = Adapter::param_names(&ad.module);
        tensors.push((format!("{PREFIX}{TRUNK}{a}"), ad.a.to_dtype(DType::F32)?));
        tensors.push((format!("{PREFIX}{TRUNK}{b}"), ad.b.to_dtype(DType::F32)?));
    }
    for (name, t) in &adapter.modules_to_save {
        tensors.push((format!("{PREFIX}{name}"), t.to_dtype(DType::F32)?));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let text = serde_json::to_string_pretty(&config)? + "\n";
    std::fs::write(dir.join(ADAPTER_CONFIG), text)
        .with_context(|| format!("writing {}", dir.join(ADAPTER_CONFIG).display()))?;
    // transformers and PEFT expect `format: pt` in the safetensors metadata.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(metadata), &dir.join(ADAPTER_WEIGHTS))
        .with_context(|| format!("writing {}", dir.join(ADAPTER_WEIGHTS).display()))
        .and_then(|()| durable::set_created_permissions(&dir.join(ADAPTER_WEIGHTS)))
        .with_context(|| format!("saving the LoRA adapter to {}", dir.display()))
}

/// Reads an adapter directory written by [`save_peft_adapter`] or by PEFT's `save_pretrained`.
pub fn load_peft_adapter(dir: &Path, device: &Device) -> Result<PeftAdapter> {
    let config_path = dir.join(ADAPTER_CONFIG);
    if !config_path.is_file() {
        bail!("{} has no {ADAPTER_CONFIG}: pass a PEFT adapter directory", dir.display());
    }
    let text =
        std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
    let cfg: Value = serde_json::from_str(&text)
        .map_err(|e| anyhow!("{} is not valid JSON ({e}): re-save the adapter", config_path.display()))?;
    let where_ = config_path.display();
    let peft_type = cfg.get("peft_type").and_then(Value::as_str).unwrap_or("");
    if peft_type != "LORA" {
        bail!("{where_} has peft_type {peft_type:?}: only LORA adapters are supported");
    }
    let rank = match cfg.get("r").and_then(Value::as_u64) {
        Some(r) if r > 0 => r as usize,
        _ => bail!("{where_} lacks a positive integer `r` (the LoRA rank)"),
    };
    // PEFT's LoraConfig default lora_alpha is 8.
    let lora_alpha = cfg.get("lora_alpha").map_or(Some(8.0), Value::as_f64);
    let Some(lora_alpha) = lora_alpha.filter(|a| a.is_finite() && *a > 0.0) else {
        bail!("{where_} has an invalid lora_alpha {:?}: it must be a positive number", cfg.get("lora_alpha"));
    };
    for flag in ["use_rslora", "use_dora"] {
        if cfg.get(flag).and_then(Value::as_bool).unwrap_or(false) {
            bail!("{where_} sets {flag}: only plain LoRA adapters (scaling lora_alpha / r) are supported");
        }
    }
    for pattern in ["rank_pattern", "alpha_pattern"] {
        if cfg.get(pattern).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
            bail!("{where_} has a non-empty {pattern}: per-module ranks and alphas are not supported");
        }
    }
    let bias = cfg.get("bias").and_then(Value::as_str).unwrap_or("none");
    if bias != "none" {
        bail!("{where_} has bias {bias:?}: adapters that train biases are not supported (use bias \"none\")");
    }

    let weights = dir.join(ADAPTER_WEIGHTS);
    if !weights.is_file() {
        let pickle = if dir.join("adapter_model.bin").is_file() {
            " (only a pickle adapter_model.bin, which is never read: re-save it with safe_serialization)"
        } else {
            ""
        };
        bail!("{} has no {ADAPTER_WEIGHTS}{pickle}", dir.display());
    }
    let bytes = std::fs::read(&weights).with_context(|| format!("cannot read {}", weights.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow!("{} is not a valid safetensors file ({e}): it may be truncated; re-save the adapter", weights.display())
    })?;
    let mut pairs: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    let mut modules_to_save = Vec::new();
    for (key, view) in st.tensors() {
        let t = view.load(device).with_context(|| format!("tensor {key} in {}", weights.display()))?;
        let t = t.to_dtype(DType::F32)?;
        let Some(rest) = key.strip_prefix(PREFIX) else {
            bail!("{} holds {key}, which is not a PEFT adapter tensor (base_model.model.*)", weights.display());
        };
        let module_of = |suffix: &str| rest.strip_suffix(suffix).map(|m| m.strip_prefix(TRUNK).unwrap_or(m));
        if let Some(module) = module_of(&format!(".{LORA_A}")) {
            pairs.entry(module.to_string()).or_default().0 = Some(t);
        } else if let Some(module) = module_of(&format!(".{LORA_B}")) {
            pairs.entry(module.to_string()).or_default().1 = Some(t);
        } else if rest.contains("lora_") {
            bail!("{} holds {key}: only lora_A/lora_B pairs on linear layers are supported", weights.display());
        } else {
            modules_to_save.push((rest.to_string(), t));
        }
    }
    let mut adapters = Vec::with_capacity(pairs.len());
    for (module, (a, b)) in pairs {
        let (Some(a), Some(b)) = (a, b) else {
            bail!("{} has only one of {module}'s lora_A and lora_B: the adapter is incomplete", weights.display());
        };
        check_pair(&module, &a, &b, rank).with_context(|| format!("in {}", weights.display()))?;
        adapters.push(Adapter { module, a, b });
    }
    if adapters.is_empty() {
        bail!("{} holds no lora_A/lora_B tensors", weights.display());
    }
    Ok(PeftAdapter {
        rank,
        lora_alpha,
        base_model_name_or_path: cfg.get("base_model_name_or_path").and_then(Value::as_str).unwrap_or("").into(),
        task_type: cfg.get("task_type").and_then(Value::as_str).unwrap_or("CAUSAL_LM").into(),
        adapters,
        modules_to_save,
    })
}

/// A (r, in) and B (out, r) with the adapter's rank.
fn check_pair(module: &str, a: &Tensor, b: &Tensor, rank: usize) -> Result<()> {
    match (a.dims(), b.dims()) {
        (&[ra, _], &[_, rb]) if ra == rank && rb == rank => Ok(()),
        (da, db) => bail!("adapter {module}: lora_A {da:?} and lora_B {db:?} do not have the shapes (r, in) and (out, r) with r = {rank}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init_adapter;

    fn sample() -> Result<PeftAdapter> {
        let d = Device::Cpu;
        let cfg = LoraConfig { dim: 2, alpha: Some(4.0), module_name: "attn".into() };
        let mut adapters = Vec::new();
        for (m, i, o) in [("h.0.attn.c_attn", 8, 24), ("h.0.attn.c_proj", 8, 8)] {
            let mut ad = init_adapter(m, i, o, 2, 5, &d)?;
            ad.b = Tensor::randn(0f32, 0.1, (o, 2), &d)?;
            adapters.push(ad);
        }
        let mut p = PeftAdapter::new(&cfg, "some/base", "SEQ_CLS", adapters);
        p.modules_to_save.push(("score.weight".into(), Tensor::randn(0f32, 1.0, (1, 8), &d)?));
        Ok(p)
    }

    #[test]
    fn peft_adapter_round_trips_with_peft_names() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("adapter");
        let p = sample()?;
        save_peft_adapter(&path, &p)?;
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(path.join(ADAPTER_CONFIG))?)?;
        assert_eq!(cfg["peft_type"], "LORA");
        assert_eq!(cfg["r"], 2);
        assert_eq!(cfg["lora_alpha"], 4.0);
        assert_eq!(cfg["fan_in_fan_out"], true);
        assert_eq!(cfg["target_modules"], json!(["h.0.attn.c_attn", "h.0.attn.c_proj"]));
        assert_eq!(cfg["modules_to_save"], json!(["score"]));
        let raw = safetensors::SafeTensors::deserialize(&std::fs::read(path.join(ADAPTER_WEIGHTS))?)?.names().len();
        assert_eq!(raw, 5);
        let st_bytes = std::fs::read(path.join(ADAPTER_WEIGHTS))?;
        let st = safetensors::SafeTensors::deserialize(&st_bytes)?;
        assert_eq!(st.tensor("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight")?.shape(), [2, 8]);
        assert_eq!(st.tensor("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight")?.shape(), [24, 2]);
        assert_eq!(st.tensor("base_model.model.score.weight")?.shape(), [1, 8]);

        let back = load_peft_adapter(&path, &Device::Cpu)?;
        assert_eq!((back.rank, back.lora_alpha, back.scaling()), (2, 4.0, 2.0));
        assert_eq!((back.task_type.as_str(), back.base_model_name_or_path.as_str()), ("SEQ_CLS", "some/base"));
        assert_eq!(back.adapters.len(), 2);
        for (x, y) in p.adapters.iter().zip(&back.adapters) {
            assert_eq!(x.module, y.module);
            for (s, t) in [(&x.a, &y.a), (&x.b, &y.b)] {
                assert_eq!((s - t)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{} is exact", x.module);
            }
        }
        assert_eq!(back.modules_to_save[0].0, "score.weight");
        // Saving again replaces the directory in place and leaves nothing behind.
        save_peft_adapter(&path, &back)?;
        assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);
        Ok(())
    }

    #[test]
    fn malformed_adapters_are_clear_errors() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("adapter");
        let err = |p: &Path| format!("{:#}", load_peft_adapter(p, &Device::Cpu).unwrap_err());
        assert!(err(&path).contains("has no adapter_config.json"));

        save_peft_adapter(&path, &sample()?)?;
        let weights = path.join(ADAPTER_WEIGHTS);
        let bytes = std::fs::read(&weights)?;
        std::fs::write(&weights, &bytes[..bytes.len() / 2])?;
        let e = err(&path);
        assert!(e.contains("not a valid safetensors file"), "{e}");
        std::fs::remove_file(&weights)?;
        std::fs::write(path.join("adapter_model.bin"), b"pickle")?;
        let e = err(&path);
        assert!(e.contains("pickle") && e.contains("never read"), "{e}");

        save_peft_adapter(&path, &sample()?)?;
        let config = path.join(ADAPTER_CONFIG);
        let original = std::fs::read_to_string(&config)?;
        for (from, to, want) in [
            ("\"use_dora\": false", "\"use_dora\": true", "use_dora"),
            ("\"peft_type\": \"LORA\"", "\"peft_type\": \"IA3\"", "only LORA"),
            ("\"r\": 2", "\"r\": 3", "r = 3"),
            ("\"bias\": \"none\"", "\"bias\": \"all\"", "bias"),
        ] {
            std::fs::write(&config, original.replace(from, to))?;
            let e = err(&path);
            assert!(e.contains(want), "{to}: {e}");
        }
        std::fs::write(&config, "{not json")?;
        assert!(err(&path).contains("not valid JSON"));
        Ok(())
    }

    #[test]
    fn the_rank_and_alpha_must_be_positive_and_alpha_defaults_to_pefts_8() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("adapter");
        save_peft_adapter(&path, &sample()?)?;
        let config = path.join(ADAPTER_CONFIG);
        let original = std::fs::read_to_string(&config)?;
        assert!(original.contains("\"r\": 2,") && original.contains("\"lora_alpha\": 4.0,"), "{original}");
        let load = |from: &str, to: &str| -> Result<PeftAdapter> {
            std::fs::write(&config, original.replace(from, to))?;
            load_peft_adapter(&path, &Device::Cpu)
        };
        for r in ["0", "-2", "2.5", "\"2\""] {
            let e = format!("{:#}", load("\"r\": 2,", &format!("\"r\": {r},")).unwrap_err());
            assert!(e.contains("lacks a positive integer `r`"), "r {r}: {e}");
        }
        for alpha in ["0.0", "-4.0", "\"4\"", "null"] {
            let e = format!("{:#}", load("\"lora_alpha\": 4.0,", &format!("\"lora_alpha\": {alpha},")).unwrap_err());
            assert!(e.contains("invalid lora_alpha"), "lora_alpha {alpha}: {e}");
        }
        let tiny = load("\"lora_alpha\": 4.0,", "\"lora_alpha\": 1e-300,")?;
        assert_eq!((tiny.rank, tiny.lora_alpha), (2, 1e-300));
        let absent = load("\"lora_alpha\": 4.0,", "")?;
        assert_eq!((absent.lora_alpha, absent.scaling()), (8.0, 4.0), "PEFT's LoraConfig default lora_alpha is 8");
        Ok(())
    }

    #[test]
    fn weights_that_are_not_a_whole_lora_adapter_are_clear_errors() -> Result<()> {
        let d = Device::Cpu;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("adapter");
        save_peft_adapter(&path, &sample()?)?;
        let name = |module: &str, suffix: &str| format!("{PREFIX}{TRUNK}{module}.{suffix}");
        let zeros = |shape: (usize, usize)| Tensor::zeros(shape, DType::F32, &d);
        let one =
            |suffix: &str, shape| Ok::<_, candle_core::Error>(vec![(name("h.0.attn.c_proj", suffix), zeros(shape)?)]);
        let pair = |a, b| Ok::<_, candle_core::Error>([one(LORA_A, a)?, one(LORA_B, b)?].concat());
        let only_one = "only one of h.0.attn.c_proj's lora_A and lora_B";
        let shapes = "do not have the shapes (r, in) and (out, r) with r = 2";
        // Each case rewrites the weights beside a valid config (r 2) and names what must be said.
        let cases: Vec<(Vec<(String, Tensor)>, &str)> = vec![
            (one(LORA_A, (2, 8))?, only_one),
            (one(LORA_B, (8, 2))?, only_one),
            // Only one factor's rank is wrong: both must have the adapter's rank.
            (pair((2, 8), (8, 3))?, shapes),
            (pair((3, 8), (8, 2))?, shapes),
            (vec![("transformer.h.0.attn.c_proj.weight".into(), zeros((8, 8))?)], "not a PEFT adapter tensor"),
            (vec![(name("wte", "lora_embedding_A"), zeros((2, 8))?)], "only lora_A/lora_B pairs on linear layers"),
            (vec![(format!("{PREFIX}score.weight"), zeros((1, 8))?)], "holds no lora_A/lora_B tensors"),
        ];
        for (tensors, want) in cases {
            safetensors::serialize_to_file(tensors, None, &path.join(ADAPTER_WEIGHTS))?;
            let e = format!("{:#}", load_peft_adapter(&path, &d).unwrap_err());
            assert!(e.contains(want), "want {want:?}: {e}");
        }
        // PEFT on a bare GPT2Model names its blocks without `transformer.`: they read the same.
        let bare = vec![
            (format!("{PREFIX}h.0.attn.c_proj.{LORA_A}"), zeros((2, 8))?),
            (format!("{PREFIX}h.0.attn.c_proj.{LORA_B}"), zeros((8, 2))?),
        ];
        safetensors::serialize_to_file(bare, None, &path.join(ADAPTER_WEIGHTS))?;
        let read = load_peft_adapter(&path, &d)?;
        assert_eq!(read.adapters.iter().map(|a| a.module.as_str()).collect::<Vec<_>>(), ["h.0.attn.c_proj"]);
        Ok(())
    }
}
