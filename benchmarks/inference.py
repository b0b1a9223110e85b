"""Greedy generation on CPU: deepshard.init_inference beside HF generate and DeepSpeed 0.19.8.

Two model families (``--arch``, ``ARCHS``), tensor parallel 1 and 2, fp32 and int8 weights,
batch 1 and 8.

The models, each built from its config with random weights (``torch.manual_seed(SEED)``)
once and saved as an HF directory (safetensors) in ``--cache-dir``; every peer loads that
directory:

    gpt2   GPT-2 small's shape: ``GPT2Config(n_layer=12, n_embd=768, n_head=12)``,
           vocabulary 50257, 124M parameters
    llama  a LLaMA of about that size: ``LlamaConfig(hidden_size=768,
           intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
           num_key_value_heads=12, vocab_size=32000, max_position_embeddings=512,
           tie_word_embeddings=False)``, 134M parameters. DeepSpeed 0.19.8 cannot run
           GPT-2 at tp 2 on CPU (``inference_deepspeed.py`` says why); its AutoTP does take
           LLaMA, so the tp-2-versus-DeepSpeed target is read from these rows.

The prompt: ``PROMPT_LEN`` (32) random token ids per sequence (seeded), batch 1 and 8; each
generate makes exactly ``--tokens`` (128) new tokens, greedy (``do_sample=False``,
``min_new_tokens = max_new_tokens``).

Peers (``PEERS``), each (arch, tp, dtype, batch) in a fresh launch, one after another:

    hf                one process, ``AutoModelForCausalLM.from_pretrained(dir)``, fp32,
                      ``model.generate``
    deepspeed         ``deepspeed.init_inference(model, tensor_parallel={"tp_size": T},
                      dtype=...)`` on the model each rank loads with from_pretrained (AutoTP,
                      DeepSpeed's default), launched by torch.distributed.run in DeepSpeed's
                      venv (``--deepspeed-python``), DS_ACCELERATOR=cpu
    deepspeed-inject  the same with ``replace_with_kernel_inject=True`` (its fused kernels)
    deepspeed-policy  the same with ``injection_policy={<block>: <its output projections>}``
                      (``Arch.row_parallel``): the manual tensor-parallel policy DeepSpeed
                      documents for models AutoTP does not take
    deepshard         ``deepshard.init_inference(<the model on the meta device>,
                      tensor_parallel={"tp_size": T}, dtype=..., checkpoint=dir)``, the weights
                      read straight into each rank's shard, launched by ``ds-run --num_gpus T``

A configuration that a library refuses at init (DeepSpeed's int8 and its GPT-2 tp 2 on CPU)
is a ``not runnable: <its error>`` row; one that fails at batch 1 is not tried at other
batches. ``inference_worker.py`` is what runs in each launched rank (hf, deepshard and the
model preparation), ``inference_deepspeed.py`` the DeepSpeed rank; ``inference_report.py``
turns the rows into the table, the ratios and the targets' verdicts.

Threads: the ranks of a launch share ``--cores`` (2) cores: OMP_NUM_THREADS = cores / tp
(HF's one process gets them all), set for ds-run and torch.distributed.run alike.

Per configuration (``inference_worker.py`` says how each is measured), rank 0's numbers
unless said otherwise, after a warm-up generate of ``WARMUP_TOKENS`` new tokens, the median
over ``--repeats`` timed generates: first-token latency; tokens/s (batch x tokens / the
generate's wall time); peak RSS per rank and, per rank, the RSS right after the imports
(torch, transformers, the peer's library; before any model) and the part above it, "weights
and work"; whether every new token equals HF's one-process fp32 greedy tokens; top-1
agreement with them and the perplexity of them, teacher-forced (the model is random, so its
own fp32 greedy text is the text: int8 is compared with fp32 on the same tokens).

    make bench-inference                  # = python benchmarks/inference.py
    python benchmarks/inference.py [--arch gpt2,llama] [--only hf,deepspeed,deepshard]
        [--batches 1,8] [--tokens 128] [--repeats 3] [--cores 2] [--quick] [--results DIR]

``--quick``: 2-layer models, GPT-2 64 wide and LLaMA 128 (the same vocabularies), 8 new
tokens, one timed generate: what a smoke run uses. The record goes to
``benchmarks/results/inference.json`` (``benchmarks/record.py``; with ``--quick`` to
``$TMPDIR/deepshard-bench/results``); ``python benchmarks/plot.py --only inference`` draws
``docs/plots/inference.png`` from it.
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
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import inference_report as report  # noqa: E402
from inference_worker import ARCHS, SEED, WARMUP_TOKENS, Setup  # noqa: E402  (torch-free)
from record import RESULTS, Run  # noqa: E402

DEFAULT_DS_PYTHON = "/tmp/dsvenv/bin/python"
WORKER = HERE / "inference_worker.py"
DS_WORKER = HERE / "inference_deepspeed.py"
STOP_GRACE_S = 30.0
"""How long a launcher that timed out gets to stop its workers before it is killed."""
QUICK_RESULTS = Path(tempfile.gettempdir()) / "deepshard-bench" / "results"
"""Where ``--quick`` writes its record unless ``--results`` says otherwise: a smoke run must
not replace the checked-in ``benchmarks/results/inference.json``."""


@dataclass(frozen=True)
class Peer:
    """One library set up one way: the rows it makes are its setups at every arch and
    batch."""

    name: str
    runtime: str
    """``hf``, ``deepspeed`` or ``deepshard``: which worker runs it."""
    setups: tuple[tuple[int, str], ...]
    """(tp, dtype) pairs it is measured at."""
    note: str
    variant: str = ""
    """For ``deepspeed``: ``autotp``, ``inject`` or ``policy`` (``inference_deepspeed.py``)."""


PEERS = {p.name: p for p in (
    Peer("hf", "hf", ((1, "fp32"),), "HF generate, one process"),
    Peer("deepspeed", "deepspeed", ((1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")),
         "init_inference, AutoTP", "autotp"),
    Peer("deepspeed-inject", "deepspeed", ((2, "fp32"),),
         "init_inference, replace_with_kernel_inject=True", "inject"),
    Peer("deepspeed-policy", "deepspeed", ((2, "fp32"),),
         "init_inference, injection_policy {block: its output projections}", "policy"),
    Peer("deepshard", "deepshard", ((1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")),
         "init_inference(meta model, checkpoint=dir)"),
)}


def make_setup(arch: str, args: argparse.Namespace) -> Setup:
    """The arch's setup from the command line (``--quick``'s sizes and defaults)."""
    spec = ARCHS[arch]
    return Setup(arch=arch, model=spec.quick if args.quick else spec.model,
                 tokens=args.tokens or (8 if args.quick else 128),
                 batches=tuple(args.batches), repeats=args.repeats or (1 if args.quick else 3),
                 cores=args.cores, warmup_tokens=2 if args.quick else WARMUP_TOKENS)


@dataclass(frozen=True)
class RunSpec:
    """One launch: one row of the table."""

    arch: str
    peer: str
    tp: int
    dtype: str
    batch: int

    @property
    def config(self) -> tuple[str, str, int, str]:
        """What a refusal at init depends on: everything but the batch."""
        return (self.arch, self.peer, self.tp, self.dtype)


def plan(arch: str, names: list[str], batches: tuple[int, ...]) -> list[RunSpec]:
    """Every setup of every peer named, at every batch, peer by peer, on ``arch``."""
    return [RunSpec(arch, name, tp, dtype, batch) for name in names
            for tp, dtype in PEERS[name].setups for batch in batches]


def threads(cores: int, tp: int) -> int:
    """OMP threads per rank when ``tp`` ranks share ``cores`` cores."""
    return max(1, cores // tp)


def carried_status(spec: RunSpec, failed: dict[tuple, tuple[int, str]]) -> str | None:
    """The status of ``spec`` without launching it, when the same arch, peer, tp and dtype
    already failed at an earlier batch (``failed``: ``RunSpec.config`` -> (batch, status)):
    a library's refusal at init is the same at every batch; anything else is not tried
    again."""
    if spec.config not in failed:
        return None
    batch, status = failed[spec.config]
    return status if status.startswith("not runnable") else \
        f"skipped: it failed at batch {batch}: {status}"


def base_row(spec: RunSpec, tokens: int) -> dict:
    """What every row has, whether it ran or not."""
    peer = PEERS[spec.peer]
    return {"arch": spec.arch, "peer": spec.peer, "runtime": peer.runtime, "note": peer.note,
            "tp": spec.tp, "dtype": spec.dtype, "batch": spec.batch, "tokens": tokens}


def collect(results: list[dict], code: int, log: Path, spec: RunSpec, setup: Setup) -> dict:
    """The row's numbers from the ranks' result files; or its status, from the first rank
    that reported one that is not ``ok``, else from the launcher's log."""
    bad = [r for r in sorted(results, key=lambda r: r["rank"]) if r["status"] != "ok"]
    if bad:
        return {"status": bad[0]["status"] + (f" (rank {bad[0]['rank']})" if spec.tp > 1
                                              else "")}
    if code != 0 or len(results) != spec.tp:
        return {"status": f"failed: exit {code}, {len(results)} of {spec.tp} rank results: "
                          f"{last_error(log)}"}
    ranks = sorted(results, key=lambda r: r["rank"])
    first = ranks[0]
    wall = statistics.median(first["wall_s"])
    peak = [r["peak_rss_kib"] / 1024 for r in ranks]
    imports = [r["import_rss_kib"] / 1024 for r in ranks]
    return {"status": "ok", "first_token_ms": statistics.median(first["first_token_s"]) * 1000,
            "tokens_per_s": spec.batch * setup.tokens / wall, "wall_s": first["wall_s"],
            "first_token_s": first["first_token_s"], "peak_rss_mib": peak,
            "import_rss_mib": imports,
            "work_rss_mib": [p - i for p, i in zip(peak, imports, strict=True)],
            "tokens_equal_hf": first["first_difference"] is None,
            "first_difference": first["first_difference"],
            "ranks_agree": len({r["first_difference"] for r in ranks}) == 1,
            "agreement": first["agreement"], "perplexity": first["perplexity"],
            "scored_tokens": first["scored_tokens"], "streamed": first["streamed"],
            "load_s": first["load_s"], "threads_per_rank": first["threads"],
            "layers": first["layers"],
            "versions": {k: first[k] for k in ("torch", "transformers", "deepspeed") if k in first}}


