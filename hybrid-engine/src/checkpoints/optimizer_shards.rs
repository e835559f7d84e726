//! A checkpoint's AdamW state as one file per rank plus a manifest (DeepSpeed's
//! `zero_pp_rank_<r>_..._optim_states.pt` files, in safetensors). Under ZeRO each rank writes
//! the moments it holds, so no rank ever gathers the whole optimizer state; every piece carries
//! the range of its parameter it covers, so the state loads into any world size or ZeRO stage:
//! each rank reads the pieces that overlap what it holds and checks that they cover all of it.
//!
//! Files: `optimizer-manifest.json` (the files, the world size that wrote them, every parameter's
//! size) and `optimizer-rank-<r>-of-<n>.safetensors`, whose tensors are 1-D pieces named
//! `exp_avg.<param>` / `exp_avg_sq.<param>` and the range of the parameter they cover in
//! `range.<param>` (two i64: start, end). Ranges are tensors rather than header metadata because
//! safetensors writes metadata in hash order: the same state must give the same bytes.
//! Unsharded optimizers (one rank, or ZeRO stage 0 where every rank holds the same state) are
//! written by rank 0 alone, as one file of whole pieces.

use crate::training::optim::AdamW;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{Device, Tensor};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

pub const MANIFEST: &str = "optimizer-manifest.json";
const FORMAT: &str = "rlhf-adamw-shards";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    /// Ranks of the run that wrote the files.
    pub world: usize,
    pub files: Vec<String>,
    /// Every parameter's name and number of values, in the model's order.
    pub params: Vec<(String, usize)>,
}

/// The file rank `rank` of `world` writes.
pub fn shard_file(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank:03}-of-{world:03}.safetensors")
}

/// The manifest of a save by `world` ranks, `writers` of which wrote a file (all of them when
/// the optimizer is sharded, rank 0 alone otherwise).
pub fn manifest(world: usize, writers: usize, names: &[String], numels: &[usize]) -> Manifest {
    Manifest {
        format: FORMAT.into(),
        world,
        files: (0..writers).map(|r| shard_file(r, world)).collect(),
        params: names.iter().cloned().zip(numels.iter().copied()).collect(),
    }
}

/// Writes the moments `optimizer` holds (parameter `i` is `names[i]`) into `dir`'s file for
/// `rank` of `world`.
pub fn write_shard(dir: &Path, rank: usize, world: usize, optimizer: &AdamW, names: &[String]) -> Result<()> {
    let mut tensors = Vec::new();
    let meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    for (i, name) in names.iter().enumerate() {
        let held = optimizer.held(i);
        if held.is_empty() {
            continue;
        }
        let (m, v) = optimizer.held_moments(i)?;
        tensors.push((format!("exp_avg.{name}"), Tensor::from_slice(&m, m.len(), &Device::Cpu)?));
        tensors.push((format!("exp_avg_sq.{name}"), Tensor::from_slice(&v, v.len(), &Device::Cpu)?));
        let range = [held.start as i64, held.end as i64];
        tensors.push((format!("range.{name}"), Tensor::from_slice(&range, 2, &Device::Cpu)?));
    }
    let path = dir.join(shard_file(rank, world));
    safetensors::serialize_to_file(tensors, Some(meta), &path)
        .with_context(|| format!("writing {}", path.display()))?;
    crate::durable::set_created_permissions(&path)
}

/// Reads the manifest in `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| anyhow!("{} is not a valid optimizer manifest: {e}", path.display()))?;
    if m.format != FORMAT {
        bail!("{} has format {:?}, not {FORMAT:?}: it was not written by this program", path.display(), m.format);
    }
    for f in &m.files {
        // A file name, never a path: a manifest must not make us read outside the checkpoint.
        if f.contains('/') || f.contains('\\') || f.starts_with('.') || f.chars().any(char::is_control) {
            bail!("{} names the file {f:?}, which is not a plain file name", path.display());
        }
    }
    Ok(m)
}

