//! `--device`: where a step computes. One parser for every binary:
//!
//! - `auto` (the default): this rank's CUDA device when this build has the `cuda` feature and a
//!   GPU opens, else the CPU (with a one-line note on stderr when a CUDA build finds no usable GPU);
//! - `cpu`;
//! - `cuda` (this rank's device) or `cuda:N`.
//!
//! "This rank's device" is `cuda:<local rank>` (torchrun's convention: the ranks of a node each
//! take their own GPU; `cuda:0` for a lone process), the local rank as whichever launcher set it
//! ([`crate::comm::RankEnv`]: torchrun's `LOCAL_RANK`, SLURM's `SLURM_LOCALID`, MPI's). `cuda:N`
//! puts every rank on device N.
//!
//! Asking for CUDA where there is none is one line saying what to do: rebuild with
//! `--features cuda` (a CPU-only build), or use `--device cpu` (no GPU, no driver, or no such
//! device), with the driver's own error text inside the line.

use anyhow::{bail, Result};
use candle_core::{Device, DeviceLocation};

/// The environment variable a `--device` flag falls back to: `train --device D` sets it for the
/// step processes its recipes start, whatever flags the recipe passes.
pub const DEVICE_ENV: &str = "RLHF_DEVICE";

/// What the user asked for, before any device is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceSpec {
    /// Parses `auto`, `cpu`, `cuda`, `cuda:N` (case-insensitive, surrounding blanks ignored).
    pub fn parse(spec: &str) -> Result<Self> {
        Self::parse_for_rank(spec, local_rank())
    }

    /// [`Self::parse`] for the rank `local_rank` of its node (`cuda` is its device).
    pub fn parse_for_rank(spec: &str, local_rank: usize) -> Result<Self> {
        let s = spec.trim().to_ascii_lowercase();
        match s.as_str() {
            "auto" => return Ok(Self::Auto),
            "cpu" => return Ok(Self::Cpu),
            "cuda" => return Ok(Self::Cuda(local_rank)),
            _ => {}
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return match n.parse::<usize>() {
                Ok(n) => Ok(Self::Cuda(n)),
                Err(_) => bail!("--device {spec:?}: the CUDA device number must be 0, 1, ... (e.g. cuda:0)"),
            };
        }
        bail!("--device {spec:?} is not a device: use auto, cpu, cuda or cuda:N")
    }
}

/// This process's rank on its node, from its launcher's variables (0 without any, or for
/// values the process group will refuse anyway when it joins).
fn local_rank() -> usize {
    crate::comm::RankEnv::from_process().map_or(0, |env| env.local_rank)
}

/// Whether this binary was built with the `cuda` feature.
pub const fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

/// Checks `--device` without opening a device (no CUDA context, no GPU memory): the spelling,
/// that the build has CUDA, and that the driver sees device N. For the flags' validation, before
/// any work starts, and for `train`, whose steps open the device in their own processes.
pub fn check_device(spec: &str) -> Result<DeviceSpec> {
    let parsed = DeviceSpec::parse(spec)?;
    if let DeviceSpec::Cuda(n) = parsed {
        check_cuda(spec.trim(), n)?;
    }
    Ok(parsed)
}

/// Parses `--device` and opens the device (see the module documentation).
pub fn parse_device(spec: &str) -> Result<Device> {
    match check_device(spec)? {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Auto => Ok(auto_device()),
        DeviceSpec::Cuda(n) => open_cuda(spec.trim(), n),
    }
}

