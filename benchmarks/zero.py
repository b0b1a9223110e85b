"""ZeRO step time and peak memory per rank: deepshard against DDP, FSDP2 and DeepSpeed, on CPU.

The setup is ``benchmarks/train.py``'s, whose helpers this script imports: the reference
GPT of ``examples/gpt.py`` (27.4M parameters, fp32), 2 ranks on this machine with one
thread each (gloo), micro-batch 4 per rank, sequence 128, no gradient accumulation, AdamW
(lr 1e-4, weight decay 0.01), no gradient clipping (``"gradient_clipping": 0``), the same
batches for every peer. Each peer runs as 2 fresh worker processes, one peer after another;
the table gives rank 0's median step time, its ratio to DDP and to the DeepSpeed peer of
the same ZeRO setup, each rank's peak RSS and the last step's loss (the same for every
peer, up to rounding, when they all compute the same thing; the script says if not).

    python benchmarks/zero.py [--steps 10] [--warmup 3] [--rounds 3] [--peers ddp,fsdp2]
    python benchmarks/zero.py --adam [--adam-numel 27369472,273694720] [--adam-steps 20]
    python benchmarks/zero.py --compile [--stages 0,1,2,3] [--steps 10] [--rounds 3]

Peers:
    ddp, ddp-fused          torch DistributedDataParallel, torch.optim.AdamW as users write it
                            (on CPU the per-tensor for-loop), and with fused=True
    compute-floor           no data parallelism at all: each rank trains its own copy on its
                            own batches with torch.optim.AdamW(fused=True) and never
                            communicates (a gloo group only for the timing barriers), both
                            ranks at once on the same cores: what a step costs with zero
                            communication overhead, the bound no ZeRO implementation here
                            can beat. Its loss differs from the others' (each rank averages
                            only its own batch) and is left out of the loss check.
    fsdp2, fsdp2-fused      torch.distributed.fsdp.fully_shard on each block, then the root
                            (DTensor parameters sharded over both ranks, reduce-scatter on
                            gloo), torch.optim.AdamW as users write it (the for-loop again:
                            torch picks foreach only for accelerator tensors), and with
                            fused=True (foreach=True works on CPU DTensors too)
    deepspeed-zN[-offload]  deepspeed.initialize, zero_optimization.stage N; ``-offload``
                            adds offload_optimizer {"device": "cpu"} (and, for stage 3,
                            offload_param {"device": "cpu"}); DeepSpeed's defaults otherwise
    deepshard-zN[-offload]  deepshard.initialize with the same config dict as its DeepSpeed
                            twin. A stage deepshard does not implement yet makes a row
                            ``failed: <its error line>``; the other peers still run.
    *-zN-torchbwd           the same engine driven PyTorch-style: ``loss.backward()`` then
                            ``engine.step()`` (DeepSpeed 0.19.8 accepts it at ZeRO 1-3, not at
                            stage 0): what the engine's output hooks cost

``--compile`` selects another peer set (``COMPILE_PEERS``), compiled training beside eager
(the report, its ratios and targets: ``benchmarks/zero_compile.py``; its record:
``zero_compile.json``):

    ddp-fused               as above (eager), the reference of the loss check
    ddp-compiled            ``model.compile(backend="inductor")``, then DistributedDataParallel
                            of it, AdamW(fused=True): the order PyTorch documents for DDP
                            ("Where to apply torch.compile?": compile the inner module, then
                            wrap; torch.compile handles the DDP wrapper itself poorly)
    deepshard-zN, deepspeed-zN            stage N = 0-3, eager, as above
    deepshard-zN-compiled, deepspeed-zN-compiled
                            the same engine with ``engine.compile(backend="inductor")`` right
                            after ``initialize`` (DeepSpeed's own engine.compile for its twin)

Every peer then does at least ``MIN_COMPILE_WARMUP`` (3) warm-up steps, so that the timed
steps follow compilation and any recompilation of the first steps. The compile time is the
first step's wall time (rank 0, barrier to barrier; the median over rounds): it holds
Dynamo's tracing and Inductor's code generation and C++ builds of the forward and, in the
first backward, of the backward, plus one step's own work. Each worker process of a
compiled peer gets a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (a temporary folder, removed
after the peer), so no peer or round reuses what another compiled: without it all would
share /tmp/torchinductor_$USER and only the first would pay for compiling. Peak RSS is the
rank process's own (``ru_maxrss``), not that of Inductor's compile worker processes.

What DeepSpeed 0.19.8 needs on CPU: nothing in the config. The workers get
``DS_ACCELERATOR=cpu``, as train.py's do, which only spares the probe (without it DeepSpeed
warns that it found no accelerator and picks the CPU anyway). ZeRO 1-3 take fp32 there,
init_distributed picks gloo, no ``torch_adam`` is needed: for ``"type": "AdamW"`` it builds
its own C++ ops with ninja and the system compiler on first use (minutes, inside
initialize, so not in the step times; cached in ~/.cache/torch_extensions): FusedAdam
without offload, DeepSpeedCPUAdam with offload_optimizer, and a shared-memory comm op.

``--adam`` measures instead the optimizer step alone, on one flat fp32 tensor per size with
2 threads (torch.set_num_threads and OMP_NUM_THREADS, which DeepSpeed's op reads): parameter
updates per second (median of ``--adam-steps`` after warm-up) of torch.optim.AdamW
(for-loop, and fused=True) and of deepspeed.ops.adam.DeepSpeedCPUAdam, the optimizer of
DeepSpeed's ZeRO-Offload. Each runs in its own process; DeepSpeedCPUAdam is
checked against torch's AdamW (max difference after 3 steps) before it is timed.

The DeepSpeed peers run with ``--deepspeed-python`` (default /tmp/dsvenv/bin/python), with
the same torch, and are skipped, with the reason, where it cannot import deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from record import RESULTS, Run  # noqa: E402
from train import (  # noqa: E402
    DEFAULT_DS_PYTHON,
    DS_CONFIG,
    MICRO_BATCH,
    OPTIMIZER_PARAMS,
    RESULT_TAG,
    WORLD,
    Outcome,
    _build_ddp,
    _collect,
    _optimizer_label,
    cpu_model,
    deepshard_missing,
    deepspeed_version,
    error_line,
    run_rounds,
    timed_steps,
    torch_train_step,
    wait_all,
)

ZERO_SETUPS = (("z0", 0, False), ("z1", 1, False), ("z2", 2, False), ("z2-offload", 2, True),
               ("z3", 3, False), ("z3-offload", 3, True))
"""(suffix, stage, offload) of the DeepSpeed and deepshard peers."""
COMPILE_STAGES = (0, 1, 2, 3)
"""The ZeRO stages of the ``--compile`` peers."""
COMPILE_BACKEND = "inductor"
MIN_COMPILE_WARMUP = 3
"""Warm-up steps that ``--compile`` runs at least: compilation, then any recompilation."""
LOSS_TOLERANCE = 1e-3
"""Largest difference to DDP's last loss that still counts as the same computation."""
ADAM_THREADS = 2


