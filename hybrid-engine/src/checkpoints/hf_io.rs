//! Hugging Face model directories: resolve a local path, a checkpoint root or a hub id to a
//! directory; read `config.json` + `model.safetensors` (or a sharded index); write the same
//! layout so that `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads it.
//!
//! Only safetensors and JSON are ever parsed (never pickle), defensively: a truncated or corrupt
//! file is one error line naming it.

use crate::model::config::ModelConfig;
use crate::model::gpt2::Gpt2Config;
use crate::model::params::ParamStore;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

pub const CONFIG: &str = "config.json";
pub const WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
pub const TOKENIZER: &str = "tokenizer.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
/// File in a checkpoint root naming the newest complete checkpoint (Megatron's
/// `latest_checkpointed_iteration.txt`).
pub const LATEST: &str = "latest";

/// A model directory read from disk: its config, the GPT-2 trunk tensors (names without the
/// `transformer.` prefix) and any other tensors (a reward head's `score.weight`, say).
pub struct ModelFiles {
    pub dir: PathBuf,
    pub config: Gpt2Config,
    pub tensors: HashMap<String, Tensor>,
    pub extra_tensors: HashMap<String, Tensor>,
}

/// Turns what the user typed into a model directory: a directory with config.json, a checkpoint
/// root holding a `latest` pointer, or a hub id (`gpt2`, `openai-community/gpt2`) looked up in the
/// HF cache first and downloaded when online.
pub fn resolve_model_dir(name_or_path: &str) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.file_name().is_some() {
        // A save killed between its two renames leaves the directory under `.old-*`.
        crate::durable::recover_leftovers(path)?;
    }
    if path.is_dir() {
        if path.join(CONFIG).is_file() {
            return Ok(path.to_path_buf());
        }
        if path.join(LATEST).is_file() {
            return latest_checkpoint(path);
        }
        bail!(
            "{} has neither config.json nor a `latest` checkpoint pointer: pass a Hugging Face model directory",
            path.display()
        );
    }
    if path.exists() {
        bail!(
            "{} is not a directory: pass a Hugging Face model directory (config.json + model.safetensors)",
            path.display()
        );
    }
    let looks_like_id = looks_like_model_id(name_or_path);
    if !looks_like_id {
        bail!("model directory {name_or_path} does not exist");
    }
    hub_snapshot(name_or_path)
}

/// The checkpoint directory a root's `latest` pointer names.
pub fn latest_checkpoint(root: &Path) -> Result<PathBuf> {
    let dir = latest_pointer(root)?;
    if !dir.join(CONFIG).is_file() {
        bail!("{} names {}, which is not a complete checkpoint directory", root.join(LATEST).display(), dir.display());
    }
    Ok(dir)
}

