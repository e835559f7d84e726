//! A model directory's weights for a model sharded at rest (ZeRO stage 3), never held whole:
//! [`ModelSlices`] memory-maps the safetensors files and reads a range of a tensor (a rank's
//! shard of it; only the pages that hold it come from disk), [`StreamedSafetensors`] writes a
//! consolidated `model.safetensors` one tensor at a time as the units are gathered.

use crate::checkpoints::hf_io::{self, CONFIG, WEIGHTS, WEIGHTS_INDEX};
use crate::model::gpt2::Gpt2Config;
use crate::model::params::{is_trunk_name, parameter_shapes};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::Tensor;
use safetensors::Dtype;
use std::collections::HashMap;
use std::io::{Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The GPT-2 trunk of a model directory (HF's or ours, single-file or sharded), memory-mapped.
pub struct ModelSlices {
    pub dir: PathBuf,
    pub config: Gpt2Config,
    files: MmapedSafetensors,
    /// Trunk parameter name (without HF's `transformer.`) -> the name in the files.
    stored: HashMap<String, String>,
}

impl ModelSlices {
    /// Opens `dir`'s config.json and weights, checking that every trunk tensor is there with
    /// the shape the config implies.
    pub fn open(dir: &Path) -> Result<Self> {
        if dir.file_name().is_some() {
            crate::durable::recover_leftovers(dir)?;
        }
        let config = hf_io::read_config(&dir.join(CONFIG))?;
        let paths: Vec<PathBuf> = if dir.join(WEIGHTS).is_file() {
            vec![dir.join(WEIGHTS)]
        } else if dir.join(WEIGHTS_INDEX).is_file() {
            hf_io::shard_files(&dir.join(WEIGHTS_INDEX))?.into_iter().map(|f| dir.join(f)).collect()
        } else {
            bail!("{} has no model.safetensors or model.safetensors.index.json", dir.display());
        };
        // SAFETY: a mapped file must not change while mapped. Model directories and checkpoints
        // are written into a temporary directory and renamed into place (crate `durable`), never
        // rewritten where they are.
        let files = unsafe { MmapedSafetensors::multi(&paths) }.map_err(|e| {
            anyhow!("{} is not a valid safetensors model ({e}): re-download or re-save it", dir.display())
        })?;
        let mut stored = HashMap::new();
        for (name, _) in files.tensors() {
            let short = name.strip_prefix("transformer.").unwrap_or(&name);
            if is_trunk_name(short) {
                stored.insert(short.to_string(), name.clone());
            }
        }
        for (name, shape) in parameter_shapes(&config) {
            let file_name = stored.get(&name).ok_or_else(|| {
                anyhow!("{} lacks tensor {name}: it is not a complete GPT-2 checkpoint", dir.display())
            })?;
            let view = files.get(file_name)?;
            if view.shape() != shape.as_slice() {
                bail!("tensor {name} has shape {:?} but config.json implies {shape:?}", view.shape());
            }
        }
        Ok(Self { dir: dir.to_path_buf(), config, files, stored })
    }

    /// The tensors beside the trunk (a reward model's `score.weight`), whole, by their names in
    /// the files (the tied `lm_head.weight` and old causal-mask buffers left out).
    pub fn heads(&self) -> Result<HashMap<String, Tensor>> {
        let mut heads = HashMap::new();
        for (name, view) in self.files.tensors() {
            let short = name.strip_prefix("transformer.").unwrap_or(&name);
            if !is_trunk_name(short) && !hf_io::is_not_a_parameter(&name) {
                heads.insert(name.clone(), candle_core::safetensors::Load::load(&view, &candle_core::Device::Cpu)?);
            }
        }
        Ok(heads)
    }

    /// The values of parameter `name` (the trunk's, or one beside it such as a LoRA adapter of
    /// a checkpoint) in `range` of its flat indices, as f32 (from f32, f16 or bf16).
    pub fn read(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let stored = self.stored.get(name).map_or(name, String::as_str);
        let view = self.files.get(stored).map_err(|_| anyhow!("{} lacks tensor {name}", self.dir.display()))?;
        let n: usize = view.shape().iter().product();
        if range.end > n {
            bail!("internal error: values {range:?} of {name}, which has {n}");
        }
        let width = match view.dtype() {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => bail!("tensor {name} in {} is {other:?}; GPT-2 weights are f32, f16 or bf16", self.dir.display()),
        };
        let bytes = &view.data()[range.start * width..range.end * width];
        let values = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            _ => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        };
        release_pages(bytes);
        Ok(values)
    }
}

/// Drops the mapped pages of `bytes`, read and copied out, from this process's resident set:
/// they stay in the page cache (another read faults them back in, from the unchanged file). A
/// rank that reads a model's worth of slices would otherwise count the whole file in its RSS.
fn release_pages(bytes: &[u8]) {
    #[cfg(unix)]
    {
        // SAFETY: the range lies in a read-only mapping of a file that is never rewritten in
        // place (see `ModelSlices::open`), rounded out to whole pages of that mapping; dropping
        // its pages changes no byte any reader sees.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE).max(1) as usize;
            let pages = whole_pages(bytes.as_ptr() as usize, bytes.len(), page);
            libc::madvise(pages.start as *mut libc::c_void, pages.len(), libc::MADV_DONTNEED);
        }
    }
}