@dataclass(frozen=True)
class Peer:
    """One row of the table: a library and how it is set up."""

    name: str
    runtime: str
    """``ddp``, ``fsdp2``, ``deepspeed`` or ``deepshard``: what the worker trains with."""
    note: str
    stage: int = 0
    """ZeRO stage, for ``deepspeed`` and ``deepshard``."""
    offload: bool = False
    """Optimizer states (and for stage 3 the parameters) on the CPU, DeepSpeed-style."""
    fused: bool = False
    torch_backward: bool = False
    """``loss.backward()`` instead of ``engine.backward(loss)``."""
    compiled: bool = False
    """``torch.compile`` (inductor): ``engine.compile()`` right after ``initialize`` for
    the engines, ``model.compile()`` before the DDP wrap for DDP."""

    @property
    def same_math(self) -> bool:
        """Computes the data-parallel step every other peer computes (the final losses
        must agree)."""
        return self.runtime != "floor"

    @property
    def foreign(self) -> bool:
        """Runs with the DeepSpeed interpreter."""
        return self.runtime == "deepspeed"

    @property
    def config(self) -> dict:
        """The DeepSpeed-style config dict, the same for DeepSpeed and deepshard."""
        zero: dict = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.offload and self.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        return {**DS_CONFIG, "zero_optimization": zero}

    @property
    def twin(self) -> str | None:
        """The DeepSpeed peer with the same config, which a deepshard row is compared with."""
        return "deepspeed" + self.name.removeprefix("deepshard") \
            if self.runtime == "deepshard" else None


