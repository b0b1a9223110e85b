"""One rank of ``benchmarks/onebit.py``: train one model with one optimizer, or time an all-reduce.

Started by ds-run on each of the benchmark's namespace hosts (or by hand, e.g.
``ds-run --num_gpus 2 benchmarks/onebit_worker.py --model wide --optimizer onebit --iface lo
--out /tmp/ob``). Each rank writes ``<out>/rank<N>.json``: every step's wall time (a barrier
before and after it) and this process's CPU time in it, whether the optimizer communicated
compressed in it, and the bytes its network interface (``--iface``,
``/sys/class/net/<iface>/statistics``) sent and received in it and over the timed steps as
a whole.

Models (fp32, one thread per rank):
    gpt   the reference GPT of ``examples/gpt.py`` (27.4M parameters), micro-batch 2 x 128
    wide  two wide Linear layers, 4096 -> 3328 -> 4096 with a GeLU (27.3M parameters),
          micro-batch 1: a few MFLOP per step, so its step is the optimizer's communication

With ``--probe-mb M`` the rank times ``--steps`` all-reduces of an M MB fp32 tensor instead
(the parent's check of the link's cap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

import deepshard  # noqa: E402

SEED = 1234
LR = 1e-4
MICRO_BATCH = {"gpt": 2, "wide": 1}
WIDE_IN, WIDE_HIDDEN = 4096, 3328


class Wide(nn.Module):
    """Two wide Linear layers and an MSE loss: many parameters, next to no FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDE_IN, WIDE_HIDDEN)
        self.down = nn.Linear(WIDE_HIDDEN, WIDE_IN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.gelu(self.up(x))), y)


def optimizer_section(name: str, freeze: int, zo: dict) -> dict:
    """The config's ``optimizer`` section for ``adam``, ``onebit`` or ``zoadam``."""
    if name == "adam":
        return {"type": "Adam", "params": {"lr": LR}}
    if name == "onebit":
        return {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze}}
    return {"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": freeze, **zo}}


def build(args: argparse.Namespace):
    """(model, batch(step) -> (x, y), engine, optimizer) for this rank."""
    deepshard.init_distributed()
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = MICRO_BATCH[args.model]
    if args.model == "gpt":
        model = gpt.GPT(gpt.GPTConfig())
        corpus = gpt.stdlib_corpus()

        def batch(step: int):
            indices = gpt.rank_indices(step, 0, rank, world, micro, 1)
            return gpt.sample_batch(corpus, indices, SEED, model.cfg.seq_len)
    else:
        model = Wide()

        def batch(step: int):
            g = torch.Generator().manual_seed(SEED + step * world + rank)
            return (torch.randn(micro, WIDE_IN, generator=g),
                    torch.randn(micro, WIDE_IN, generator=g))
    zo = json.loads(args.zoadam_params)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
              "optimizer": optimizer_section(args.optimizer, args.freeze_step, zo),
              "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
    engine, optimizer, _, _ = deepshard.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    return model, batch, engine, getattr(optimizer, "optimizer", optimizer)


class Wire:
    """This host's interface counters (``tx_bytes``, ``rx_bytes``); zeros without it."""

    def __init__(self, iface: str) -> None:
        self.folder = Path("/sys/class/net") / iface / "statistics"

    def read(self) -> tuple[int, int]:
        try:
            return (int((self.folder / "tx_bytes").read_text()),
                    int((self.folder / "rx_bytes").read_text()))
        except OSError:
            return (0, 0)


def compressed_next(optimizer) -> bool | None:
    """Whether the optimizer's coming step communicates compressed (None: not a 1-bit one)."""
    probe = getattr(optimizer, "communicates_next_step", None)
    return bool(probe()) if callable(probe) else None


def phase(optimizer) -> dict:
    """What the optimizer says of the step it just took, where it says it: the bytes it sent,
    its step count and schedule, whether 0/1 Adam's variance was frozen in it."""
    out = {}
    sent = getattr(optimizer, "last_bytes_sent", None)
    if isinstance(sent, int):
        out["last_bytes_sent"] = sent
    in_sync = getattr(optimizer, "params_in_sync", None)
    if callable(in_sync):
        out["params_in_sync"] = bool(in_sync())
    state = next(iter(optimizer.state.values()), {})
    for key in ("step", "var_interval", "local_step_interval"):
        if isinstance(state.get(key), int):
            out[key] = state[key]
    frozen = getattr(optimizer, "frozen", None)
    if callable(frozen) and "step" in out:
        out["var_frozen"] = bool(frozen(out["step"]))
    return out


def train(args: argparse.Namespace) -> dict:
    """Run the steps; this rank's record."""
    model, batch, engine, optimizer = build(args)
    wire = Wire(args.iface)
    total = args.pre + args.warmup + args.steps
    steps = []
    window_start = None
    for step in range(total):
        x, y = batch(step)
        compressed = compressed_next(optimizer)
        dist.barrier()
        if step == total - args.steps:
            window_start = wire.read()
        before = wire.read()
        start, cpu = time.perf_counter(), time.process_time()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = wire.read()
        steps.append({"step": step, "s": elapsed, "cpu_s": cpu, "compressed": compressed,
                      "loss": float(loss.detach()), "tx": after[0] - before[0],
                      "rx": after[1] - before[1], "phase": phase(optimizer)})
    window_end = wire.read()
    return {"rank": dist.get_rank(), "model": args.model, "optimizer": args.optimizer,
            "optimizer_class": type(optimizer).__name__,
            "params": sum(p.numel() for p in model.parameters()),
            "timed_from": total - args.steps, "steps": steps,
            "window_tx": window_end[0] - window_start[0],
            "window_rx": window_end[1] - window_start[1]}


def probe(args: argparse.Namespace) -> dict:
    """Time ``args.steps`` all-reduces of ``args.probe_mb`` MB (after one untimed)."""
    deepshard.init_distributed()
    wire = Wire(args.iface)
    tensor = torch.ones(int(args.probe_mb * 1e6) // 4)
    dist.all_reduce(tensor)
    times, tx, rx = [], [], []
    for _ in range(args.steps):
        dist.barrier()
        before = wire.read()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
        after = wire.read()
        tx.append(after[0] - before[0])
        rx.append(after[1] - before[1])
    return {"rank": dist.get_rank(), "bytes": tensor.numel() * 4, "s": times, "tx": tx, "rx": rx}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    parser.add_argument("--model", choices=("gpt", "wide"), default="wide")
    parser.add_argument("--optimizer", choices=("adam", "onebit", "zoadam"), default="adam")
    parser.add_argument("--freeze-step", type=int, default=2,
                        help="freeze_step (1-bit Adam) or var_freeze_step (0/1 Adam)")
    parser.add_argument("--zoadam-params", default="{}",
                        help="JSON of ZeroOneAdam's other params")
    parser.add_argument("--pre", type=int, default=0, help="steps before the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--probe-mb", type=float, default=0.0)
    parser.add_argument("--iface", default="eth0")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    result = probe(args) if args.probe_mb else train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank{result['rank']}.json"
    path.write_text(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
