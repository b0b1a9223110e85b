"""Greedy generation on CPU: deepshard.init_inference beside HF generate and DeepSpeed 0.19.8.

Tensor parallel 1 and 2, fp32 and int8 weights, batch 1 and 8.

The model: GPT-2 small's shape (``GPT2Config(n_layer=12, n_embd=768, n_head=12)``, vocabulary
50257, 124M parameters), random weights (``torch.manual_seed(SEED)``), built from the config
once and saved as an HF directory (safetensors) in ``--cache-dir``; every peer loads that
directory. The prompt: ``PROMPT_LEN`` (32) random token ids per sequence (seeded), batch 1
and 8; each generate makes exactly ``--tokens`` (128) new tokens, greedy
(``do_sample=False``, ``min_new_tokens = max_new_tokens``).

Peers (``PEERS``), each (tp, dtype, batch) in a fresh launch, one after another:

    hf                one process, ``AutoModelForCausalLM.from_pretrained(dir)``, fp32,
                      ``model.generate``
    deepspeed         ``deepspeed.init_inference(model, tensor_parallel={"tp_size": T},
                      dtype=...)`` on the model each rank loads with from_pretrained (AutoTP,
                      DeepSpeed's default), launched by torch.distributed.run in DeepSpeed's
                      venv (``--deepspeed-python``), DS_ACCELERATOR=cpu
    deepspeed-inject  the same with ``replace_with_kernel_inject=True`` (its GPT-2 kernels)
    deepspeed-policy  the same with ``injection_policy={GPT2Block: ("attn.c_proj",
                      "mlp.c_proj")}``: the manual tensor-parallel policy DeepSpeed documents
                      for models AutoTP does not take
    deepshard         ``deepshard.init_inference(<the model on the meta device>,
                      tensor_parallel={"tp_size": T}, dtype=..., checkpoint=dir)``, the weights
                      read straight into each rank's shard, launched by ``ds-run --num_gpus T``

A configuration that a library refuses at init (DeepSpeed's int8 and its tp 2 on CPU) is a
``not runnable: <its error>`` row; one that fails at batch 1 is not tried at other batches.
``benchmarks/inference_deepspeed.py`` is the DeepSpeed worker; ``inference_report.py`` turns
the rows into the table, the ratios and the targets' verdicts.

Threads: the ranks of a launch share ``--cores`` (2) cores: OMP_NUM_THREADS = cores / tp
(HF's one process gets them all), set for ds-run and torch.distributed.run alike.

Per configuration, rank 0's numbers unless said otherwise, after one warm-up generate of
``WARMUP_TOKENS`` new tokens and a barrier before each timed generate (``--repeats``, the
median over them):

* first token (ms): from the ``generate`` call to the streamer's second ``put`` (the first
  put is the prompt, the second the first new token);
* tokens/s: batch x tokens / the generate call's wall time;
* peak RSS per rank: ``ru_maxrss`` of each rank process, taken right after the timed
  generates (the max over ranks is what the targets use);
* tokens = HF: every new token equals HF's (``from_pretrained`` in one process, fp32,
  generated once per batch by ``--prepare`` and kept beside the model as
  ``reference-*.json``); else the position of the first that differs;
* top-1 agreement and perplexity, on HF's text: for each sequence of the batch, its
  prompt plus HF's fp32 greedy continuation, one forward pass (teacher-forced); over the
  ``tokens`` continuation positions, the share where the row's argmax is HF's token (1.0
  for an exact fp32 peer; for int8 its agreement with fp32) and exp(mean negative
  log-likelihood) of HF's tokens. The model is random, so its own fp32 greedy text is the
  text: the int8 perplexity is compared with fp32's on the same token sequence.

    make bench-inference                  # = python benchmarks/inference.py
    python benchmarks/inference.py [--only hf,deepspeed,deepshard] [--batches 1,8]
        [--tokens 128] [--repeats 3] [--cores 2] [--quick] [--results DIR]

``--quick``: a 2-layer, 64-wide GPT-2 (the same vocabulary), 8 new tokens, one timed
generate: what a smoke run uses. The record goes to ``benchmarks/results/inference.json``
(``benchmarks/record.py``; with ``--quick`` to ``$TMPDIR/deepshard-bench/results``); ``python
benchmarks/plot.py --only inference`` draws ``docs/plots/inference.png`` from it.
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
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import inference_report as report  # noqa: E402
from record import RESULTS, Run  # noqa: E402

SEED = 1234
PROMPT_LEN = 32
WARMUP_TOKENS = 4
VOCAB = 50257
MODEL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": VOCAB}
"""GPT-2 small's shape."""
QUICK_MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": VOCAB}
DEFAULT_DS_PYTHON = "/tmp/dsvenv/bin/python"
DS_WORKER = HERE / "inference_deepspeed.py"
STOP_GRACE_S = 30.0
"""How long a launcher that timed out gets to stop its workers before it is killed."""
DTYPES = ("fp32", "int8")
QUICK_RESULTS = Path(tempfile.gettempdir()) / "deepshard-bench" / "results"
"""Where ``--quick`` writes its record unless ``--results`` says otherwise: a smoke run must
not replace the checked-in ``benchmarks/results/inference.json``."""