def _peers() -> dict[str, Peer]:
    peers = [Peer("compute-floor", "floor", "each rank alone, no gradient exchange",
                  fused=True),
             Peer("ddp", "ddp", "DistributedDataParallel"),
             Peer("ddp-fused", "ddp", "DistributedDataParallel", fused=True),
             Peer("fsdp2", "fsdp2", "fully_shard per block + root"),
             Peer("fsdp2-fused", "fsdp2", "fully_shard per block + root", fused=True)]
    for suffix, stage, offload in ZERO_SETUPS:
        where = ", offload optimizer" + (" + params" if stage == 3 else "") if offload else ""
        peers += [Peer(f"{runtime}-{suffix}", runtime, f"stage {stage}{where}", stage, offload)
                  for runtime in ("deepspeed", "deepshard")]
    peers += [Peer(f"{runtime}-z{stage}-torchbwd", runtime, f"stage {stage}, loss.backward()",
                   stage, torch_backward=True)
              for stage in (0, 2) for runtime in ("deepspeed", "deepshard")
              if (runtime, stage) != ("deepspeed", 0)]  # DeepSpeed refuses it at stage 0
    return {p.name: p for p in peers}


PEERS = _peers()


def _compile_peers() -> dict[str, Peer]:
    peers = [PEERS["ddp-fused"],
             Peer("ddp-compiled", "ddp", "DistributedDataParallel of model.compile()",
                  fused=True, compiled=True)]
    for stage in COMPILE_STAGES:
        for runtime in ("deepshard", "deepspeed"):
            eager = PEERS[f"{runtime}-z{stage}"]
            peers += [eager, replace(eager, name=f"{eager.name}-compiled",
                                     note=f"stage {stage}, engine.compile()", compiled=True)]
    return {p.name: p for p in peers}


COMPILE_PEERS = _compile_peers()
"""The ``--compile`` peer set: DDP, then per stage deepshard and DeepSpeed, eager and
compiled."""
ALL_PEERS = {**PEERS, **COMPILE_PEERS}


# ---------------------------------------------------------------- worker (one rank)

def worker(peer: Peer, steps: int, warmup: int) -> None:
    """Train as one rank of ``peer`` and print the result line, as train.py's worker does."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig())
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties them
    if peer.compiled and peer.runtime == "ddp":
        model.compile(backend=COMPILE_BACKEND)  # then DDP wraps it: the documented order
    build = {"ddp": lambda: _build_ddp(model, fused=peer.fused),
             "floor": lambda: _build_floor(model),
             "fsdp2": lambda: _build_fsdp2(model, fused=peer.fused)}.get(peer.runtime)
    train_step, optimizer = build() if build else _build_engine(peer, model)
    if build and optimizer == "AdamW":  # torch's default implementation for CPU tensors
        optimizer = "AdamW(for-loop)"
    timed_steps(peer.name, model, train_step, optimizer, params, steps, warmup,
                extra=_dynamo_stats if peer.compiled else None)


def _dynamo_stats() -> dict:
    """What Dynamo compiled in this process: forward graphs and graph breaks (a graph
    break splits the forward into more, smaller graphs, each run with eager code between)."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _build_floor(model):
    """Each rank trains alone (the barriers of ``timed_steps`` are its only collectives)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER_PARAMS, fused=True)

    return torch_train_step(model, optimizer), _optimizer_label(optimizer)


def _build_fsdp2(model, *, fused: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER_PARAMS,
                                  **({"fused": True} if fused else {}))

    return torch_train_step(model, optimizer), _optimizer_label(optimizer)


def _build_engine(peer: Peer, model):
    if peer.runtime == "deepshard":
        import deepshard as library
    else:
        import deepspeed as library
    library.init_distributed()
    engine, optimizer, _, _ = library.initialize(model=model, model_parameters=model.parameters(),
                                                 config=peer.config)
    if peer.compiled:
        engine.compile(backend=COMPILE_BACKEND)

    def train_step(x, y):
        loss = engine(x, y)
        if peer.torch_backward:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        return loss.detach()

    return train_step, _optimizer_label(getattr(optimizer, "optimizer", optimizer))


# ---------------------------------------------------------------- parent (the table)

def run_peer(peer: Peer, python: str, args: argparse.Namespace) -> Outcome:
    """Start the peer's ranks and wait for them; a failure is an outcome, never an exception.

    When one rank fails the others are killed at once (they would wait at a barrier).
    """
    from deepshard.launcher.cli import free_port

    port = free_port("127.0.0.1")
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if peer.foreign:
        env["DS_ACCELERATOR"] = "cpu"
    argv = [python, str(Path(__file__).resolve()), "--worker", peer.name,
            "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix=f"bench-{peer.name}-") as tmp:
        procs = [_spawn(argv, _rank_env(env, rank, peer, Path(tmp)), Path(tmp) / str(rank))
                 for rank in range(WORLD)]
        codes = wait_all(procs, args.timeout)
        if None in codes:
            return Outcome(peer, why_not=f"failed: timed out after {args.timeout:.0f} s")
        # the rank that failed first, not one we killed for it
        failed = sorted((code == -signal.SIGKILL, rank) for rank, code in enumerate(codes)
                        if code != 0)
        if failed:
            rank = failed[0][1]
            line = error_line(Path(tmp) / f"{rank}.err")
            return Outcome(peer, why_not=f"failed: {line} (rank {rank}, exit {codes[rank]})")
        return _collect(peer, procs, Path(tmp))


def _rank_env(env: dict, rank: int, peer: Peer, tmp: Path) -> dict:
    """``env`` for one rank; a compiled peer's rank gets its own empty Inductor cache."""
    ours = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    if peer.compiled:
        ours["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / f"inductor-{rank}")
    return ours


def _spawn(argv: list[str], env: dict, stem: Path) -> subprocess.Popen:
    with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
        return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL)


