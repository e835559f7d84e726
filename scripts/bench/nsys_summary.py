#!/usr/bin/env python3
"""One run's Nsight Systems breakdown from `nsys stats --report cuda_gpu_kern_sum,cuda_api_sum
--format csv --output PREFIX` (gpu-check.sh's nsys stage): the GPU's kernel time and launches,
the host's time in the CUDA API calls that cost most, the largest kernels.

Usage: nsys_summary.py LABEL PREFIX   (reads PREFIX_cuda_gpu_kern_sum.csv, PREFIX_cuda_api_sum.csv)
Column names differ between nsys versions: the total time, the count and the name are found by
their headers' words."""
import csv
import os
import sys


def rows(path):
    """The CSV's rows as dicts, or [] when the report is missing (nsys wrote none)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("Processing")]
    return list(csv.DictReader(lines))


def column(row, *words):
    """The value of the first header of `row` holding every one of `words`."""
    for key, value in row.items():
        if key and all(w in key for w in words):
            return value
    return None


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def summarise(label, prefix, top=6):
    kernels = rows(prefix + "_cuda_gpu_kern_sum.csv")
    api = rows(prefix + "_cuda_api_sum.csv")
    if not kernels and not api:
        return [f"nsys {label}: no report ({prefix}_*.csv missing)"]
    k = [(number(column(r, "Total Time")), number(column(r, "Instances") or column(r, "Calls")), column(r, "Name") or "?")
         for r in kernels]
    a = [(number(column(r, "Total Time")), number(column(r, "Calls") or column(r, "Instances")), column(r, "Name") or "?")
         for r in api]
    out = [f"nsys {label}: GPU kernels {sum(t for t, _, _ in k) / 1e6:.1f} ms in {int(sum(n for _, n, _ in k))} launches; "
           f"host in the CUDA API {sum(t for t, _, _ in a) / 1e6:.1f} ms"]
    for t, n, name in sorted(a, reverse=True)[:top]:
        out.append(f"  api {t / 1e6:9.2f} ms {int(n):7d}  {name}")
    for t, n, name in sorted(k, reverse=True)[:top]:
        out.append(f"  kernel {t / 1e6:6.2f} ms {int(n):7d}  {name[:60]}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print("\n".join(summarise(sys.argv[1], sys.argv[2])))