/// Fills the moments `optimizer` holds (parameter `i` is `names[i]` with `numels[i]` values)
/// from the files of `dir`'s manifest, whatever world size wrote them; the held values must be
/// covered exactly. Each file is read, used and dropped in turn.
pub fn load_into(
    dir: &Path,
    manifest: &Manifest,
    optimizer: &mut AdamW,
    names: &[String],
    numels: &[usize],
) -> Result<()> {
    let expected: Vec<(String, usize)> = names.iter().cloned().zip(numels.iter().copied()).collect();
    if manifest.params != expected {
        let differs = expected.iter().zip(&manifest.params).find(|(a, b)| a != b);
        bail!(
            "{} is for other parameters ({}): resume with the model it was saved with",
            dir.join(MANIFEST).display(),
            match differs {
                Some((want, got)) =>
                    format!("{} has {} values here, the checkpoint {} with {}", want.0, want.1, got.0, got.1),
                None => format!("{} parameters here, {} in the checkpoint", expected.len(), manifest.params.len()),
            }
        );
    }
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let mut covered = vec![0usize; names.len()];
    for file in &manifest.files {
        let path = dir.join(file);
        if !path.is_file() {
            bail!("cannot read {}, listed in the checkpoint's {MANIFEST}", path.display());
        }
        let corrupt = |e: &dyn std::fmt::Display| anyhow!("{} is not a valid optimizer shard ({e})", path.display());
        // Memory-mapped: a rank reads only the values it holds (a one-rank file holds all of
        // them). SAFETY: checkpoints are written into new directories and renamed into place,
        // never rewritten while a run reads them.
        let st = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| corrupt(&e))?;
        let mut pieces: Vec<String> =
            st.tensors().iter().filter_map(|(n, _)| n.strip_prefix("range.")).map(String::from).collect();
        pieces.sort();
        for name in &pieces {
            let Some(&i) = index.get(name.as_str()) else {
                return Err(corrupt(&format!("it holds {name:?}, which the model does not")));
            };
            let bounds = values::<8, i64>(&st, &format!("range.{name}"), 0..2, Dtype::I64, i64::from_le_bytes)
                .map_err(|e| corrupt(&e))?;
            let range = match bounds[..] {
                [a, b] if 0 <= a && a <= b && b as usize <= numels[i] => a as usize..b as usize,
                _ => return Err(corrupt(&format!("{name}'s range {bounds:?} is not within its {} values", numels[i]))),
            };
            let held = optimizer.held(i);
            let overlap = range.start.max(held.start)..range.end.min(held.end);
            let read = |key: &str| -> Result<Vec<f32>> {
                let key = format!("{key}.{name}");
                let n = st.get(&key).map_err(|e| corrupt(&e))?.shape().iter().product::<usize>();
                if n != range.len() {
                    return Err(corrupt(&format!("{key} has {n} values for the range {range:?}")));
                }
                if overlap.is_empty() {
                    return Ok(Vec::new());
                }
                let within = overlap.start - range.start..overlap.end - range.start;
                values::<4, f32>(&st, &key, within, Dtype::F32, f32::from_le_bytes).map_err(|e| corrupt(&e))
            };
            let (m, v) = (read("exp_avg")?, read("exp_avg_sq")?);
            if !overlap.is_empty() {
                covered[i] += optimizer.fill_held(i, overlap, &m, &v)?;
            }
        }
    }
    for (i, name) in names.iter().enumerate() {
        if covered[i] != optimizer.held(i).len() {
            bail!(
                "the optimizer shards listed in {} ({}) cover {} of the {} values of {name} this rank needs: a shard is missing or damaged",
                dir.join(MANIFEST).display(),
                manifest.files.join(", "),
                covered[i],
                optimizer.held(i).len()
            );
        }
    }
    Ok(())
}