/// The addresses of the whole pages (of `page` bytes) that hold `len` bytes from `start`: no
/// page more, none less.
fn whole_pages(start: usize, len: usize, page: usize) -> Range<usize> {
    start / page * page..(start + len).div_ceil(page) * page
}

/// A safetensors file of f32 tensors whose names and shapes are known before their values: the
/// header is written first, each tensor's values at its place as they come, in any order.
pub struct StreamedSafetensors {
    path: PathBuf,
    file: std::fs::File,
    /// Name -> (offset of its values from the file's start, number of values, written yet).
    places: HashMap<String, (u64, usize, bool)>,
}

impl StreamedSafetensors {
    /// Creates `path` for `tensors` (name, shape), laid out in that order, with `metadata`.
    pub fn create(path: &Path, tensors: &[(String, Vec<usize>)], metadata: &HashMap<String, String>) -> Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
        let mut offset = 0usize;
        let mut places = HashMap::new();
        for (name, shape) in tensors {
            let n: usize = shape.iter().product();
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}),
            );
            places.insert(name.clone(), (offset as u64, n, false));
            offset += 4 * n;
        }
        let mut text = serde_json::to_string(&header)?;
        // The data starts 8-byte aligned, as safetensors' own writer aligns it.
        text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
        let start = 8 + text.len() as u64;
        let mut file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        file.write_all(&(text.len() as u64).to_le_bytes())?;
        file.write_all(text.as_bytes())?;
        file.set_len(start + offset as u64)?;
        for place in places.values_mut() {
            place.0 += start;
        }
        Ok(Self { path: path.to_path_buf(), file, places })
    }

    /// Writes tensor `name`'s values (any dtype, converted to f32).
    pub fn write(&mut self, name: &str, values: &Tensor) -> Result<()> {
        let what = || format!("writing {name} into {}", self.path.display());
        let Some((at, n, written)) = self.places.get_mut(name) else {
            bail!("internal error: {} has no place", what())
        };
        if values.elem_count() != *n || *written {
            bail!(
                "internal error: {}: {} values for {n} places (written before: {written})",
                what(),
                values.elem_count()
            );
        }
        let values: Vec<f32> = values.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.file.seek(SeekFrom::Start(*at)).with_context(what)?;
        self.file.write_all(&bytes).with_context(what)?;
        *written = true;
        Ok(())
    }

    /// Checks that every tensor was written and flushes the file to disk.
    pub fn finish(self) -> Result<()> {
        if let Some((name, _)) = self.places.iter().find(|(_, (_, _, written))| !written) {
            bail!("internal error: {} lacks tensor {name}", self.path.display());
        }
        self.file.sync_all().with_context(|| format!("flushing {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::on_groups;
    use crate::model::params::ParamStore;
    use crate::training::zero3::ShardedModel;
    use candle_core::{DType, Device};
    use std::sync::Arc;

    fn small() -> Gpt2Config {
        Gpt2Config { n_layer: 2, n_embd: 8, n_head: 2, n_positions: 8, vocab_size: 20, ..Gpt2Config::tiny() }
    }

    /// Built sharded with a score head and LoRA adapters on a frozen trunk beside it, a rank's
    /// shard, its units and what it trains are those of the whole model with the same head and
    /// adapters cut into shards (2 and 3 ranks).
    #[test]
    fn sharded_construction_with_lora_and_a_head_gives_the_whole_models_shards() -> Result<()> {
        let cfg = small();
        let lora = lora::LoraConfig { dim: 2, alpha: None, module_name: "h.".into() };
        let head = Tensor::arange(0f32, 8.0, &Device::Cpu)?.reshape((1, 8))?;
        let mut whole = ParamStore::init(&cfg, 7, &Device::Cpu)?;
        whole.push(crate::model::reward_model::SCORE_WEIGHT, &head)?;
        whole.add_lora(&cfg, &lora, 7)?;
        whole.freeze_trunk();
        let (_, adapters) = crate::model::params::lora_adapters(&cfg, &lora, 7, &Device::Cpu)?;
        let beside =
            crate::training::zero3::Beside::heads(vec![(crate::model::reward_model::SCORE_WEIGHT.into(), head)])
                .with_lora(adapters, lora.scaling(), true);
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let group = Arc::new(group);
                let built = ShardedModel::init(group.clone(), &cfg, 7, &beside, DType::F32, &Device::Cpu)?;
                let cut = ShardedModel::new(group.clone(), &cfg, &whole, DType::F32)?;
                assert_eq!(built.shard_values()?, cut.shard_values()?, "rank {} of {world}", group.rank());
                assert_eq!(built.trained_names(), cut.trained_names());
                assert!(
                    built.has_lora()
                        && built.trained_names().iter().all(|n| !n.starts_with("h.") || n.contains("lora_"))
                );
                Ok(())
            });
            results.into_iter().collect::<Result<Vec<()>>>()?;
        }
        Ok(())
    }

    /// A LoRA model (adapters on a frozen trunk, a score head) sharded over 2 and 3 ranks, saved
    /// block by block: the first rank visits exactly the whole model's merged parameters (each
    /// adapter fused into its linear, bit for bit, in the model's order, no adapter itself), and
    /// gathers exactly its trained ones (a PEFT adapter's tensors: adapters and head).
    #[test]
    fn lora_models_saved_block_by_block_are_the_whole_models_merged_weights() -> Result<()> {
        let cfg = small();
        let lora = lora::LoraConfig { dim: 2, alpha: None, module_name: "h.".into() };
        let mut whole = ParamStore::init(&cfg, 7, &Device::Cpu)?;
        whole.push(crate::model::reward_model::SCORE_WEIGHT, &Tensor::ones((1, 8), DType::F32, &Device::Cpu)?)?;
        whole.add_lora(&cfg, &lora, 7)?;
        whole.freeze_trunk();
        // B starts at zero (the adapted linear is the original): give it values, or fusing is
        // not tested.
        for (name, var) in whole.iter() {
            if name.ends_with(".lora_B.weight") {
                var.set(&Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu)?)?;
            }
        }
        let merged = whole.merged()?;
        let want: Vec<(String, Vec<f32>)> = merged
            .iter()
            .map(|(n, v)| Ok((n.to_string(), v.as_tensor().flatten_all()?.to_vec1()?)))
            .collect::<Result<_>>()?;
        let trained = whole.trainable();
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let group = Arc::new(group);
                let model = ShardedModel::new(group.clone(), &cfg, &whole, DType::F32)?;
                let mut got = Vec::new();
                model.visit_gathered_merged(None, |name, t| {
                    got.push((name.to_string(), t.flatten_all()?.to_vec1::<f32>()?));
                    Ok(())
                })?;
                let shapes: Vec<&str> = model.merged_shapes().map(|(n, _)| n).collect();
                assert_eq!(shapes, want.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>());
                let gathered = model.gather_trained()?;
                if !group.is_first() {
                    assert!(got.is_empty() && gathered.is_none());
                    return Ok(());
                }
                // Visited block by block, so in another order than the file's: compare by name.
                got.sort_by(|a, b| a.0.cmp(&b.0));
                let mut sorted = want.clone();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                assert_eq!(got, sorted, "{world} ranks");
                let gathered = gathered.expect("the first rank gathers the trained parameters");
                assert_eq!(gathered.names, trained.names, "{world} ranks");
                for ((name, g), (_, w)) in gathered.iter().zip(trained.iter()) {
                    let (g, w) = (
                        g.as_tensor().flatten_all()?.to_vec1::<f32>()?,
                        w.as_tensor().flatten_all()?.to_vec1::<f32>()?,
                    );
                    assert_eq!(g, w, "{name} on {world} ranks");
                }
                assert_eq!(gathered.lora_scaling(), whole.lora_scaling());
                Ok(())
            });
            results.into_iter().collect::<Result<Vec<()>>>()?;
        }
        Ok(())
    }

    /// Built sharded from the initial draws (2 and 3 ranks), each rank's shard is the one cut
    /// from the whole one-rank model; written unit by unit, the consolidated file holds the whole
    /// model exactly; read back by slices on another world size, the shards are again those of
    /// the whole model.
    #[test]
    fn sharded_construction_and_streamed_saves_give_the_whole_models_values() -> Result<()> {
        let cfg = small();
        let whole = ParamStore::init(&cfg, 7, &Device::Cpu)?;
        let dir = tempfile::tempdir()?;
        let saved = dir.path().join("saved");
        std::fs::create_dir(&saved)?;
        for world in [2, 3] {
            let results = on_groups(world, |group| {
                let group = Arc::new(group);
                let built = ShardedModel::init(group.clone(), &cfg, 7, &Default::default(), DType::F32, &Device::Cpu)?;
                let cut = ShardedModel::new(group.clone(), &cfg, &whole, DType::F32)?;
                assert_eq!(built.shard_values()?, cut.shard_values()?, "rank {} of {world}", group.rank());
                if world == 3 {
                    let mut file = group.is_first().then(|| {
                        let tensors: Vec<(String, Vec<usize>)> =
                            built.parameter_shapes().map(|(n, s)| (hf_io::hf_name(n), s.dims().to_vec())).collect();
                        StreamedSafetensors::create(&saved.join(WEIGHTS), &tensors, &hf_io::weights_metadata()).unwrap()
                    });
                    built.visit_gathered_params(|name, values| match &mut file {
                        Some(f) => f.write(&hf_io::hf_name(name), values),
                        None => Ok(()),
                    })?;
                    file.map_or(Ok(()), StreamedSafetensors::finish)?;
                }
                Ok(())
            });
            results.into_iter().collect::<Result<Vec<()>>>()?;
        }
        hf_io::write_config_files(&saved, &cfg)?;
        let read = hf_io::load_model_dir(&saved, &Device::Cpu)?;
        for (name, var) in whole.iter() {
            let got = read.tensors[name].flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, var.as_tensor().flatten_all()?.to_vec1::<f32>()?, "{name}");
        }
        let slices = ModelSlices::open(&saved)?;
        let results = on_groups(2, |group| {
            let group = Arc::new(group);
            let read = ShardedModel::read(
                group.clone(),
                &cfg,
                |n, r| slices.read(n, r),
                &Default::default(),
                DType::F32,
                &Device::Cpu,
            )?;
            let cut = ShardedModel::new(group, &cfg, &whole, DType::F32)?;
            assert_eq!(read.shard_values()?, cut.shard_values()?);
            Ok(())
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
        Ok(())
    }

    /// Beside the trunk a file's heads are read whole (a reward model's score), and neither the
    /// tied `lm_head.weight` nor an old checkpoint's causal-mask buffers count as heads.
    #[test]
    fn the_heads_are_the_tensors_beside_the_trunk_that_are_parameters() -> Result<()> {
        let cfg = small();
        let whole = ParamStore::init(&cfg, 1, &Device::Cpu)?;
        let score = Tensor::arange(0f32, 8.0, &Device::Cpu)?.reshape((1, 8))?;
        let mut tensors: Vec<(String, Tensor)> =
            whole.iter().map(|(n, v)| (hf_io::hf_name(n), v.as_tensor().clone())).collect();
        tensors.push(("score.weight".into(), score.clone()));
        tensors.push(("lm_head.weight".into(), whole.get("wte.weight").unwrap().as_tensor().clone()));
        tensors.push(("transformer.h.0.attn.bias".into(), Tensor::ones((1, 1, 8, 8), DType::F32, &Device::Cpu)?));
        tensors.push(("h.1.attn.masked_bias".into(), Tensor::new(-1e4f32, &Device::Cpu)?));
        let dir = tempfile::tempdir()?;
        safetensors::serialize_to_file(tensors, None, &dir.path().join(WEIGHTS))?;
        hf_io::write_config_files(dir.path(), &cfg)?;
        let heads = ModelSlices::open(dir.path())?.heads()?;
        assert_eq!(heads.keys().collect::<Vec<_>>(), ["score.weight"]);
        assert_eq!(heads["score.weight"].to_vec2::<f32>()?, score.to_vec2::<f32>()?);
        Ok(())
    }

    #[test]
    fn the_pages_released_after_a_read_are_exactly_those_that_hold_it() {
        let page = 4096;
        assert_eq!(whole_pages(3 * page + 5, 10, page), 3 * page..4 * page);
        assert_eq!(whole_pages(2 * page, page, page), 2 * page..3 * page);
        assert_eq!(whole_pages(100, 5000, page), 0..2 * page);
        assert_eq!(whole_pages(2 * page - 1, 2, page), page..3 * page);
        assert_eq!(whole_pages(2 * page, 0, page), 2 * page..2 * page);
    }

    /// A streamed file is a valid safetensors file whatever its header's length (the data
    /// 8-byte aligned, as safetensors aligns it), and a tensor written twice, with the wrong
    /// number of values or under another name, or never written, is an error naming it.
    #[test]
    fn streamed_files_are_aligned_and_every_tensor_is_written_once() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(WEIGHTS);
        for name_len in 1..=8 {
            let tensors = [("a".repeat(name_len), vec![2, 3]), ("b".into(), vec![5])];
            let mut file = StreamedSafetensors::create(&path, &tensors, &HashMap::new())?;
            let a = Tensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))?;
            let b = Tensor::arange(10f32, 15.0, &Device::Cpu)?.to_dtype(DType::BF16)?;
            file.write("b", &b)?;
            file.write(&tensors[0].0, &a)?;
            file.finish()?;
            let bytes = std::fs::read(&path)?;
            let header_len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
            assert_eq!(header_len % 8, 0, "names of {name_len}: the data starts 8-byte aligned");
            let read = safetensors::SafeTensors::deserialize(&bytes)?;
            assert_eq!(
                read.tensor(&tensors[0].0)?.data(),
                &*a.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()
            );
            assert_eq!(read.tensor("b")?.shape(), [5]);
        }
        let tensors = [("a".to_string(), vec![2]), ("b".to_string(), vec![1])];
        let two = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
        let mut file = StreamedSafetensors::create(&path, &tensors, &HashMap::new())?;
        assert!(file.write("c", &two).unwrap_err().to_string().contains("writing c into"));
        assert!(file.write("b", &two).unwrap_err().to_string().contains("2 values for 1 places"));
        file.write("a", &two)?;
        assert!(file.write("a", &two).unwrap_err().to_string().contains("written before: true"));
        assert!(file.finish().unwrap_err().to_string().contains("lacks tensor b"));
        Ok(())
    }

    /// Half-precision files (HF's fp16/bf16 checkpoints) read as f32 by range; a missing tensor
    /// or one of the wrong shape is one error naming it.
    #[test]
    fn slices_of_half_precision_weights_and_bad_files_are_read_as_they_should() -> Result<()> {
        let cfg = small();
        let whole = ParamStore::init(&cfg, 1, &Device::Cpu)?;
        let dir = tempfile::tempdir()?;
        for dtype in [DType::BF16, DType::F16] {
            let tensors: Vec<(String, Tensor)> = whole
                .iter()
                .map(|(n, v)| Ok((hf_io::hf_name(n), v.as_tensor().to_dtype(dtype)?)))
                .collect::<Result<_>>()?;
            safetensors::serialize_to_file(tensors, None, &dir.path().join(WEIGHTS))?;
            hf_io::write_config_files(dir.path(), &cfg)?;
            let slices = ModelSlices::open(dir.path())?;
            let want: Vec<f32> = whole
                .get("h.1.mlp.c_fc.weight")
                .unwrap()
                .as_tensor()
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            assert_eq!(slices.read("h.1.mlp.c_fc.weight", 5..77)?, want[5..77]);
        }
        let partial: Vec<(String, Tensor)> =
            whole.iter().skip(1).map(|(n, v)| (hf_io::hf_name(n), v.as_tensor().clone())).collect();
        safetensors::serialize_to_file(partial, None, &dir.path().join(WEIGHTS))?;
        let err = ModelSlices::open(dir.path()).err().expect("incomplete").to_string();
        assert!(err.contains("lacks tensor wte.weight"), "{err}");
        std::fs::write(dir.path().join(WEIGHTS), b"not safetensors")?;
        let err = ModelSlices::open(dir.path()).err().expect("corrupt").to_string();
        assert!(err.contains("is not a valid safetensors model"), "{err}");
        Ok(())
    }
}