/// A short name for logs: `cpu`, `cuda:0`.
pub fn describe(device: &Device) -> String {
    match device.location() {
        DeviceLocation::Cpu => "cpu".into(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(not(feature = "cuda"))]
fn auto_device() -> Device {
    Device::Cpu
}

#[cfg(feature = "cuda")]
fn auto_device() -> Device {
    let n = local_rank();
    match cuda_device_count() {
        Ok(0) => Device::Cpu,
        Ok(_) => match new_cuda(n) {
            Ok(d) => d,
            Err(e) => {
                eprintln!(
                    "note: --device auto: CUDA device {n} does not open ({}); running on the CPU",
                    first_line(&e)
                );
                Device::Cpu
            }
        },
        Err(e) => {
            eprintln!("note: --device auto: no usable CUDA driver ({e}); running on the CPU");
            Device::Cpu
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda_build(spec: &str) -> String {
    format!(
        "--device {}: this binary was built without CUDA; rebuild with `cargo build --release --features cuda` (set up by `source scripts/cuda-build-env.sh`), or use --device cpu",
        spec.trim()
    )
}

#[cfg(not(feature = "cuda"))]
fn check_cuda(spec: &str, _n: usize) -> Result<()> {
    bail!("{}", no_cuda_build(spec))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: &str, _n: usize) -> Result<Device> {
    bail!("{}", no_cuda_build(spec))
}

#[cfg(feature = "cuda")]
fn check_cuda(spec: &str, n: usize) -> Result<()> {
    let count = match cuda_device_count() {
        Ok(c) => c,
        Err(e) => {
            bail!("--device {spec}: no usable CUDA driver or GPU on this machine ({e}); use --device cpu (or auto)")
        }
    };
    if n >= count {
        let have = match count {
            0 => "no CUDA device".to_string(),
            1 => "1 CUDA device (cuda:0)".to_string(),
            c => format!("{c} CUDA devices (cuda:0 to cuda:{})", c - 1),
        };
        bail!("--device {spec}: this machine has {have}; use one of those, or --device cpu");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: &str, n: usize) -> Result<Device> {
    match new_cuda(n) {
        Ok(d) => Ok(d),
        Err(e) => bail!("--device {spec}: CUDA device {n} does not open ({}); use --device cpu", first_line(&e)),
    }
}

/// CUDA device `n` as candle opens it, without cudarc's event tracking, its memory pool keeping
/// what it has. cudarc gives every allocation two CUDA events (created with it, destroyed with
/// it) for ordering work across streams, and records them only when the context runs several
/// streams; candle runs all of a device's work on one stream, so the events are never recorded,
/// and making and destroying them is host time on each of the thousands of allocations of a
/// training step.
#[cfg(feature = "cuda")]
pub(crate) fn new_cuda(n: usize) -> candle_core::Result<Device> {
    let device = Device::new_cuda(n)?;
    if let Device::Cuda(cuda) = &device {
        // SAFETY: nothing allocated on this device yet. candle runs all its work on one stream;
        // the only second stream is an NCCL communicator's (comm/nccl.rs), whose collectives
        // order themselves against the compute stream by events of their own, recorded where
        // cudarc would have recorded these.
        unsafe { cuda.disable_event_tracking() };
        keep_pool_memory(cuda)?;
    }
    Ok(device)
}

/// Sets the release threshold of the device's default memory pool (which cudarc's stream-ordered
/// allocations draw from) to its maximum. At the default, 0, the pool hands every freed byte back
/// to the driver at each synchronisation (a loss read, a gradient norm, a generated token), and
/// the next step maps its memory afresh: host time on the allocations after every sync. Kept,
/// the freed memory serves the next step as PyTorch's caching allocator serves it; the driver's
/// used memory then shows the pool's high-water mark.
#[cfg(feature = "cuda")]
fn keep_pool_memory(cuda: &candle_core::CudaDevice) -> candle_core::Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let failed = |what: &str, e: sys::CUresult| candle_core::Error::Msg(format!("CUDA {what}: {e:?}"));
    cuda.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("CUDA context: {e:?}")))?;
    let (mut dev, mut pool, mut threshold) = (0, std::ptr::null_mut(), u64::MAX);
    // SAFETY: the context is current; each call writes its out-parameter, and the release
    // threshold is a u64 (the driver API's documentation).
    unsafe {
        let r = sys::cuCtxGetDevice(&mut dev);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed("device", r));
        }
        if sys::cuDeviceGetDefaultMemPool(&mut pool, dev) != sys::CUresult::CUDA_SUCCESS {
            return Ok(()); // no memory pools (cudarc then allocates without one)
        }
        let attribute = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        let r = sys::cuMemPoolSetAttribute(pool, attribute, (&mut threshold as *mut u64).cast());
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed("memory pool", r));
        }
    }
    Ok(())
}