@dataclass(frozen=True)
class Peer:
    """One library set up one way: the rows it makes are its setups at every batch."""

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
         "init_inference, injection_policy {GPT2Block: c_proj's}", "policy"),
    Peer("deepshard", "deepshard", ((1, "fp32"), (2, "fp32"), (1, "int8"), (2, "int8")),
         "init_inference(meta model, checkpoint=dir)"),
)}


@dataclass(frozen=True)
class Setup:
    """What every launch of one run shares."""

    model: dict
    """``GPT2Config`` keyword arguments."""
    tokens: int
    """New tokens per timed generate."""
    batches: tuple[int, ...]
    repeats: int
    """Timed generates per launch (the median is reported)."""
    cores: int
    """Cores the ranks of a launch share: OMP_NUM_THREADS = cores / tp."""
    prompt_len: int = PROMPT_LEN
    warmup_tokens: int = WARMUP_TOKENS

    @property
    def model_name(self) -> str:
        m = self.model
        return f"gpt2-{m['n_layer']}x{m['n_embd']}h{m['n_head']}-v{m['vocab_size']}-seed{SEED}"

    def reference_name(self, batch: int) -> str:
        """HF's one-process greedy tokens for ``batch``, beside the model."""
        return f"reference-b{batch}-p{self.prompt_len}-n{self.tokens}.json"


@dataclass(frozen=True)
class RunSpec:
    """One launch: one row of the table."""

    peer: str
    tp: int
    dtype: str
    batch: int


def plan(names: list[str], batches: tuple[int, ...]) -> list[RunSpec]:
    """Every setup of every peer named, at every batch, peer by peer."""
    return [RunSpec(name, tp, dtype, batch) for name in names
            for tp, dtype in PEERS[name].setups for batch in batches]


