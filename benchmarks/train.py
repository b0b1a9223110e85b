"""Training step time and peak memory per rank: deepshard against DDP and DeepSpeed, on CPU.

Every peer trains the same model on the same batches: the reference GPT of
``examples/gpt.py`` (27.4M parameters, fp32), 2 ranks on this machine with one thread
each, micro-batch 4 per rank, sequence 128, no gradient accumulation, AdamW (lr 1e-4,
weight decay 0.01). Each peer runs as 2 fresh worker processes (this script with
``--worker``), one peer after another; a worker does ``--warmup`` steps, then ``--steps``
timed steps with a barrier before and after each, and reports its step times and its peak
RSS as one JSON line. The table gives rank 0's median step time and the ratio to DDP.

    python benchmarks/train.py [--steps 10] [--warmup 3] [--peers ddp,deepspeed]

Peers:
    deepshard             deepshard.initialize, ZeRO stage 0
    ddp                   torch DistributedDataParallel (gloo), torch.optim.AdamW as users
                          write it (on CPU that is the per-tensor for-loop implementation)
    ddp-fused             the same with AdamW(fused=True), to show the optimizer's share
    deepspeed             deepspeed.initialize, ZeRO stage 0, the optimizer DeepSpeed picks
                          for "AdamW" (on CPU: its FusedAdam C++ op)
    deepspeed-torch-adam  the same with "torch_adam": true (torch.optim.AdamW)

DeepSpeed 0.19.8 clips gradients to norm 1.0 unless ``gradient_clipping`` says otherwise
(and deepshard follows it); the config here sets it to 0, so that every peer does the same
work as DDP, which does not clip, and all peers print the same losses.

The machine's noise (another process, frequency changes) is a few percent; ``--rounds R``
runs the whole peer list R times, in rotated order, and each peer's median is over the
timed steps of all its rounds.

The DeepSpeed peers run with another interpreter (``--deepspeed-python``, default
/tmp/dsvenv/bin/python): one where ``import deepspeed`` works, with the same torch. They are
skipped, with the reason, when it cannot import deepspeed. Workers are started directly
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (no launcher), so launch cost is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from record import RESULTS, Run  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
WORLD = 2
MICRO_BATCH = 4
SEED = 1234
OPTIMIZER_PARAMS = {"lr": 1e-4, "weight_decay": 0.01}
DS_CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": OPTIMIZER_PARAMS},
             "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}
DEFAULT_DS_PYTHON = "/tmp/dsvenv/bin/python"


@dataclass(frozen=True)
class Peer:
    """One row of the table: a library and how it is set up."""

    name: str
    runtime: str
    """``deepshard``, ``ddp`` or ``deepspeed``: which library the worker trains with."""
    note: str
    fused: bool = False
    torch_adam: bool = False

    @property
    def foreign(self) -> bool:
        """Runs with the DeepSpeed interpreter."""
        return self.runtime == "deepspeed"


PEERS = {p.name: p for p in (
    Peer("deepshard", "deepshard", "stage 0"),
    Peer("ddp", "ddp", "gloo, AdamW default"),
    Peer("ddp-fused", "ddp", "gloo, AdamW(fused=True)", fused=True),
    Peer("deepspeed", "deepspeed", "stage 0, DeepSpeed's optimizer"),
    Peer("deepspeed-torch-adam", "deepspeed", "stage 0, torch_adam",
         torch_adam=True),
)}


# ---------------------------------------------------------------- worker (one rank)

def worker(peer: Peer, steps: int, warmup: int) -> None:
    """Train as one rank of ``peer`` and print the result line (imports only what it needs)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig())
    params = sum(p.numel() for p in model.parameters())
    train_step, optimizer = _build(peer, model)
    timed_steps(peer.name, model, train_step, optimizer, params, steps, warmup)