def last_error(log: Path) -> str:
    """The launcher log's last error-looking line (ds-run's ``[host:N]`` prefix removed)."""
    lines = [line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
             for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "failed" in line]
    line = (errors or lines or ["(no output)"])[-1].strip()
    return line if len(line) <= 300 else line[:297] + "..."


# ---------------------------------------------------------------- launching

def _argv(spec: RunSpec, args: argparse.Namespace, setup: Setup, out: Path) -> list[str]:
    peer = PEERS[spec.peer]
    worker = ["--model-dir", str(args.cache_dir / setup.model_name), "--setup",
              json.dumps(asdict(setup)), "--tp", str(spec.tp), "--dtype", spec.dtype,
              "--batch", str(spec.batch), "--out", str(out)]
    if peer.runtime == "hf":
        return [sys.executable, str(WORKER), "--worker", "hf", *worker]
    if peer.runtime == "deepshard":
        return [args.ds_run, "--num_gpus", str(spec.tp), str(WORKER), "--worker", "deepshard",
                *worker]
    from deepshard.launcher.cli import free_port

    return [args.deepspeed_python, "-m", "torch.distributed.run", "--nproc_per_node",
            str(spec.tp), "--master_addr", "127.0.0.1", "--master_port",
            str(free_port("127.0.0.1")), str(DS_WORKER), "--variant", peer.variant, *worker]