/// `name` or `org/name` with the hub's characters, each part a plain name: no `..`, no leading
/// `.` or `-`, so an id can never name a path outside the hub cache.
fn looks_like_model_id(id: &str) -> bool {
    id.matches('/').count() <= 1
        && id.split('/').all(|part| {
            !part.is_empty()
                && !part.starts_with(['.', '-'])
                && !part.contains("..")
                && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// The directory a root's `latest` pointer names, checked to be a plain name inside `root`.
pub fn latest_pointer(root: &Path) -> Result<PathBuf> {
    let pointer = root.join(LATEST);
    crate::durable::recover_leftovers(&pointer)?;
    let name = std::fs::read_to_string(&pointer).with_context(|| format!("cannot read {}", pointer.display()))?;
    let name = name.trim();
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') || name.contains(char::is_control) {
        bail!(
            "{} is corrupt (it holds {name:?}); point it at a checkpoint directory name such as iter_0000100",
            pointer.display()
        );
    }
    let dir = root.join(name);
    crate::durable::recover_leftovers(&dir)?;
    Ok(dir)
}

/// A hub model's snapshot directory with its config, weights and (when present) tokenizer.
fn hub_snapshot(id: &str) -> Result<PathBuf> {
    let cache = hub_cache();
    let cached = cache.model(id.to_string());
    let cached_files = |files: &[&str]| -> Option<PathBuf> {
        let paths: Option<Vec<PathBuf>> = files.iter().map(|f| cached.get(f)).collect();
        paths.and_then(|p| p.first().and_then(|p| p.parent().map(Path::to_path_buf)))
    };
    if let Some(dir) = cached_files(&[CONFIG, WEIGHTS]) {
        return Ok(dir);
    }
    if let Some(dir) = cached_files(&[CONFIG, WEIGHTS_INDEX]) {
        let shards = shard_files(&dir.join(WEIGHTS_INDEX))?;
        if shards.iter().all(|s| cached.get(s).is_some()) {
            return Ok(dir);
        }
    }
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let hint = format!(
        "model {id:?} is not a local directory and is not in the Hugging Face cache ({})",
        cache.path().display()
    );
    if offline {
        bail!("{hint}, and HF_HUB_OFFLINE is set: download it while online or pass a local directory");
    }
    let on_terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
        .with_progress(on_terminal)
        .build()
        .map_err(|e| anyhow!("{hint}, and the hub client failed to start: {e}"))?;
    // On a terminal hf-hub draws a bar per file; a log gets a line.
    if !on_terminal {
        eprintln!("downloading model {id} from the Hugging Face hub into {}", cache.path().display());
    }
    let repo = api.model(id.to_string());
    let config = repo.get(CONFIG).map_err(|e| {
        anyhow!("{hint}, and downloading it failed ({e}): check the id and your network, or pass a local directory")
    })?;
    match repo.get(WEIGHTS) {
        Ok(_) => {}
        Err(_) => {
            let index = repo.get(WEIGHTS_INDEX).map_err(|_| {
                anyhow!("hub model {id:?} has no model.safetensors (only pickle weights?): we read safetensors only")
            })?;
            for shard in shard_files(&index)? {
                repo.get(&shard).map_err(|e| anyhow!("downloading {shard} of {id:?} failed: {e}"))?;
            }
        }
    }
    let _ = repo.get(TOKENIZER); // optional: the embedded GPT-2 tokenizer is the fallback
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// The hub cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, as the
/// Python `huggingface_hub` resolves it (hf-hub 0.4 only reads `HF_HOME`).
fn hub_cache() -> hf_hub::Cache {
    match std::env::var_os("HF_HUB_CACHE") {
        Some(dir) => hf_hub::Cache::new(dir.into()),
        None => hf_hub::Cache::from_env(),
    }
}

/// The shard file names listed in a `model.safetensors.index.json`.
pub(crate) fn shard_files(index: &Path) -> Result<BTreeSet<String>> {
    let text = std::fs::read_to_string(index).with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{} is not valid JSON: {e}", index.display()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| anyhow!("{} has no weight_map object", index.display()))?;
    map.values()
        .map(|v| match v.as_str() {
            Some(s) if !s.contains(['/', '\\']) && !s.starts_with('.') => Ok(s.to_string()),
            _ => bail!("{} lists an invalid shard file name {v}", index.display()),
        })
        .collect()
}

/// Reads every tensor of one safetensors file.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        anyhow!(
            "{} is not a valid safetensors file ({e}): it may be truncated or corrupt; re-download or re-save it",
            path.display()
        )
    })?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let t = view.load(device).with_context(|| format!("tensor {name} in {}", path.display()))?;
            Ok((name, t))
        })
        .collect()
}