def table(outcomes: list[Outcome]) -> list[str]:
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    baseline = ran["ddp"].median_s if "ddp" in ran else None
    lines = ["| peer | s/step (median) | vs DDP | vs DeepSpeed | peak RSS rank0 / rank1 (MiB) "
             "| final loss | notes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for o in outcomes:
        if not o.ranks:
            why = o.why_not.replace("|", "\\|")
            lines.append(f"| {o.peer.name} | - | - | - | - | - | {why} |")
            continue
        first, twin = o.ranks[0], ran.get(o.peer.twin or "")
        vs_ddp = f"{o.median_s / baseline:.2f}" if baseline else "-"
        vs_ds = f"{o.median_s / twin.median_s:.2f}" if twin else "-"
        rss = " / ".join(f"{r['peak_rss_kib'] / 1024:.0f}" for r in o.ranks)
        note = (f"{o.peer.note}; optimizer {first['optimizer']}, {first['backend']}; "
                f"min {min(first['step_s']):.3f} max {max(first['step_s']):.3f} s")
        lines.append(f"| {o.peer.name} | {o.median_s:.3f} | {vs_ddp} | {vs_ds} | {rss} | "
                     f"{first['losses'][-1]:.4f} | {note} |")
    return lines


def rows(outcomes: list[Outcome]) -> list[dict]:
    """The table's numbers per peer, unformatted, for ``benchmarks/results/zero.json``."""
    ran = {o.peer.name: o for o in outcomes if o.ranks}
    ddp = ran["ddp"].median_s if "ddp" in ran else None
    out = []
    for o in outcomes:
        p = o.peer
        row = {"peer": p.name, "runtime": p.runtime, "stage": p.stage, "offload": p.offload,
               "fused": p.fused, "torch_backward": p.torch_backward, "note": p.note,
               "twin": p.twin, "status": o.why_not or "ok"}
        if o.ranks:
            first, twin = o.ranks[0], ran.get(p.twin or "")
            row.update(median_s=o.median_s, min_s=min(first["step_s"]),
                       max_s=max(first["step_s"]), step_s=first["step_s"],
                       vs_ddp=o.median_s / ddp if ddp else None,
                       vs_deepspeed=o.median_s / twin.median_s if twin else None,
                       peak_rss_mib=[r["peak_rss_kib"] / 1024 for r in o.ranks],
                       final_loss=first["losses"][-1], optimizer=first["optimizer"],
                       params=first["params"])
        out.append(row)
    return out


def loss_check(outcomes: list[Outcome]) -> str:
    """One line: do all peers that ran end with the same loss (rank 0, last step)?"""
    finals = {o.peer.name: o.ranks[0]["losses"][-1] for o in outcomes
              if o.ranks and o.peer.same_math}
    if len(finals) < 2:
        return "final losses: fewer than 2 peers ran, nothing to compare"
    reference = finals.get("ddp", finals.get("ddp-fused", next(iter(finals.values()))))
    off = {name: loss for name, loss in finals.items() if abs(loss - reference) > LOSS_TOLERANCE}
    spread = max(finals.values()) - min(finals.values())
    if not off:
        return (f"final losses: all {len(finals)} peers that ran agree within {spread:.1e} "
                f"(tolerance {LOSS_TOLERANCE:g})")
    listed = ", ".join(f"{name} {loss:.6f}" for name, loss in off.items())
    return f"final losses DIFFER from {reference:.6f} by more than {LOSS_TOLERANCE:g}: {listed}"


def _missing(args: argparse.Namespace):
    """(``missing(peer)``: why it cannot run here or "", the DeepSpeed label or None)."""
    ds_label, ds_missing = deepspeed_version(args.deepspeed_python)
    ds_missing_library = deepshard_missing()

    def missing(peer: Peer) -> str:
        return ds_missing if peer.foreign \
            else ds_missing_library if peer.runtime == "deepshard" else ""

    return missing, ds_label


def _settings(args: argparse.Namespace, names: list[str], ds_label: str | None) -> dict:
    return {"peers": names, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "world": WORLD, "threads_per_rank": 1, "micro_batch": MICRO_BATCH, "seq_len": 128,
            "deepspeed": ds_label}


def run_training(args: argparse.Namespace, names: list[str]) -> None:
    missing, ds_label = _missing(args)
    run = Run("zero", _settings(args, names, ds_label))
    outcomes = run_rounds([PEERS[name] for name in names], args, run_peer, missing)
    _print_header(args, ds_label)
    lines = table(outcomes)
    print("\n".join(lines))
    print()
    print(loss_check(outcomes))
    run.write(rows(outcomes), lines, args.results)
    _write_json(args, outcomes)


def run_compiled(args: argparse.Namespace, names: list[str]) -> None:
    """``--compile``: the compile peer set, with at least ``MIN_COMPILE_WARMUP`` warm-up
    steps; each round's first step time of rank 0 kept aside (the rounds' merge keeps only
    the timed steps of all rounds)."""
    import zero_compile

    args = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, MIN_COMPILE_WARMUP)})
    missing, ds_label = _missing(args)
    run = Run("zero_compile", {**_settings(args, names, ds_label), "backend": COMPILE_BACKEND,
                               "fresh_inductor_cache": True})
    first_steps: dict[str, list[float]] = {name: [] for name in names}

    def run_one(peer: Peer, python: str, args: argparse.Namespace) -> Outcome:
        outcome = run_peer(peer, python, args)
        if outcome.ranks:
            first_steps[peer.name].append(outcome.ranks[0]["warmup_s"][0])
        return outcome

    outcomes = run_rounds([COMPILE_PEERS[name] for name in names], args, run_one, missing)
    _print_header(args, ds_label)
    lines = zero_compile.table(outcomes, first_steps)
    print("\n".join(lines))
    verdicts = ["", loss_check(outcomes), *zero_compile.targets(outcomes)]
    print("\n".join(verdicts))
    run.write(zero_compile.rows(outcomes, first_steps), lines + verdicts, args.results)
    _write_json(args, outcomes)