/// The number of CUDA devices the driver sees (initialising the driver first).
#[cfg(feature = "cuda")]
fn cuda_device_count() -> std::result::Result<usize, String> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(c)) => Ok(c.max(0) as usize),
        // The driver's code and, where the driver can say it, its description.
        Ok(Err(e)) => Err(match e.error_string() {
            Ok(text) => format!("{:?}: {}", e.0, text.to_string_lossy()),
            Err(_) => format!("{:?}", e.0),
        }),
        Err(_) => Err("the CUDA driver panicked".into()),
    }
}

/// The first line of an error (candle appends a backtrace when RUST_BACKTRACE is set).
#[cfg(feature = "cuda")]
fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_spellings() -> Result<()> {
        assert_eq!(DeviceSpec::parse("auto")?, DeviceSpec::Auto);
        assert_eq!(DeviceSpec::parse("cpu")?, DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse(" CPU ")?, DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("cuda")?, DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:0")?, DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:3")?, DeviceSpec::Cuda(3));
        // Each rank of a node takes its own GPU; an explicit number is every rank's.
        assert_eq!(DeviceSpec::parse_for_rank("cuda", 0)?, DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse_for_rank("CUDA", 3)?, DeviceSpec::Cuda(3));
        assert_eq!(DeviceSpec::parse_for_rank("cuda:1", 3)?, DeviceSpec::Cuda(1));
        Ok(())
    }

    #[test]
    fn cpu_is_the_cpu() -> Result<()> {
        assert!(parse_device("cpu")?.is_cpu());
        Ok(())
    }

    #[test]
    fn bad_strings_say_what_is_accepted() {
        let err = |s: &str| format!("{:#}", parse_device(s).unwrap_err());
        for bad in ["gpu", "", "cuda0", "metal", "cpu:0"] {
            let e = err(bad);
            assert!(e.contains("use auto, cpu, cuda or cuda:N"), "{bad:?}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
        for bad in ["cuda:x", "cuda:", "cuda:-1", "cuda:1.5"] {
            let e = err(bad);
            assert!(e.contains("must be 0, 1, ...") && e.contains(bad), "{bad:?}: {e}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_auto_is_the_cpu_and_cuda_says_how_to_rebuild() {
        assert!(parse_device("auto").unwrap().is_cpu());
        for spec in ["cuda", "cuda:0", "cuda:1"] {
            let e = format!("{:#}", parse_device(spec).unwrap_err());
            assert!(e.starts_with(&format!("--device {spec}: this binary was built without CUDA")), "{e}");
            assert!(e.contains("--features cuda") && e.contains("scripts/cuda-build-env.sh"), "{e}");
            assert!(e.contains("--device cpu") && !e.contains('\n'), "{e}");
            assert_eq!(format!("{:#}", check_device(spec).unwrap_err()), e);
        }
        assert_eq!(check_device("auto").unwrap(), DeviceSpec::Auto);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn with_the_cuda_feature_auto_always_opens_something() {
        // A GPU machine gets cuda:0, a GPU-less one (or the link stubs) the CPU: never an error.
        let d = parse_device("auto").unwrap();
        assert!(matches!(describe(&d).as_str(), "cpu" | "cuda:0"));
        // A device number past any machine's is one line that says what to do.
        let e = format!("{:#}", parse_device("cuda:4096").unwrap_err());
        assert!(e.contains("--device cpu") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn describes_the_cpu() {
        assert_eq!(describe(&Device::Cpu), "cpu");
    }
}