/// Reads a model directory: config.json and the weights, single-file or sharded.
pub fn load_model_dir(dir: &Path, device: &Device) -> Result<ModelFiles> {
    if dir.file_name().is_some() {
        crate::durable::recover_leftovers(dir)?;
    }
    let config = read_config(&dir.join(CONFIG))?;
    let raw = if dir.join(WEIGHTS).is_file() {
        read_safetensors(&dir.join(WEIGHTS), device)?
    } else if dir.join(WEIGHTS_INDEX).is_file() {
        let mut all = HashMap::new();
        for shard in shard_files(&dir.join(WEIGHTS_INDEX))? {
            all.extend(read_safetensors(&dir.join(&shard), device)?);
        }
        all
    } else {
        bail!(
            "{} has no model.safetensors or model.safetensors.index.json (pickle .bin weights are not read)",
            dir.display()
        );
    };
    let (tensors, extra_tensors) = split_hf_names(raw);
    let expected: BTreeSet<String> =
        crate::model::params::parameter_shapes(&config).into_iter().map(|(n, _)| n).collect();
    if let Some(missing) = expected.iter().find(|n| !tensors.contains_key(*n)) {
        bail!("{} lacks tensor {missing}: it is not a complete GPT-2 checkpoint", dir.display());
    }
    Ok(ModelFiles { dir: dir.to_path_buf(), config, tensors, extra_tensors })
}

/// Separates GPT-2 trunk tensors (stripped of HF's optional `transformer.` prefix) from
/// everything else, dropping what is no parameter ([`is_not_a_parameter`]).
fn split_hf_names(raw: HashMap<String, Tensor>) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let mut trunk = HashMap::new();
    let mut extra = HashMap::new();
    for (name, t) in raw {
        let short = name.strip_prefix("transformer.").unwrap_or(&name);
        if is_not_a_parameter(&name) {
            continue;
        }
        if crate::model::params::is_trunk_name(short) {
            trunk.insert(short.to_string(), t);
        } else {
            extra.insert(name, t);
        }
    }
    (trunk, extra)
}

/// Whether a tensor of a HF GPT-2 file (by its name in the file) is no parameter of ours: the
/// tied `lm_head.weight` and the causal-mask buffers (`h.N.attn.bias`, `h.N.attn.masked_bias`)
/// that old checkpoints carry.
pub(crate) fn is_not_a_parameter(name: &str) -> bool {
    let short = name.strip_prefix("transformer.").unwrap_or(name);
    let buffer = short.starts_with("h.") && (short.ends_with(".attn.bias") || short.ends_with(".attn.masked_bias"));
    buffer || name == "lm_head.weight"
}

/// Writes config.json, model.safetensors (trunk under `transformer.*` names, `format: pt` metadata, which
/// transformers requires) and generation_config.json into `dir` (which must exist). The caller
/// writes tokenizer.json and makes the directory appear atomically. LoRA adapters are merged
/// into their linears' weights, never written as tensors of their own.
pub fn write_model_files(
    dir: &Path,
    config: &Gpt2Config,
    params: &ParamStore,
    extra: &[(&str, &Tensor)],
) -> Result<()> {
    let merged = params.merged()?;
    let params = &merged;
    write_config_files(dir, config)?;
    // HF nests the trunk under `transformer.`; heads (`score.weight`) sit at the top level.
    let mut tensors: Vec<(String, Tensor)> = params.iter().map(|(n, v)| (hf_name(n), v.as_tensor().clone())).collect();
    tensors.extend(extra.iter().map(|(n, t)| (n.to_string(), (*t).clone())));
    safetensors::serialize_to_file(tensors, Some(weights_metadata()), &dir.join(WEIGHTS))
        .with_context(|| format!("writing {}", dir.join(WEIGHTS).display()))?;
    crate::durable::set_created_permissions(&dir.join(WEIGHTS))
}

/// A parameter's name in a HF directory: the trunk under `transformer.`, heads (`score.weight`)
/// at the top level.
pub fn hf_name(name: &str) -> String {
    if crate::model::params::is_trunk_name(name) {
        format!("transformer.{name}")
    } else {
        name.to_string()
    }
}