def launch(spec: RunSpec, args: argparse.Namespace, setup: Setup) -> dict:
    """Run one configuration; the row, whose ``status`` says why it has no numbers."""
    peer = PEERS[spec.peer]
    row = base_row(spec, setup.tokens)
    omp = str(threads(setup.cores, spec.tp))
    env = {**os.environ, "OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": omp}
    if peer.runtime == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory(prefix=f"bench-inference-{spec.peer}-") as tmp:
        log = Path(tmp) / "launch.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(_argv(spec, args, setup, Path(tmp)), env=env, cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        code = wait(proc, args.timeout)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            name = f"{spec.arch}-{spec.peer}-tp{spec.tp}-{spec.dtype}-b{spec.batch}.log"
            (args.logs / name).write_text(log.read_text(errors="replace"))
        if code is None:
            return {**row, "status": f"failed: timed out after {args.timeout:.0f} s"}
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        return {**row, **collect(results, code, log, spec, setup)}


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The launcher's exit code; None when it ran past ``timeout``: then it gets SIGTERM
    (ds-run and torch.distributed.run stop their workers on it, which run in sessions of
    their own), and SIGKILL after ``STOP_GRACE_S``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return None


def deepspeed_missing(python: str) -> tuple[str | None, str]:
    """(``deepspeed x``, "") when ``python`` can import deepspeed, else (None, why)."""
    if not Path(python).exists():
        return None, f"{python} not found (--deepspeed-python)"
    probe = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if line.strip()] or ["(no output)"]
        return None, f"{python} cannot import deepspeed: {lines[-1]}"
    return f"deepspeed {probe.stdout.split()[-1]}", ""


