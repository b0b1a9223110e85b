"""Checkpoint save and load time and peak RSS per rank, deepshard beside DeepSpeed, on CPU;
and the conversion to DeepSpeed's universal layout beside DeepSpeed's ``ds_to_universal``.

The model is ``benchmarks/train.py``'s: the reference GPT of ``examples/gpt.py`` (27.4M
parameters, fp32), 2 gloo ranks with one thread each, AdamW (``torch_adam``: the same
``torch.optim.AdamW`` in both libraries), one training step before the save so the
optimizer state is full. ZeRO-2 and ZeRO-3. Every operation runs in 2 fresh worker
processes (this script with ``--worker``); a worker builds its engine, then times the one
operation between two barriers, sampling its RSS every 5 ms meanwhile: the table gives the
slower rank's time and each rank's peak RSS during the operation (the process, model and
engine included, as a user sees it), with its RSS just before (the engine at rest). A load
is timed 5 times in a row (the median; the peak RSS is the first one's).

Rows per stage:
    deepshard save / load          deepshard's own format (``manifest.json``, rank files)
    deepshard save, DeepSpeed's    deepshard writing DeepSpeed's layout
    layout / load of that          (``checkpoint.format: "deepspeed"``) and reading it back
    DeepSpeed save / load          DeepSpeed 0.19.8 writing and reading its layout
    deepshard load of DeepSpeed's  deepshard reading the checkpoint DeepSpeed wrote
    universal: DeepSpeed's tool    ``python -m deepspeed.checkpoint.ds_to_universal`` (with
                                   ``--inject_missing_state``, which ZeRO-2 needs) on
                                   DeepSpeed's checkpoint, as a command (wall time, RSS)
    universal: deepshard's tool    ``python -m deepshard.runtime.checkpoint.universal``, the
                                   same command line, on the same checkpoint
    deepshard → universal          deepshard's tool on deepshard's own checkpoint
    DeepSpeed load of deepshard's  DeepSpeed reading what deepshard wrote in its layout
    DeepSpeed layout
    DeepSpeed load of deepshard's  DeepSpeed (``load_universal``) reading the universal
    universal                      folder made from deepshard's checkpoint: the way back
    deepshard load of universal    deepshard (``load_universal``) reading the same folder

    python benchmarks/checkpoint.py [--stages 2,3] [--deepspeed-python /tmp/dsvenv/bin/python]

Writes ``benchmarks/results/checkpoint.json`` and prints a Markdown table. Run it alone on
a quiet machine: the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from train import (  # noqa: E402
    DEFAULT_DS_PYTHON,
    MICRO_BATCH,
    SEED,
    WORLD,
    deepspeed_version,
    error_line,
    wait_all,
)

RESULT_TAG = "CKPT "
LOAD_REPEATS = 5
"""Loads are timed this many times in a row on the same engine (the median is reported;
peak RSS is the first load's, from the engine at rest): one load of this model takes
0.1-0.2 s, where single runs vary by 30%."""
OUT = ROOT / "benchmarks" / "results" / "checkpoint.json"


def config(stage: int, universal: bool = False, deepspeed_layout: bool = False) -> dict:
    """The config both libraries run with (``deepspeed_layout``: deepshard saves in
    DeepSpeed's layout)."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
           "steps_per_print": 10**9}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    if deepspeed_layout:
        cfg["checkpoint"] = {"format": "deepspeed"}
    return cfg


class PeakRss:
    """The largest RSS of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRss:
        import psutil

        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


# ---------------------------------------------------------------- worker (one rank)

def worker(runtime: str, op: str, stage: int, where: str) -> None:
    """One rank: build the engine, train one step (save), then time ``op``."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig())
    if runtime == "deepshard":
        import deepshard as library
    else:
        import deepspeed as library
    library.init_distributed()
    import torch.distributed as dist

    if runtime == "deepspeed":
        import deepspeed.comm.comm

        deepspeed.comm.comm.cdb.shm_vector_kernel_level = 0
    engine, *_ = library.initialize(model=model, model_parameters=model.parameters(),
                                    config=config(stage, universal=op == "load-universal",
                                                  deepspeed_layout=op == "save-deepspeed"))
    rank, world = dist.get_rank(), dist.get_world_size()
    saving = op.startswith("save")
    if saving:
        x, y = gpt.sample_batch(gpt.stdlib_corpus(),
                                gpt.rank_indices(0, 0, rank, world, MICRO_BATCH, 1), SEED,
                                model.cfg.seq_len)
        engine.backward(engine(x, y))
        engine.step()
    dist.barrier()
    import psutil

    before = psutil.Process().memory_info().rss
    times = []
    for k in range(1 if saving else LOAD_REPEATS):
        with PeakRss() as rss:
            start = time.perf_counter()
            if saving:
                engine.save_checkpoint(where, tag="global_step1")
            else:
                engine.load_checkpoint(where)
            dist.barrier()
            times.append(time.perf_counter() - start)
        if k == 0:
            peak = rss.peak
    print(RESULT_TAG + json.dumps({"rank": rank, "seconds": statistics.median(times),
                                   "peak_rss": peak, "rss_before": before}), flush=True)
    dist.destroy_process_group()
    if runtime == "deepspeed":  # its CPU build aborts in teardown now and then, after this
        sys.stderr.flush()
        os._exit(0)


# ---------------------------------------------------------------- parent

def ranks(python: str, runtime: str, op: str, stage: int, where: Path, timeout: float) -> dict:
    """Run one operation on 2 fresh ranks: ``{"seconds", "peak_rss"}`` or ``{"failed"}``."""
    from deepshard.launcher.cli import free_port

    port = free_port("127.0.0.1")
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu"}
    argv = [python, str(Path(__file__).resolve()), "--worker", runtime, op, str(stage),
            str(where)]
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        procs = []
        for rank in range(WORLD):
            with open(f"{tmp}/{rank}.out", "w") as out, open(f"{tmp}/{rank}.err", "w") as err:
                procs.append(subprocess.Popen(
                    argv, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=ROOT,
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        codes = wait_all(procs, timeout)
        if any(code != 0 for code in codes):
            bad = next(r for r, c in enumerate(codes) if c != 0)
            return {"failed": error_line(Path(tmp) / f"{bad}.err")}
        found = []
        for rank in range(WORLD):
            lines = [line for line in Path(f"{tmp}/{rank}.out").read_text().splitlines()
                     if line.startswith(RESULT_TAG)]
            found.append(json.loads(lines[-1][len(RESULT_TAG):]))
    return {"seconds": max(f["seconds"] for f in found),
            "peak_rss": [f["peak_rss"] for f in found],
            "rss_before": [f["rss_before"] for f in found]}


def command(argv: list[str], timeout: float) -> dict:
    """Run a converter command: wall time and its peak RSS (children included)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"failed": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    rss = [int(line.split()[1]) * 1024 for line in done.stderr.splitlines()
           if line.startswith("MAXRSS ")]
    return {"seconds": seconds, "peak_rss": rss[-1:]}


def run_stage(stage: int, ds_python: str | None, tmp: Path, timeout: float) -> dict[str, dict]:
    """Every row of one stage."""
    me = sys.executable
    out: dict[str, dict] = {}
    ours, theirs = tmp / f"ours{stage}", tmp / f"theirs{stage}"
    out["deepshard save"] = ranks(me, "deepshard", "save", stage, ours, timeout)
    out["deepshard load"] = ranks(me, "deepshard", "load", stage, ours, timeout)
    ours_ds = tmp / f"ours_ds{stage}"
    out["deepshard save, DeepSpeed's layout"] = ranks(me, "deepshard", "save-deepspeed", stage,
                                                      ours_ds, timeout)
    out["deepshard load of that"] = ranks(me, "deepshard", "load", stage, ours_ds, timeout)
    uni_ours = tmp / f"uni_ours{stage}"
    out["deepshard → universal (deepshard's tool)"] = command(
        [me, "-m", "deepshard.runtime.checkpoint.universal", "--input_folder",
         str(ours / "global_step1"), "--output_folder", str(uni_ours / "global_step1")], timeout)
    out["deepshard load of universal"] = ranks(me, "deepshard", "load-universal", stage,
                                               uni_ours, timeout)
    if ds_python is None:
        return out
    out["DeepSpeed save"] = ranks(ds_python, "deepspeed", "save", stage, theirs, timeout)
    out["DeepSpeed load"] = ranks(ds_python, "deepspeed", "load", stage, theirs, timeout)
    out["deepshard load of DeepSpeed's"] = ranks(me, "deepshard", "load", stage, theirs,
                                                 timeout)
    tag = theirs / "global_step1"
    out["DeepSpeed → universal (DeepSpeed's ds_to_universal)"] = command(
        [ds_python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
         "--output_folder", str(tmp / f"uni_ds{stage}" / "global_step1"),
         "--inject_missing_state"], timeout)
    out["DeepSpeed → universal (deepshard's tool)"] = command(
        [me, "-m", "deepshard.runtime.checkpoint.universal", "--input_folder", str(tag),
         "--output_folder", str(tmp / f"uni_mine{stage}" / "global_step1")], timeout)
    out["DeepSpeed load of deepshard's DeepSpeed layout"] = ranks(ds_python, "deepspeed",
                                                                  "load", stage, ours_ds,
                                                                  timeout)
    out["DeepSpeed load of deepshard's universal"] = ranks(ds_python, "deepspeed",
                                                           "load-universal", stage, uni_ours,
                                                           timeout)
    return out


def table(results: dict[int, dict[str, dict]]) -> list[str]:
    """Markdown rows: time, ratio to DeepSpeed's own operation, peak RSS per rank."""
    lines = ["| stage | operation | seconds | vs DeepSpeed | peak RSS per rank, MiB "
             "(before it) |", "|---|---|---|---|---|"]
    twin = {"deepshard save": "DeepSpeed save", "deepshard load": "DeepSpeed load",
            "deepshard save, DeepSpeed's layout": "DeepSpeed save",
            "deepshard load of that": "DeepSpeed load",
            "deepshard load of DeepSpeed's": "DeepSpeed load",
            "DeepSpeed → universal (deepshard's tool)":
                "DeepSpeed → universal (DeepSpeed's ds_to_universal)"}
    for stage, rows in results.items():
        for name, row in rows.items():
            if "failed" in row:
                lines.append(f"| {stage} | {name} | failed: {row['failed']} | | |")
                continue
            ref = rows.get(twin.get(name, ""), {})
            ratio = f"{ref['seconds'] / row['seconds']:.2f}x faster" \
                if "seconds" in ref else ""
            before = row.get("rss_before") or [None] * len(row["peak_rss"])
            rss = " / ".join(f"{r / 2**20:.0f}" + (f" ({b / 2**20:.0f})" if b else "")
                             for r, b in zip(row["peak_rss"], before, strict=True))
            lines.append(f"| {stage} | {name} | {row['seconds']:.2f} | {ratio} | {rss} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("RUNTIME", "OP", "STAGE", "DIR"))
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.worker:
        runtime, op, stage, where = args.worker
        worker(runtime, op, int(stage), where)
        return
    version, why = deepspeed_version(args.deepspeed_python)
    if version is None:
        print(f"DeepSpeed rows skipped: {why}")
    results: dict[int, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for stage in (int(s) for s in args.stages.split(",")):
            results[stage] = run_stage(stage, args.deepspeed_python if version else None,
                                       Path(tmp), args.timeout)
            print(f"stage {stage} done", flush=True)
    lines = table(results)
    print("\n".join(lines))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"deepspeed": version, "results": results,
                               "table": lines}, indent=1) + "\n")


if __name__ == "__main__":
    main()
