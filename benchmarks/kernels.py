"""Achieved memory bandwidth of each deepshard kernel against torch's equivalent (GPU).

Every op module of ``deepshard.kernels`` offers ``bench_cases(device)``: pairs of callables
doing the same work (ours, torch's) and the op's minimal DRAM traffic. Each is timed with
CUDA events (median of ``--reps`` after warm-up) and reported as GB/s, next to the
device-to-device copy bandwidth measured in the same run (the practical ceiling).

    python benchmarks/kernels.py [--reps 50] [--ops fused_adam,layer_norm]

Needs a CUDA GPU and CuPy; prints why and exits 2 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` on the GPU (CUDA events), after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(device, reps: int) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    args = parser.parse_args()
    import torch

    from deepshard.kernels import REGISTRY

    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA GPU here; nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    wanted = {n.strip() for n in args.ops.split(",") if n.strip()}
    ceiling = copy_bandwidth(device, args.reps)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"device-to-device copy: {ceiling / 1e9:.0f} GB/s; median of {args.reps} runs")
    print()
    print("| op | case | ours GB/s | torch GB/s | peer | ours / torch | ours / copy |")
    print("|---|---|---:|---:|---|---:|---:|")
    for op in REGISTRY:
        if wanted and op.name not in wanted:
            continue
        status, why = op.status()
        if status != "cuda":
            print(f"| {op.name} | - | - | - | - | - | {why} |")
            continue
        for case in importlib.import_module(op.module).bench_cases(device):
            ours = case.bytes_moved / timed(case.ours, args.reps)
            peer = case.bytes_moved / timed(case.torch, args.reps)
            print(f"| {op.name} | {case.name} | {ours / 1e9:.0f} | {peer / 1e9:.0f} | "
                  f"{case.torch_label} | {ours / peer:.2f} | {ours / ceiling:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