def threads(cores: int, tp: int) -> int:
    """OMP threads per rank when ``tp`` ranks share ``cores`` cores."""
    return max(1, cores // tp)


def first_difference(ours: list[list[int]], reference: list[list[int]]) -> int | None:
    """The first new-token position (0-based) where any sequence differs; None if none."""
    firsts = []
    for seq, ref in zip(ours, reference, strict=True):
        differ = [i for i, (a, b) in enumerate(zip(seq, ref, strict=False)) if a != b]
        if differ or len(seq) != len(ref):
            firsts.append(differ[0] if differ else min(len(seq), len(ref)))
    return min(firsts, default=None)


def carried_status(spec: RunSpec, failed: dict[tuple, tuple[int, str]]) -> str | None:
    """The status of ``spec`` without launching it, when the same peer, tp and dtype already
    failed at an earlier batch (``failed``: (peer, tp, dtype) -> (batch, status)): a library's
    refusal at init is the same at every batch; anything else is not tried again."""
    if (spec.peer, spec.tp, spec.dtype) not in failed:
        return None
    batch, status = failed[(spec.peer, spec.tp, spec.dtype)]
    return status if status.startswith("not runnable") else \
        f"skipped: it failed at batch {batch}: {status}"


def base_row(spec: RunSpec, tokens: int) -> dict:
    """What every row has, whether it ran or not."""
    peer = PEERS[spec.peer]
    return {"peer": spec.peer, "runtime": peer.runtime, "note": peer.note, "tp": spec.tp,
            "dtype": spec.dtype, "batch": spec.batch, "tokens": tokens}


# ---------------------------------------------------------------- worker side (torch)

class Stamps:
    """A ``generate`` streamer that keeps the time of every ``put``: the first put is the
    prompt, each later one a new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def peak_rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def layer_types(module) -> dict[str, str]:
    """``LAYER_NAMES``' module types and weights' shapes and dtypes, e.g.
    ``Conv1D[768x2304 float32]``."""
    named = dict(module.named_modules())
    out = {}
    for name in report.LAYER_NAMES:
        sub = named.get(name)
        if sub is None:
            out[name] = "(absent)"
            continue
        weight = getattr(sub, "weight", None)
        shape = ("x".join(str(n) for n in weight.shape) + " "
                 + str(weight.dtype).removeprefix("torch.")) if weight is not None else "-"
        out[name] = f"{type(sub).__name__}[{shape}]"
    return out


def measure(generate, forward, setup: Setup, reference: dict, barrier) -> dict:
    """Warm up, time ``setup.repeats`` generates and score the last one against HF's
    ``reference``; ``generate(ids, n, **kw)`` and ``forward(ids)`` -> logits."""
    import torch

    ids = torch.tensor(reference["prompt"])
    for_generate = {"attention_mask": torch.ones_like(ids), "do_sample": False,
                    "pad_token_id": reference["eos_token_id"]}
    generate(ids, setup.warmup_tokens, **for_generate)
    first_token_s, wall_s = [], []
    for _ in range(setup.repeats):
        stamps = Stamps()
        barrier()
        start = time.perf_counter()
        out = generate(ids, setup.tokens, streamer=stamps, **for_generate)
        wall_s.append(time.perf_counter() - start)
        first_token_s.append(stamps.times[1] - start if len(stamps.times) > 1 else float("nan"))
    rss = peak_rss_kib()
    new = out[:, ids.shape[1]:].tolist()
    return {"first_token_s": first_token_s, "wall_s": wall_s, "streamed": len(stamps.times),
            "peak_rss_kib": rss, "new_tokens": len(new[0]),
            "first_difference": first_difference(new, reference["new"]),
            **score(forward, reference)}


def score(forward, reference: dict) -> dict:
    """Perplexity of HF's tokens and top-1 agreement with them, over the continuation
    positions: one forward pass per sequence of the batch (run after the RSS is taken; per
    sequence, so that batch 8's logits, 8 x 160 x 50257 floats, are never all held)."""
    import torch

    nll, agree, count = 0.0, 0, 0
    with torch.inference_mode():
        for prompt, new in zip(reference["prompt"], reference["new"], strict=True):
            ids = torch.tensor([prompt + new])
            logits = forward(ids)[0, len(prompt) - 1:-1].float()
            target = torch.tensor(new)
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            agree += int((logits.argmax(-1) == target).sum())
            count += len(new)
    return {"perplexity": float(torch.exp(torch.tensor(nll / count))),
            "agreement": agree / count, "scored_tokens": count}


def run_worker(args: argparse.Namespace, body) -> None:
    """Run ``body()`` (it returns (rank, result dict)) and write the rank's result file; an
    exception is written as ``failed: <one line>`` (the rank then exits 1)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        rank, result = body()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        write_result(args.out, rank, {"rank": rank, "status": f"failed: {one_line(exc)}"})
        sys.stderr.flush()
        os._exit(1)
    write_result(args.out, rank, {"rank": rank, **result})


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    line = f"{type(exc).__name__}: {text}"
    return line if len(line) <= 300 else line[:297] + "..."


def write_result(folder: str, rank: int, result: dict) -> None:
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def load_reference(args: argparse.Namespace) -> tuple[Setup, dict]:
    setup = Setup(**json.loads(args.setup))
    return setup, json.loads((Path(args.model_dir) / setup.reference_name(args.batch))
                             .read_text())


def hf_worker(args: argparse.Namespace) -> tuple[int, dict]:
    """The ``hf`` peer: one process, no process group."""
    import torch
    from transformers import AutoModelForCausalLM

    setup, reference = load_reference(args)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start

    def generate(ids, n, **kw):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.inference_mode():
        result = measure(generate, lambda ids: model(input_ids=ids).logits, setup, reference,
                         barrier=lambda: None)
    return 0, {"status": "ok", "load_s": load_s, "threads": torch.get_num_threads(),
               "layers": layer_types(model), **versions(), **result}


def deepshard_worker(args: argparse.Namespace) -> tuple[int, dict]:
    """The ``deepshard`` peer, one rank of ``ds-run --num_gpus T``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import deepshard

    setup, reference = load_reference(args)
    deepshard.init_distributed()
    try:
        init_inference = deepshard.init_inference
    except AttributeError as exc:
        raise RuntimeError(f"deepshard.init_inference is not available yet ({exc})") from None
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    engine = init_inference(model, tensor_parallel={"tp_size": args.tp},
                            dtype=torch.int8 if args.dtype == "int8" else torch.float32,
                            checkpoint=args.model_dir)
    load_s = time.perf_counter() - start

    def generate(ids, n, **kw):
        return engine.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.inference_mode():
        result = measure(generate, lambda ids: engine(input_ids=ids).logits, setup, reference,
                         barrier=dist.barrier)
    return dist.get_rank(), {"status": "ok", "load_s": load_s, "threads": torch.get_num_threads(),
                             "world": dist.get_world_size(), "layers": layer_types(engine.module),
                             **versions(), **result}


def prepare(args: argparse.Namespace) -> None:
    """``--prepare``: the model directory and HF's reference tokens per batch, each made
    only where it is missing (or was made by another torch or transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    setup = Setup(**json.loads(args.setup))
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(GPT2Config(**setup.model))
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)  # safetensors
        (tmp / "bench-model.json").write_text(json.dumps(
            {"params": sum(p.numel() for p in model.parameters()), "seed": SEED}))
        tmp.replace(folder)
        print(f"built {folder}", file=sys.stderr)
    model = None
    for batch in setup.batches:
        path = folder / setup.reference_name(batch)
        if path.exists() and all(json.loads(path.read_text()).get(k) == v
                                 for k, v in versions().items()):
            continue
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompt = torch.randint(0, setup.model["vocab_size"], (batch, setup.prompt_len),
                               generator=torch.Generator().manual_seed(SEED))
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=setup.tokens, min_new_tokens=setup.tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
        path.write_text(json.dumps({
            "source": "HF generate, one process, from_pretrained fp32, greedy",
            "prompt": prompt.tolist(), "new": out[:, setup.prompt_len:].tolist(),
            "eos_token_id": model.config.eos_token_id, **versions()}))
        print(f"wrote {path}", file=sys.stderr)


# ---------------------------------------------------------------- parent (the table)

def _argv(spec: RunSpec, args: argparse.Namespace, setup: Setup, out: Path) -> list[str]:
    peer = PEERS[spec.peer]
    worker = ["--model-dir", str(args.model_dir), "--setup", json.dumps(asdict(setup)),
              "--tp", str(spec.tp), "--dtype", spec.dtype, "--batch", str(spec.batch),
              "--out", str(out)]
    if peer.runtime == "hf":
        return [sys.executable, str(Path(__file__).resolve()), "--worker", "hf", *worker]
    if peer.runtime == "deepshard":
        return [args.ds_run, "--num_gpus", str(spec.tp), str(Path(__file__).resolve()),
                "--worker", "deepshard", *worker]
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
            name = f"{spec.peer}-tp{spec.tp}-{spec.dtype}-b{spec.batch}.log"
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
    return {"status": "ok", "first_token_ms": statistics.median(first["first_token_s"]) * 1000,
            "tokens_per_s": spec.batch * setup.tokens / wall, "wall_s": first["wall_s"],
            "first_token_s": first["first_token_s"],
            "peak_rss_mib": [r["peak_rss_kib"] / 1024 for r in ranks],
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


def deepspeed_missing(python: str) -> tuple[str | None, str]:
    """(``deepspeed x``, "") when ``python`` can import deepspeed, else (None, why)."""
    if not Path(python).exists():
        return None, f"{python} not found (--deepspeed-python)"
    probe = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        return None, f"{python} cannot import deepspeed: {last_error_text(probe.stderr)}"
    return f"deepspeed {probe.stdout.split()[-1]}", ""


def last_error_text(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


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
        print(f"running {spec.peer} tp {spec.tp} {spec.dtype} batch {spec.batch} ...",
              file=sys.stderr, flush=True)
        row = launch(spec, args, setup)
        if row["status"] != "ok":
            print(f"  {row['status']}", file=sys.stderr, flush=True)
            failed[(spec.peer, spec.tp, spec.dtype)] = (spec.batch, row["status"])
        rows.append(row)
    return rows


def settings(args: argparse.Namespace, setup: Setup, names: list[str], ds_label: str | None,
             params: int | None) -> dict:
    return {"quick": args.quick, "model": setup.model, "params": params, "seed": SEED,
            "prompt_len": setup.prompt_len, "tokens": setup.tokens,
            "warmup_tokens": setup.warmup_tokens, "repeats": setup.repeats,
            "batches": list(setup.batches), "cores": setup.cores, "peers": names,
            "model_dir": str(args.model_dir), "deepspeed": ds_label,
            "reference": "HF generate, one process, from_pretrained fp32, greedy (--prepare)",
            "perplexity_text": "per row: each sequence's prompt + HF's fp32 greedy "
                               "continuation; perplexity of those continuation tokens and "
                               "top-1 agreement with them, teacher-forced"}


def main_parent(args: argparse.Namespace, names: list[str]) -> None:
    setup = Setup(model=QUICK_MODEL if args.quick else MODEL,
                  tokens=args.tokens or (8 if args.quick else 128),
                  batches=tuple(args.batches), repeats=args.repeats or (1 if args.quick else 3),
                  cores=args.cores, warmup_tokens=2 if args.quick else WARMUP_TOKENS)
    args.model_dir = args.cache_dir / setup.model_name
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    omp = str(setup.cores)
    prepared = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--prepare", "--model-dir",
         str(args.model_dir), "--setup", json.dumps(asdict(setup))],
        env={**os.environ, "OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": omp}, cwd=ROOT,
        check=False)
    if prepared.returncode != 0:
        raise SystemExit(f"inference.py: preparing {args.model_dir} failed (exit "
                         f"{prepared.returncode}); its traceback is above")
    params = json.loads((args.model_dir / "bench-model.json").read_text())["params"]
    ds_label, ds_missing = (None, "")
    if any(PEERS[n].runtime == "deepspeed" for n in names):
        ds_label, ds_missing = deepspeed_missing(args.deepspeed_python)
    run = Run("inference", settings(args, setup, names, ds_label, params))
    rows = report.add_ratios(run_all(plan(names, setup.batches), args, setup, ds_missing))
    m = setup.model
    head = [f"GPT-2 {m['n_layer']} layers x {m['n_embd']} ({params / 1e6:.1f}M parameters, "
            f"random, seed {SEED}), prompt {setup.prompt_len}, {setup.tokens} new tokens "
            f"greedy, median of {setup.repeats} generate(s) after a {setup.warmup_tokens}-token "
            f"warm-up; {setup.cores} cores shared by a launch's ranks",
            f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"
            + (f"; {ds_label} ({args.deepspeed_python})" if ds_label else ""), ""]
    lines = report.table(rows)
    extra = ["", *report.targets(rows), "", "Module types after init_inference (rank 0):",
             *report.layers(rows)]
    print("\n".join(head + lines + extra))
    run.write(rows, head + lines + extra,
              args.results or (QUICK_RESULTS if args.quick else RESULTS))


# ---------------------------------------------------------------- command line

def worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options a worker gets from the parent (also ``inference_deepspeed.py``'s)."""
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # ds-run's


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, "
                                         "e.g. 1,8") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
                        help="a 2-layer, 64-wide GPT-2 and 8 tokens: a smoke run")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "deepshard-bench" / "inference",
                        help="where the model directory and HF's reference tokens are kept")
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="interpreter that can import deepspeed")
    parser.add_argument("--ds-run", default=str(Path(sys.executable).with_name("ds-run")),
                        help="the ds-run that launches the deepshard peer")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--logs", type=Path, help="keep every launch's output here")
    parser.add_argument("--results", type=Path,
                        help="folder for the record, inference.json (default "
                             f"benchmarks/results; with --quick {QUICK_RESULTS})")
    parser.add_argument("--worker", choices=("hf", "deepshard"), help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    worker_arguments(parser)
    args = parser.parse_args(argv)
    names = [n.strip() for n in (args.only or ",".join(PEERS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        parser.error(f"--only: unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    return args, names


def main() -> None:
    args, names = parse_args()
    if args.prepare:
        prepare(args)
    elif args.worker:
        run_worker(args, lambda: {"hf": hf_worker, "deepshard": deepshard_worker}[args.worker](
            args))
    else:
        main_parent(args, names)


if __name__ == "__main__":
    main()