def timed_steps(name: str, model, train_step, optimizer: str, params: int, steps: int,
                warmup: int, extra=None) -> None:
    """Run ``warmup`` then ``steps`` timed steps of ``train_step(x, y)`` on this rank's
    batches (a barrier before and after each) and print the result line (the warm-up
    steps' times too, as ``warmup_s``, and the dict ``extra()`` returns after the last
    step, when given); shared by the benchmarks that train the example GPT."""
    import gpt
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    corpus, seq_len = gpt.stdlib_corpus(), model.cfg.seq_len
    times, losses = [], []
    for step in range(warmup + steps):
        indices = gpt.rank_indices(step, 0, rank, world, MICRO_BATCH, 1)
        x, y = gpt.sample_batch(corpus, indices, SEED, seq_len)
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(x, y)
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    result = {"peer": name, "rank": rank, "step_s": times[warmup:], "warmup_s": times[:warmup],
              "params": params,
              "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "optimizer": optimizer, "losses": losses, "torch": torch.__version__,
              "backend": dist.get_backend(), **(extra() if extra else {})}
    print(RESULT_TAG + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _build(peer: Peer, model):
    """(one training step returning the loss, optimizer class name) for ``peer``."""
    if peer.runtime == "ddp":
        return _build_ddp(model, fused=peer.fused)
    if peer.runtime == "deepshard":
        import deepshard as library
        config = DS_CONFIG
    else:
        import deepspeed as library
        params = {**OPTIMIZER_PARAMS, "torch_adam": True} if peer.torch_adam else OPTIMIZER_PARAMS
        config = {**DS_CONFIG, "optimizer": {"type": "AdamW", "params": params}}
    library.init_distributed()
    engine, optimizer, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                                 config=config)

    def train_step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return train_step, _optimizer_label(getattr(optimizer, "optimizer", optimizer))


def _build_ddp(model, *, fused: bool):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), **OPTIMIZER_PARAMS,
                                  **({"fused": True} if fused else {}))

    return torch_train_step(ddp, optimizer), _optimizer_label(optimizer)