def _print_header(args: argparse.Namespace, ds_label: str | None) -> None:
    import torch

    print(f"GPT reference size (examples/gpt.py GPTConfig()), fp32, {WORLD} ranks on CPU, "
          f"1 thread each, micro-batch {MICRO_BATCH}/rank, seq 128, gas 1, AdamW lr 1e-4 wd 0.01; "
          f"no clipping; median of {args.rounds} rounds x {args.steps} steps after "
          f"{args.warmup} warm-up each, barrier before and after each step; rank 0's times")
    print(f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"Python {platform.python_version()}, torch {torch.__version__}"
          + (f"; DeepSpeed peers: {ds_label} ({args.deepspeed_python})" if ds_label else ""))
    print()


def _write_json(args: argparse.Namespace, outcomes: list[Outcome]) -> None:
    if args.json:
        args.json.write_text(json.dumps([{"peer": o.peer.name, "ranks": o.ranks,
                                          "skipped": o.why_not} for o in outcomes], indent=1))


# ---------------------------------------------------------------- --adam: the optimizer step

ADAM_IMPLS = {"torch-adamw": "torch.optim.AdamW (for-loop, the CPU default)",
              "torch-adamw-fused": "torch.optim.AdamW(fused=True)",
              "deepspeed-cpu-adam": "deepspeed.ops.adam.DeepSpeedCPUAdam"}