def prepare(setup: Setup, args: argparse.Namespace) -> int:
    """Build the arch's model directory and HF's reference tokens where missing
    (``inference_worker.py --prepare``); its parameter count."""
    folder = args.cache_dir / setup.model_name
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    omp = str(setup.cores)
    prepared = subprocess.run(
        [sys.executable, str(WORKER), "--prepare", "--model-dir", str(folder), "--setup",
         json.dumps(asdict(setup))],
        env={**os.environ, "OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": omp}, cwd=ROOT,
        check=False)
    if prepared.returncode != 0:
        raise SystemExit(f"inference.py: preparing {folder} failed (exit "
                         f"{prepared.returncode}); its traceback is above")
    return json.loads((folder / "bench-model.json").read_text())["params"]


def run_all(specs: list[RunSpec], args: argparse.Namespace, setup: Setup,
            ds_missing: str) -> list[dict]:
    """Every spec's row, launched one after another (``carried_status`` spares some)."""
    rows: list[dict] = []
    failed: dict[tuple, tuple[int, str]] = {}
    for spec in specs:
        status = (f"skipped: {ds_missing}" if PEERS[spec.peer].runtime == "deepspeed"
                  and ds_missing else carried_status(spec, failed))
        if status:
            rows.append({**base_row(spec, setup.tokens), "status": status})
            continue
        print(f"running {spec.arch} {spec.peer} tp {spec.tp} {spec.dtype} batch {spec.batch}"
              " ...", file=sys.stderr, flush=True)
        row = launch(spec, args, setup)
        if row["status"] != "ok":
            print(f"  {row['status']}", file=sys.stderr, flush=True)
            failed[spec.config] = (spec.batch, row["status"])
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the run

def settings(args: argparse.Namespace, setups: list[Setup], params: dict[str, int],
             names: list[str], ds_label: str | None) -> dict:
    first = setups[0]
    return {"quick": args.quick, "archs": [s.arch for s in setups], "seed": SEED,
            "models": {s.arch: {"config": ARCHS[s.arch].config, "kwargs": s.model,
                                "title": s.title, "params": params[s.arch],
                                "model_dir": str(args.cache_dir / s.model_name)}
                       for s in setups},
            "prompt_len": first.prompt_len, "tokens": first.tokens,
            "warmup_tokens": first.warmup_tokens, "repeats": first.repeats,
            "batches": list(first.batches), "cores": first.cores, "peers": names,
            "deepspeed": ds_label,
            "reference": "HF generate, one process, from_pretrained fp32, greedy (--prepare)",
            "perplexity_text": "per row: each sequence's prompt + HF's fp32 greedy "
                               "continuation; perplexity of those continuation tokens and "
                               "top-1 agreement with them, teacher-forced",
            "import_rss": "per rank, VmRSS right after importing torch, transformers (the "
                          "arch's modeling module) and the peer's library, before the model"}