/// Values `range` of 1-D tensor `key` of dtype `dtype`, `W` bytes each, decoded by `decode`.
fn values<const W: usize, T>(
    st: &MmapedSafetensors,
    key: &str,
    range: std::ops::Range<usize>,
    dtype: Dtype,
    decode: fn([u8; W]) -> T,
) -> Result<Vec<T>> {
    let view = st.get(key)?;
    let n: usize = view.shape().iter().product();
    if view.dtype() != dtype || range.end > n {
        bail!("{key} is {:?} of {n} values, not {dtype:?} with values {range:?}", view.dtype());
    }
    let bytes = &view.data()[range.start * W..range.end * W];
    Ok(bytes.chunks_exact(W).map(|b| decode(b.try_into().expect("chunks of W bytes"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::training::optim::AdamWConfig;
    use std::ops::Range;

    /// An optimizer over `numels` holding `ranges`, its moments set to the global value index
    /// (first moment) and its negation (second), so any misplaced copy shows.
    fn numbered(names: &[String], numels: &[usize], ranges: Vec<Range<usize>>) -> AdamW {
        let mut opt = AdamW::over_ranges(AdamWConfig::default(), names, ranges.clone());
        for (i, r) in ranges.iter().enumerate() {
            let base = numels[..i].iter().sum::<usize>();
            let m: Vec<f32> = r.clone().map(|j| (base + j) as f32).collect();
            let v: Vec<f32> = m.iter().map(|x| -x).collect();
            opt.fill_held(i, r.clone(), &m, &v).expect("host moments");
        }
        opt
    }

    #[test]
    fn shards_written_by_3_ranks_load_into_2_and_1_and_a_missing_file_is_named() -> Result<()> {
        let names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let numels = [5usize, 1, 6];
        // 3 writers, uneven pieces (one holds nothing of `b`).
        let held = [vec![0..4, 0..0, 0..0], vec![4..5, 0..1, 0..2], vec![5..5, 1..1, 2..6]];
        let dir = tempfile::tempdir()?;
        for (r, ranges) in held.iter().enumerate() {
            write_shard(dir.path(), r, 3, &numbered(&names, &numels, ranges.clone()), &names)?;
        }
        let m = manifest(3, 3, &names, &numels);
        std::fs::write(dir.path().join(MANIFEST), serde_json::to_string(&m)?)?;
        let m = read_manifest(dir.path())?;
        let want = numbered(&names, &numels, numels.iter().map(|&n| 0..n).collect());
        for layout in [vec![vec![0..5, 0..1, 0..6]], vec![vec![0..3, 0..0, 0..0], vec![3..5, 0..1, 0..6]]] {
            for ranges in layout {
                let mut opt = AdamW::over_ranges(AdamWConfig::default(), &names, ranges.clone());
                load_into(dir.path(), &m, &mut opt, &names, &numels)?;
                for (i, r) in ranges.iter().enumerate() {
                    let ((wm, wv), (m, v)) = (want.held_moments(i)?, opt.held_moments(i)?);
                    assert_eq!((&*m, &*v), (&wm[r.clone()], &wv[r.clone()]), "param {i} range {r:?}");
                }
            }
        }
        std::fs::remove_file(dir.path().join(shard_file(1, 3)))?;
        let mut opt = AdamW::over_ranges(AdamWConfig::default(), &names, numels.iter().map(|&n| 0..n).collect());
        let err = load_into(dir.path(), &m, &mut opt, &names, &numels).unwrap_err().to_string();
        assert!(err.contains("optimizer-rank-001-of-003.safetensors"), "{err}");
        // Another model's parameters are refused by name.
        let other = [5usize, 1, 7];
        let err = load_into(dir.path(), &m, &mut opt, &names, &other).unwrap_err().to_string();
        assert!(err.contains("c has 7 values here, the checkpoint c with 6"), "{err}");
        Ok(())
    }

    #[test]
    fn a_manifest_cannot_name_a_file_outside_the_checkpoint() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // Each name breaks exactly one of the rules, so each rule is tested on its own.
        for name in ["../../etc/passwd", "sub/file", "sub\\file", ".hidden", "line\nbreak"] {
            let mut m = manifest(1, 1, &[], &[]);
            m.files = vec![name.into()];
            std::fs::write(dir.path().join(MANIFEST), serde_json::to_string(&m)?)?;
            let err = read_manifest(dir.path()).unwrap_err().to_string();
            assert!(err.contains("not a plain file name"), "{name:?}: {err}");
        }
        let mut m = manifest(1, 1, &[], &[]);
        m.files = vec!["optimizer-rank-000-of-001.safetensors".into()];
        std::fs::write(dir.path().join(MANIFEST), serde_json::to_string(&m)?)?;
        assert_eq!(read_manifest(dir.path())?, m);
        Ok(())
    }

    /// A shard whose `range.<param>` lies outside its parameter is refused by name, even where
    /// its values would cover what a rank holds: a damaged range must not load silently.
    #[test]
    fn a_shard_whose_range_lies_outside_its_parameter_is_refused() -> Result<()> {
        let names = vec!["w".to_string()];
        let numels = [6usize];
        let dir = tempfile::tempdir()?;
        let m = manifest(1, 1, &names, &numels);
        for bounds in [[0i64, 7], [-1, 5], [4, 2]] {
            let n = (bounds[1] - bounds[0]).max(0) as usize;
            let piece = Tensor::from_vec(vec![1f32; n], n, &Device::Cpu)?;
            let range = Tensor::from_slice(&bounds, 2, &Device::Cpu)?;
            let tensors = [("exp_avg.w", piece.clone()), ("exp_avg_sq.w", piece), ("range.w", range)];
            safetensors::serialize_to_file(tensors, None, &dir.path().join(shard_file(0, 1)))?;
            let mut opt = AdamW::over_ranges(AdamWConfig::default(), &names, numels.iter().map(|&n| 0..n).collect());
            let err = load_into(dir.path(), &m, &mut opt, &names, &numels).unwrap_err().to_string();
            assert!(err.contains(&format!("w's range {bounds:?} is not within its 6 values")), "{bounds:?}: {err}");
        }
        Ok(())
    }
}