def adam_worker(impl: str, numel: int, steps: int, warmup: int) -> None:
    """Time ``steps`` optimizer steps on one flat tensor and print the result line."""
    import torch

    torch.set_num_threads(ADAM_THREADS)
    result = {"impl": impl, "numel": numel, "threads": torch.get_num_threads()}
    if impl == "deepspeed-cpu-adam":
        result["max_diff"] = _cpu_adam_parity()
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen)
    optimizer = _adam(impl, [param])
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    result["step_s"] = times[warmup:]
    print(RESULT_TAG + json.dumps(result), flush=True)


def _adam(impl: str, params: list):
    import torch

    if impl == "deepspeed-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **OPTIMIZER_PARAMS)
    return torch.optim.AdamW(params, **OPTIMIZER_PARAMS, fused=impl == "torch-adamw-fused")


def _cpu_adam_parity(numel: int = 1 << 20, steps: int = 3) -> float:
    """Largest difference between DeepSpeedCPUAdam's and torch AdamW's parameters."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ours, theirs = (torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(2))
    theirs.data.copy_(ours.data)
    optimizers = [_adam("deepspeed-cpu-adam", [ours]), _adam("torch-adamw", [theirs])]
    for _ in range(steps):
        grad = torch.randn(numel, generator=gen)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    return float((ours.detach() - theirs.detach()).abs().max())


def run_adam(args: argparse.Namespace) -> None:
    ds_label, ds_missing = deepspeed_version(args.deepspeed_python)
    sizes = [int(n) for n in args.adam_numel.split(",") if n.strip()]
    record = Run("zero-adam", {"sizes": sizes, "threads": ADAM_THREADS, "steps": args.adam_steps,
                               "warmup": args.warmup, "deepspeed": ds_label})
    records: list[dict] = []
    lines = ["| optimizer | elements | threads | s/step (median) | G params/s | vs fused | notes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for numel in sizes:
        rows = {impl: _run_adam_impl(impl, numel, args, ds_missing) for impl in ADAM_IMPLS}
        fused = rows["torch-adamw-fused"]
        for impl, row in rows.items():
            records.append({"impl": impl, "numel": numel, "status": row} if isinstance(row, str)
                           else {**row, "status": "ok", "median_s": statistics.median(
                               row["step_s"])})
            if isinstance(row, str):
                lines.append(f"| {impl} | {numel / 1e6:.1f}M | - | - | - | - | {row} |")
                continue
            median = statistics.median(row["step_s"])
            ratio = (f"{statistics.median(fused['step_s']) / median:.2f}"
                     if isinstance(fused, dict) else "-")
            note = ADAM_IMPLS[impl] + (f"; max diff to torch AdamW after 3 steps "
                                       f"{row['max_diff']:.1e}" if "max_diff" in row else "")
            lines.append(f"| {impl} | {numel / 1e6:.1f}M | {row['threads']} | {median:.4f} | "
                         f"{numel / median / 1e9:.2f} | {ratio} | {note} |")
    import torch

    print(f"Optimizer step alone: one flat fp32 tensor, AdamW lr 1e-4 wd 0.01, "
          f"{ADAM_THREADS} threads, median of {args.adam_steps} steps after {args.warmup} "
          f"warm-up; vs fused = speed relative to torch AdamW(fused=True)")
    print(f"{platform.node()}, {os.cpu_count()} cores ({cpu_model()}), "
          f"Python {platform.python_version()}, torch {torch.__version__}"
          + (f"; {ds_label} ({args.deepspeed_python})" if ds_label else ""))
    print()
    print("\n".join(lines))
    record.write(records, lines, args.results)


def _run_adam_impl(impl: str, numel: int, args: argparse.Namespace, ds_missing: str):
    """The worker's result dict, or why there is none (a string)."""
    foreign = impl.startswith("deepspeed")
    if foreign and ds_missing:
        return f"skipped: {ds_missing}"
    print(f"running {impl} on {numel} elements ...", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(ADAM_THREADS),
           "MKL_NUM_THREADS": str(ADAM_THREADS), "DS_ACCELERATOR": "cpu"}
    argv = [args.deepspeed_python if foreign else sys.executable, str(Path(__file__).resolve()),
            "--adam-worker", impl, "--adam-numel", str(numel),
            "--adam-steps", str(args.adam_steps), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix=f"bench-{impl}-") as tmp:
        proc = _spawn(argv, env, Path(tmp) / "0")
        code = wait_all([proc], args.timeout)[0]
        if code is None:
            return f"failed: timed out after {args.timeout:.0f} s"
        if code != 0:
            return f"failed: {error_line(Path(tmp) / '0.err')} (exit {code})"
        out = (Path(tmp) / "0.out").read_text(errors="replace").splitlines()
        lines = [line for line in out if line.startswith(RESULT_TAG)]
        if not lines:
            return "failed: exited without a result line"
        return json.loads(lines[-1][len(RESULT_TAG):])