/// model.safetensors' metadata: `format: pt`, which transformers requires.
pub fn weights_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// Writes config.json and generation_config.json of a model with `config` into `dir`.
pub fn write_config_files(dir: &Path, config: &Gpt2Config) -> Result<()> {
    let mut json = serde_json::to_value(config)?;
    let obj = json.as_object_mut().expect("config serialises to an object");
    obj.insert("model_type".into(), "gpt2".into());
    obj.entry("architectures").or_insert_with(|| serde_json::json!(["GPT2LMHeadModel"]));
    // Our master weights are f32; transformers 5 reads `dtype` (4.x `torch_dtype`, default f32).
    obj.remove("torch_dtype");
    obj.insert("dtype".into(), "float32".into());
    write_json(&dir.join(CONFIG), &json)?;
    let eos = config.eos_token_id.unwrap_or(crate::model::gpt2::GPT2_EOS);
    let generation = serde_json::json!({
        "bos_token_id": config.bos_token_id.unwrap_or(eos),
        "eos_token_id": eos,
        "pad_token_id": eos,
    });
    write_json(&dir.join(GENERATION_CONFIG), &generation)
}

pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// Reads and validates a config.json (by its `model_type`: [`ModelConfig::from_json`]).
pub fn read_config(path: &std::path::Path) -> anyhow::Result<Gpt2Config> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    match ModelConfig::from_json(&text).with_context(|| format!("{}", path.display()))? {
        ModelConfig::Gpt2(cfg) => Ok(cfg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights are as readable as the config beside them (the umask decides for both), not
    /// 0600 as the safetensors writer's temporary file is made.
    #[test]
    fn the_weights_get_the_permissions_of_their_siblings() -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir()?;
        let cfg = Gpt2Config::tiny().with_shape(Some(1), Some(8), Some(2), Some(8));
        write_model_files(dir.path(), &cfg, &ParamStore::init(&cfg, 0, &Device::Cpu)?, &[])?;
        let mode = |name: &str| std::fs::metadata(dir.path().join(name)).map(|m| m.permissions().mode() & 0o777);
        assert_eq!(mode(WEIGHTS)?, mode(CONFIG)?);
        Ok(())
    }

    #[test]
    fn truncated_safetensors_is_a_clear_error() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 0, &Device::Cpu)?;
        write_model_files(dir.path(), &cfg, &params, &[])?;
        let back = load_model_dir(dir.path(), &Device::Cpu)?;
        assert_eq!(back.config, {
            let mut c = cfg.clone();
            c.extra = back.config.extra.clone();
            c
        });
        let w = back.tensors["h.0.mlp.c_fc.weight"].sub(params.get("h.0.mlp.c_fc.weight").unwrap())?;
        assert_eq!(w.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "round trip is exact");

        let path = dir.path().join(WEIGHTS);
        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() / 2])?;
        let err = format!("{:#}", load_model_dir(dir.path(), &Device::Cpu).err().expect("must fail"));
        assert!(err.contains("not a valid safetensors file") && err.contains("truncated"), "{err}");
        Ok(())
    }

    #[test]
    fn sharded_checkpoints_load_like_single_files() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let cfg = Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        let params = ParamStore::init(&cfg, 3, &Device::Cpu)?;
        write_model_files(dir.path(), &cfg, &params, &[])?;
        let single = load_model_dir(dir.path(), &Device::Cpu)?;
        // Re-save as two shards with an index, the way transformers shards large models.
        let all = read_safetensors(&dir.path().join(WEIGHTS), &Device::Cpu)?;
        std::fs::remove_file(dir.path().join(WEIGHTS))?;
        let mut shards: [HashMap<String, Tensor>; 2] = Default::default();
        let mut weight_map = serde_json::Map::new();
        for (name, t) in all {
            let i = usize::from(name.contains(".h.1.") || name.contains("ln_f"));
            let file = format!("model-0000{}-of-00002.safetensors", i + 1);
            weight_map.insert(name.clone(), file.into());
            shards[i].insert(name, t);
        }
        for (i, shard) in shards.iter().enumerate() {
            candle_core::safetensors::save(
                shard,
                dir.path().join(format!("model-0000{}-of-00002.safetensors", i + 1)),
            )?;
        }
        write_json(&dir.path().join(WEIGHTS_INDEX), &serde_json::json!({"metadata": {}, "weight_map": weight_map}))?;
        let sharded = load_model_dir(dir.path(), &Device::Cpu)?;
        assert_eq!(sharded.tensors.len(), single.tensors.len());
        for (name, t) in &single.tensors {
            let d = t.sub(&sharded.tensors[name])?.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "{name}");
        }
        Ok(())
    }

    #[test]
    fn hf_names_drop_prefix_buffers_and_tied_head() -> Result<()> {
        let t = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)?;
        let raw: HashMap<String, Tensor> = [
            "transformer.h.0.attn.bias",
            "h.1.attn.masked_bias",
            "transformer.h.0.attn.c_attn.bias",
            "lm_head.weight",
            "wte.weight",
            "score.weight",
        ]
        .into_iter()
        .map(|n| (n.to_string(), t.clone()))
        .collect();
        let (trunk, extra) = split_hf_names(raw);
        let mut names: Vec<_> = trunk.keys().cloned().collect();
        names.sort();
        assert_eq!(names, ["h.0.attn.c_attn.bias", "wte.weight"]);
        assert_eq!(extra.keys().collect::<Vec<_>>(), ["score.weight"]);
        Ok(())
    }

    /// One test for everything that reads the hub environment variables (tests run in threads).
    #[test]
    fn hub_ids_resolve_from_the_cache_and_offline_misses_are_clear_errors() -> Result<()> {
        let err = format!("{:#}", resolve_model_dir("/definitely/not/here").unwrap_err());
        assert!(err.contains("does not exist"), "{err}");

        // A cache laid out as huggingface_hub lays it out: refs/main -> snapshots/<commit>/.
        let home = tempfile::tempdir()?;
        let repo = home.path().join("hub/models--some-org--cached-model");
        let snapshot = repo.join("snapshots/0123abcd");
        std::fs::create_dir_all(&snapshot)?;
        std::fs::create_dir_all(repo.join("refs"))?;
        std::fs::write(repo.join("refs/main"), "0123abcd")?;
        let cfg = Gpt2Config { n_layer: 1, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 16, ..Gpt2Config::tiny() };
        write_model_files(&snapshot, &cfg, &ParamStore::init(&cfg, 0, &Device::Cpu)?, &[])?;
        std::env::remove_var("HF_HUB_CACHE");
        std::env::set_var("HF_HOME", home.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        assert_eq!(resolve_model_dir("some-org/cached-model")?, snapshot);
        assert_eq!(load_model_dir(&snapshot, &Device::Cpu)?.config.n_embd, 8);
        std::env::set_var("HF_HUB_CACHE", home.path().join("hub"));
        assert_eq!(resolve_model_dir("some-org/cached-model")?, snapshot, "HF_HUB_CACHE is honoured");

        let err = format!("{:#}", resolve_model_dir("some-org/not-cached-model").unwrap_err());
        assert!(err.contains("not in the Hugging Face cache") && err.contains("HF_HUB_OFFLINE"), "{err}");
        Ok(())
    }

    #[test]
    fn model_ids_crafted_to_escape_the_hub_cache_are_not_ids() {
        for ok in ["gpt2", "openai-community/gpt2", "org/name.v2"] {
            assert!(looks_like_model_id(ok), "{ok}");
        }
        for bad in ["../x", "org/..", "org/../../x", "/etc/passwd", "..", "org/.hidden", "-flag", "a/b/c", "org/", ""] {
            assert!(!looks_like_model_id(bad), "{bad}");
            let err = resolve_model_dir(bad).unwrap_err().to_string();
            assert!(!err.contains('\n'), "{bad}: {err}");
        }
    }
}