def header(setups: list[Setup], params: dict[str, int], ds_label: str | None,
           ds_python: str) -> list[str]:
    s = setups[0]
    models = "; ".join(f"{x.arch}: {x.title} ({params[x.arch] / 1e6:.1f}M parameters)"
                       for x in setups)
    return [f"{models}; random weights, seed {SEED}; prompt {s.prompt_len}, {s.tokens} new "
            f"tokens greedy, median of {s.repeats} generate(s) after a {s.warmup_tokens}-token "
            f"warm-up; {s.cores} cores shared by a launch's ranks",
            f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"
            + (f"; {ds_label} ({ds_python})" if ds_label else ""), ""]


def run(args: argparse.Namespace, archs: list[str], names: list[str]) -> None:
    """Prepare each arch, launch every peer on it, print and write the record."""
    setups = [make_setup(arch, args) for arch in archs]
    params = {s.arch: prepare(s, args) for s in setups}
    ds_label, ds_missing = (None, "")
    if any(PEERS[n].runtime == "deepspeed" for n in names):
        ds_label, ds_missing = deepspeed_missing(args.deepspeed_python)
    record = Run("inference", settings(args, setups, params, names, ds_label))
    rows = report.add_ratios([row for s in setups for row in run_all(
        plan(s.arch, names, s.batches), args, s, ds_missing)])
    head = header(setups, params, ds_label, args.deepspeed_python)
    lines = report.table(rows)
    extra = ["", *report.import_baselines(rows), "", *report.targets(rows), "",
             "Module types after init_inference (rank 0):", *report.layers(rows)]
    print("\n".join(head + lines + extra))
    record.write(rows, head + lines + extra,
              args.results or (QUICK_RESULTS if args.quick else RESULTS))


# ---------------------------------------------------------------- command line

def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, "
                                         "e.g. 1,8") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _subset(parser: argparse.ArgumentParser, flag: str, what: str, text: str | None,
            choices: dict) -> list[str]:
    """``text``'s comma-separated names (all of ``choices`` when None), in the order given."""
    names = [n.strip() for n in (text or ",".join(choices)).split(",") if n.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        problem = f"unknown {what} {unknown[0]!r}" if unknown else f"no {what} named"
        parser.error(f"{flag}: {problem}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The options, the archs and the peers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help=f"comma-separated subset of {', '.join(ARCHS)} "
                        "(default all, in that order)")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(PEERS)} "
                        "(default all)")
    parser.add_argument("--batches", type=_csv_ints, default=[1, 8])
    parser.add_argument("--tokens", type=int, help="new tokens per generate (default 128, "
                        "8 with --quick)")
    parser.add_argument("--repeats", type=int, help="timed generates per launch, median "
                        "reported (default 3, 1 with --quick)")
    parser.add_argument("--cores", type=int, default=2,
                        help="cores a launch's ranks share: OMP_NUM_THREADS = cores / tp")
    parser.add_argument("--quick", action="store_true",
                        help="2-layer models and 8 tokens: a smoke run")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "deepshard-bench" / "inference",
                        help="where the model directories and HF's reference tokens are kept")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter that can import deepspeed")
    parser.add_argument("--ds-run", default=str(Path(sys.executable).with_name("ds-run")),
                        help="the ds-run that launches the deepshard peer")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--logs", type=Path, help="keep every launch's output here")
    parser.add_argument("--results", type=Path,
                        help="folder for the record, inference.json (default "
                             f"benchmarks/results; with --quick {QUICK_RESULTS})")
    args = parser.parse_args(argv)
    return (args, _subset(parser, "--arch", "arch", args.arch, ARCHS),
            _subset(parser, "--only", "peer", args.only, PEERS))


def main() -> None:
    run(*parse_args())


if __name__ == "__main__":
    main()