# ---------------------------------------------------------------- command line

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", help=f"comma-separated subset of {', '.join(PEERS)} "
                        f"(default all); with --compile of {', '.join(COMPILE_PEERS)}")
    parser.add_argument("--stages", help="comma-separated ZeRO stages: only the DeepSpeed and "
                        "deepshard peers of these (default all)")
    parser.add_argument("--compile", action="store_true",
                        help="compiled training beside eager (engine.compile(), "
                             "torch.compile'd DDP) at ZeRO 0-3; record zero_compile.json")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per peer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the peer list this many times, rotating its order")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter that can import deepspeed")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per peer")
    parser.add_argument("--json", type=Path, help="also write every rank's raw result here")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, zero.json, zero_compile.json or "
                             "zero-adam.json (default benchmarks/results)")
    parser.add_argument("--adam", action="store_true",
                        help="measure the CPU Adam step alone instead of training")
    parser.add_argument("--adam-numel", default="27369472,273694720",
                        help="comma-separated tensor sizes for --adam")
    parser.add_argument("--adam-steps", type=int, default=20, help="timed steps for --adam")
    parser.add_argument("--worker", choices=sorted(ALL_PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--adam-worker", choices=sorted(ADAM_IMPLS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(ALL_PEERS[args.worker], args.steps, args.warmup)
    elif args.adam_worker:
        adam_worker(args.adam_worker, int(args.adam_numel), args.adam_steps, args.warmup)
    elif args.adam:
        run_adam(args)
    else:
        names = _selected(parser, args)
        (run_compiled if args.compile else run_training)(args, names)


def _selected(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The peers that ``--peers`` and ``--stages`` name, in the peer set's order for
    ``--peers``' default; a name or stage outside the set is a usage error."""
    peers = COMPILE_PEERS if args.compile else PEERS
    names = [n.strip() for n in (args.peers or ",".join(peers)).split(",") if n.strip()]
    unknown = [n for n in names if n not in peers]
    if unknown:
        parser.error(f"unknown peer {unknown[0]!r}" + (" with --compile" if args.compile else "")
                     + f"; choose from {', '.join(peers)}")
    if args.stages:
        try:
            stages = {int(s) for s in args.stages.split(",") if s.strip()}
        except ValueError:
            parser.error(f"--stages {args.stages!r}: expected comma-separated integers, "
                         "e.g. --stages 2,3")
        if not stages <= {0, 1, 2, 3}:
            parser.error(f"--stages {args.stages!r}: ZeRO stages are 0, 1, 2 and 3")
        names = [n for n in names if peers[n].runtime not in ("deepspeed", "deepshard")
                 or peers[n].stage in stages]
    return names


if __name__ == "__main__":
    main()
