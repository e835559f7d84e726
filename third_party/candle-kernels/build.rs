// candle-kernels 0.11.1's build script less its second half (third_party/README.md): the PTX of
// src/*.cu is built as published; the static library of the GGUF and mixture-of-experts matmuls
// (src/moe, src/mmq_gguf, src/mmvq_gguf.cu, removed from this copy) is not, since nothing in
// this project quantizes or routes experts, and it took 4.5 of the CUDA build's 6 to 7.5 minutes
// on 2 cores. The libraries it linked besides are linked as before.
use cudaforge::{KernelBuilder, Result};
use std::env;
use std::path::PathBuf;

fn main() -> Result<()> {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");

    // Build for PTX
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let ptx_path = out_dir.join("ptx.rs");
    let bindings = KernelBuilder::new()
        .source_dir("src") // Scan src/ for .cu files
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?;

    bindings.write(&ptx_path)?;

    let is_target_msvc = env::var("TARGET").is_ok_and(|target| target.contains("msvc"));
    println!("cargo:rustc-link-lib=dylib=cudart");
    if !is_target_msvc {
        println!("cargo:rustc-link-lib=stdc++");
    }
    Ok(())
}