def torch_train_step(module, optimizer):
    """``train_step(x, y)`` as plain torch users write it: zero the grads, forward,
    backward, step; returns the detached loss."""

    def train_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = module(x, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return train_step


def _optimizer_label(optimizer) -> str:
    """The class name, and which torch implementation when it is torch's."""
    defaults = getattr(optimizer, "defaults", {})
    kind = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else ""
    return f"{type(optimizer).__name__}({kind})" if kind else type(optimizer).__name__


# ---------------------------------------------------------------- parent (the table)

@dataclass(frozen=True)
class Outcome:
    peer: Peer
    ranks: tuple[dict, ...] = ()
    """Each rank's result line, by rank; empty when the peer did not run."""
    why_not: str = ""
    """``skipped: <reason>`` or ``failed: <reason>`` when the peer has no result."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.ranks[0]["step_s"])


def run_peer(peer: Peer, python: str, args: argparse.Namespace) -> Outcome:
    """Start the peer's ranks, wait for them, and collect their result lines.

    When one rank fails the others are killed at once (they would wait at a barrier).
    """
    from deepshard.launcher.cli import free_port

    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix=f"bench-{peer.name}-") as tmp:
        procs = [_start_rank(peer, python, rank, port, args, Path(tmp)) for rank in range(WORLD)]
        codes = wait_all(procs, args.timeout)
        if None in codes and all(code in (None, 0) for code in codes):
            return Outcome(peer, why_not=f"failed: timed out after {args.timeout:.0f} s")
        return _collect(peer, procs, Path(tmp))


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes once all succeeded or one failed; None for those still running at the
    timeout. Whatever still runs is killed before returning (it would wait at a barrier)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]  # every one, to see each exit
        if all(code == 0 for code in codes) or any(code not in (None, 0) for code in codes) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return codes


def error_line(stderr: Path) -> str:
    """The one line that says why a worker failed: the last error or exception line of its
    stderr (a traceback's last line, ``deepshard: error: ...``), else the last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip())  # torch's prefix on tracebacks
             for line in stderr.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0] or "error:" in line
              or "Exception" in line.split(":", 1)[0]]
    line = (errors or lines or ["(no output on stderr)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def _start_rank(peer: Peer, python: str, rank: int, port: int, args: argparse.Namespace,
                tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if peer.foreign:
        env["DS_ACCELERATOR"] = "cpu"
    argv = [python, str(Path(__file__).resolve()), "--worker", peer.name,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with open(tmp / f"{rank}.out", "w") as out, open(tmp / f"{rank}.err", "w") as err:
        return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)


def _collect(peer: Peer, procs: list[subprocess.Popen], tmp: Path) -> Outcome:
    # the rank that failed first, not one we killed for it
    failed = sorted((p.returncode == -signal.SIGKILL, rank)
                    for rank, p in enumerate(procs) if p.returncode != 0)
    if failed:
        rank = failed[0][1]
        err = (tmp / f"{rank}.err").read_text(errors="replace").strip().splitlines()
        return Outcome(peer, why_not=f"failed: rank {rank} exited {procs[rank].returncode}: "
                                     + " | ".join(err[-3:]))
    ranks = []
    for rank in range(len(procs)):
        out = (tmp / f"{rank}.out").read_text(errors="replace").splitlines()
        lines = [line for line in out if line.startswith(RESULT_TAG)]
        if not lines:
            return Outcome(peer, why_not=f"failed: rank {rank} exited without a result line")
        ranks.append(json.loads(lines[-1][len(RESULT_TAG):]))
    return Outcome(peer, tuple(ranks))


def deepspeed_version(python: str) -> tuple[str | None, str]:
    """(``deepspeed x / torch y``, "") when ``python`` can import deepspeed, else (None, why)."""
    if not Path(python).exists():
        return None, f"{python} not found (--deepspeed-python)"
    probe = subprocess.run(
        [python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return None, f"{python} cannot import deepspeed: {probe.stderr.strip().splitlines()[-1]}"
    ds, torch_version = probe.stdout.split()[-2:]
    return f"deepspeed {ds}, torch {torch_version}", ""


def deepshard_missing() -> str:
    """Why the deepshard peer cannot run here, or ""."""
    try:
        from deepshard import initialize  # noqa: F401
    except (ImportError, AttributeError) as error:
        return f"deepshard.initialize is not available: {error}"
    return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def table(outcomes: list[Outcome]) -> list[str]:
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    baseline = ran["ddp"].median_s if "ddp" in ran else None
    lines = ["| peer | s/step (median) | vs DDP | peak RSS rank0 / rank1 (MiB) | params | notes |",
             "|---|---:|---:|---:|---:|---|"]
    for o in outcomes:
        if not o.ranks:
            lines.append(f"| {o.peer.name} | - | - | - | - | {o.why_not} |")
            continue
        first = o.ranks[0]
        ratio = f"{o.median_s / baseline:.2f}" if baseline else "-"
        rss = " / ".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in o.ranks)
        note = (f"{o.peer.note}; optimizer {first['optimizer']}, {first['backend']}; "
                f"min {min(first['step_s']):.3f} max {max(first['step_s']):.3f} s; "
                f"last loss {first['losses'][-1]:.4f}")
        lines.append(f"| {o.peer.name} | {o.median_s:.3f} | {ratio} | {rss} | "
                     f"{first['params'] / 1e6:.1f}M | {note} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {', '.join(PEERS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter that can import deepspeed")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per peer")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the peer list this many times, rotating its order")
    parser.add_argument("--json", type=Path, help="also write every rank's raw result here")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, train.json")
    parser.add_argument("--worker", choices=sorted(PEERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(PEERS[args.worker], args.steps, args.warmup)
        return
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        parser.error(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")

    ds_label, ds_missing = deepspeed_version(args.deepspeed_python)

    def missing(peer: Peer) -> str:
        return ds_missing if peer.foreign else deepshard_missing() if peer.name == "deepshard" \
            else ""

    record = Run("train", {"peers": names, "steps": args.steps, "warmup": args.warmup,
                           "rounds": args.rounds, "world": WORLD, "threads_per_rank": 1,
                           "micro_batch": MICRO_BATCH, "seq_len": 128, "deepspeed": ds_label})
    outcomes = run_rounds([PEERS[n] for n in names], args, run_peer, missing)
    print_report(args, outcomes, ds_label)
    record.write(rows(outcomes), table(outcomes), args.results)


def rows(outcomes: list[Outcome]) -> list[dict]:
    """The table's numbers per peer, unformatted, for ``benchmarks/results/train.json``."""
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    ddp = ran["ddp"].median_s if "ddp" in ran else None
    out = []
    for o in outcomes:
        p = o.peer
        row = {"peer": p.name, "runtime": p.runtime, "fused": p.fused,
               "torch_adam": p.torch_adam, "note": p.note, "status": o.why_not or "ok"}
        if o.ranks:
            first = o.ranks[0]
            row.update(median_s=o.median_s, min_s=min(first["step_s"]),
                       max_s=max(first["step_s"]), step_s=first["step_s"],
                       vs_ddp=o.median_s / ddp if ddp else None,
                       peak_rss_mib=[r["peak_rss_kib"] / 1024 for r in o.ranks],
                       final_loss=first["losses"][-1], optimizer=first["optimizer"],
                       params=first["params"])
        out.append(row)
    return out


def run_rounds(peers: list, args: argparse.Namespace, run, missing) -> list[Outcome]:
    """Every peer once per round (``args.rounds``, each round starting one peer later),
    merged per peer in the order given. ``run(peer, python, args)`` runs one, with the
    DeepSpeed interpreter for ``peer.foreign`` ones; a peer for which ``missing(peer)``
    gives a reason is skipped with it."""
    runs: dict[str, list[Outcome]] = {peer.name: [] for peer in peers}
    for round_ in range(max(1, args.rounds)):
        shift = round_ % len(peers)
        for peer in peers[shift:] + peers[:shift]:
            why = missing(peer)
            if why:
                print(f"skipping {peer.name}: {why}", file=sys.stderr)
                runs[peer.name].append(Outcome(peer, why_not=f"skipped: {why}"))
                continue
            print(f"round {round_ + 1}: running {peer.name} ...", file=sys.stderr, flush=True)
            python = args.deepspeed_python if peer.foreign else sys.executable
            outcome = run(peer, python, args)
            if outcome.why_not:
                print(f"{peer.name} {outcome.why_not}", file=sys.stderr)
            runs[peer.name].append(outcome)
    return [merge(runs[peer.name]) for peer in peers]


def merge(outcomes: list[Outcome]) -> Outcome:
    """One peer's rounds as one outcome: all timed steps, the highest peak RSS per rank."""
    ran = [o for o in outcomes if o.ranks]
    if not ran:
        return outcomes[0]
    ranks = []
    for rank in range(len(ran[0].ranks)):
        results = [o.ranks[rank] for o in ran]
        ranks.append({**results[-1],
                      "step_s": [t for r in results for t in r["step_s"]],
                      "peak_rss_kib": max(r["peak_rss_kib"] for r in results)})
    return Outcome(ran[0].peer, tuple(ranks))


def print_report(args: argparse.Namespace, outcomes: list[Outcome], ds_label: str | None) -> None:
    import torch

    print(f"GPT reference size (examples/gpt.py GPTConfig()), fp32, {WORLD} ranks on CPU, "
          f"1 thread each, micro-batch {MICRO_BATCH}/rank, seq 128, gas 1, AdamW lr 1e-4 wd 0.01; "
          f"no clipping; median of {args.rounds} rounds x {args.steps} steps after "
          f"{args.warmup} warm-up each, barrier before and after each step; rank 0's times")
    print(f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"Python {platform.python_version()}, torch {torch.__version__}"
          + (f"; DeepSpeed peers: {ds_label} ({args.deepspeed_python})" if ds_label else ""))
    print()
    print("\n".join(table(outcomes)))
    if args.json:
        args.json.write_text(json.dumps([{"peer": o.peer.name, "ranks": o.ranks,
                                          "skipped": o.why_not} for o in outcomes], indent=1))

if __name__ == "__main__":
    main()
