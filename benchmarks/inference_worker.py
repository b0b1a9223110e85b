"""What runs inside each launch of ``benchmarks/inference.py``: the ``hf`` peer's process,
one ``deepshard`` rank under ``ds-run``, and ``--prepare`` (the model directory and HF's
reference tokens); the measuring and scoring here are also the DeepSpeed rank's
(``inference_deepspeed.py``), so every peer is timed by the same code. The model families
(``ARCHS``) and the ``Setup`` a rank gets live here too, torch-free: the parent imports them.

    python benchmarks/inference_worker.py --prepare --model-dir DIR --setup JSON
    python benchmarks/inference_worker.py --worker hf --model-dir DIR --setup JSON ...
    ds-run --num_gpus T benchmarks/inference_worker.py --worker deepshard ...

(``inference.py`` passes the rest: ``--tp``, ``--dtype``, ``--batch``, ``--out``.) Each rank
writes ``<out>/rank<N>.json``: its numbers, or ``failed: <one line>`` / ``not runnable:
<one line>``. Per launch, after one warm-up generate of ``Setup.warmup_tokens`` new tokens
and a barrier before each timed generate (``Setup.repeats``):

* ``first_token_s``: from the ``generate`` call to the streamer's second ``put`` (the first
  put is the prompt, the second the first new token); ``wall_s``: the generate call;
* ``peak_rss_kib``: ``ru_maxrss``, right after the timed generates;
* ``import_rss_kib``: ``VmRSS`` right after torch, transformers (with the arch's modeling
  module) and the peer's library are imported, before any process group, model or weight
  (``import_baseline``);
* ``first_difference``: the first new-token position where any sequence differs from HF's
  one-process fp32 greedy tokens (None: all equal);
* ``agreement`` and ``perplexity`` on HF's text (``score``): each sequence's prompt plus HF's
  continuation, teacher-forced; the share of continuation positions whose argmax is HF's
  token, and exp(mean negative log-likelihood) of those tokens.

Torch is imported inside the functions: ``inference_deepspeed.py`` imports this module in
DeepSpeed's venv before it imports deepspeed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
PROMPT_LEN = 32
WARMUP_TOKENS = 4
DTYPES = ("fp32", "int8")


@dataclass(frozen=True)
class Arch:
    """One model family: how it is built, named and inspected. Strings only (the parent
    never imports transformers); the rank resolves them."""

    name: str
    config: str
    """The transformers config class the model is built from."""
    model_class: str
    """The transformers model class built from it (``prepare``)."""
    model: dict
    """The config's keyword arguments: the benchmark's model."""
    quick: dict
    """The same for ``--quick``."""
    dir_format: str
    """The model directory's name, formatted with the config's keyword arguments."""
    title_format: str
    """What the report calls the model, formatted the same way."""
    block: str
    """The decoder block class, ``module:Class`` (the ``deepspeed-policy`` peer's key)."""
    row_parallel: tuple[str, ...]
    """The block's output projections: the ``deepspeed-policy`` peer's all-reduced layers."""
    embedding: str
    """The token embedding's module name."""
    block0: str
    """The first block's module name."""
    projections: tuple[str, ...]
    """Its linear layers."""

    @property
    def layers(self) -> tuple[str, ...]:
        """The modules whose type and weight shape each worker reports after
        ``init_inference``: the embedding, the first block's projections and the head."""
        return (self.embedding, *(f"{self.block0}.{p}" for p in self.projections), "lm_head")


GPT2_VOCAB = 50257
ARCHS = {a.name: a for a in (
    Arch(name="gpt2", config="GPT2Config", model_class="GPT2LMHeadModel",
         model={"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": GPT2_VOCAB},
         quick={"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": GPT2_VOCAB},
         dir_format="gpt2-{n_layer}x{n_embd}h{n_head}-v{vocab_size}",
         title_format="GPT-2 {n_layer} layers x {n_embd}",
         block="transformers.models.gpt2.modeling_gpt2:GPT2Block",
         row_parallel=("attn.c_proj", "mlp.c_proj"),
         embedding="transformer.wte", block0="transformer.h.0",
         projections=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    Arch(name="llama", config="LlamaConfig", model_class="LlamaForCausalLM",
         model={"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000,
                "max_position_embeddings": 512, "tie_word_embeddings": False},
         # 128 wide, not 64: DeepSpeed splits lm_head and the MLP in grains of 64
         # (tp_grain_size), so at 64 its rank 1 would hold an empty lm_head
         quick={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000,
                "max_position_embeddings": 512, "tie_word_embeddings": False},
         dir_format="llama-{num_hidden_layers}x{hidden_size}h{num_attention_heads}"
                    "kv{num_key_value_heads}i{intermediate_size}-v{vocab_size}",
         title_format="LLaMA {num_hidden_layers} layers x {hidden_size} "
                      "(MLP {intermediate_size})",
         block="transformers.models.llama.modeling_llama:LlamaDecoderLayer",
         row_parallel=("self_attn.o_proj", "mlp.down_proj"),
         embedding="model.embed_tokens", block0="model.layers.0",
         projections=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
)}
"""``--arch`` -> its model family, in the order the benchmark runs them."""


@dataclass(frozen=True)
class Setup:
    """What every launch of one arch shares (the workers get it as JSON)."""

    arch: str
    model: dict
    """``ARCHS[arch].config`` keyword arguments."""
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
        return ARCHS[self.arch].dir_format.format(**self.model) + f"-seed{SEED}"

    @property
    def title(self) -> str:
        return ARCHS[self.arch].title_format.format(**self.model)

    def reference_name(self, batch: int) -> str:
        """HF's one-process greedy tokens for ``batch``, beside the model."""
        return f"reference-b{batch}-p{self.prompt_len}-n{self.tokens}.json"


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


def rss_now_kib(status: Path = Path("/proc/self/status")) -> int:
    """The resident set now (``VmRSS``); the peak so far where there is no ``/proc``."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return peak_rss_kib()


def import_baseline(arch: str) -> int:
    """Import torch, transformers and ``arch``'s modeling module (transformers imports it
    lazily, at the first load) and return the RSS now: the part of every peer's RSS that is
    no model and no work. The caller has imported its library before."""
    import torch  # noqa: F401
    import transformers

    getattr(transformers, ARCHS[arch].model_class)
    return rss_now_kib()


def first_difference(ours: list[list[int]], reference: list[list[int]]) -> int | None:
    """The first new-token position (0-based) where any sequence differs; None if none."""
    firsts = []
    for seq, ref in zip(ours, reference, strict=True):
        differ = [i for i, (a, b) in enumerate(zip(seq, ref, strict=False)) if a != b]
        if differ or len(seq) != len(ref):
            firsts.append(differ[0] if differ else min(len(seq), len(ref)))
    return min(firsts, default=None)


def layer_types(module, names: tuple[str, ...]) -> dict[str, str]:
    """``names``' module types and weights' shapes and dtypes, e.g.
    ``Conv1D[768x2304 float32]``."""
    named = dict(module.named_modules())
    out = {}
    for name in names:
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


def block_class(arch: str) -> type:
    """``ARCHS[arch].block`` (``module:Class``) imported."""
    module, name = ARCHS[arch].block.split(":")
    return getattr(importlib.import_module(module), name)


def hf_worker(args: argparse.Namespace) -> tuple[int, dict]:
    """The ``hf`` peer: one process, no process group."""
    setup, reference = load_reference(args)
    import_rss = import_baseline(setup.arch)
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start

    def generate(ids, n, **kw):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.inference_mode():
        result = measure(generate, lambda ids: model(input_ids=ids).logits, setup, reference,
                         barrier=lambda: None)
    return 0, {"status": "ok", "load_s": load_s, "threads": torch.get_num_threads(),
               "import_rss_kib": import_rss,
               "layers": layer_types(model, ARCHS[setup.arch].layers), **versions(), **result}


def deepshard_worker(args: argparse.Namespace) -> tuple[int, dict]:
    """The ``deepshard`` peer, one rank of ``ds-run --num_gpus T``."""
    import deepshard
    import deepshard.inference.api  # what deepshard.init_inference imports on first use

    setup, reference = load_reference(args)
    import_rss = import_baseline(setup.arch)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    deepshard.init_distributed()
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    engine = deepshard.init_inference(
        model, tensor_parallel={"tp_size": args.tp},
        dtype=torch.int8 if args.dtype == "int8" else torch.float32, checkpoint=args.model_dir)
    load_s = time.perf_counter() - start

    def generate(ids, n, **kw):
        return engine.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.inference_mode():
        result = measure(generate, lambda ids: engine(input_ids=ids).logits, setup, reference,
                         barrier=dist.barrier)
    return dist.get_rank(), {
        "status": "ok", "load_s": load_s, "threads": torch.get_num_threads(),
        "world": dist.get_world_size(), "import_rss_kib": import_rss,
        "layers": layer_types(engine.module, ARCHS[setup.arch].layers), **versions(), **result}


def build(setup: Setup, folder: Path) -> None:
    """The arch's model from its config, seeded, saved (safetensors) to ``folder``."""
    import torch
    import transformers

    arch = ARCHS[setup.arch]
    torch.manual_seed(SEED)
    model = getattr(transformers, arch.model_class)(
        getattr(transformers, arch.config)(**setup.model))
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / "bench-model.json").write_text(json.dumps(
        {"params": sum(p.numel() for p in model.parameters()), "seed": SEED}))
    tmp.replace(folder)
    print(f"built {folder}", file=sys.stderr)


def prepare(args: argparse.Namespace) -> None:
    """``--prepare``: the model directory and HF's reference tokens per batch, each made
    only where it is missing (or was made by another torch or transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    setup = Setup(**json.loads(args.setup))
    folder = Path(args.model_dir)
    if not (folder / "config.json").exists():
        build(setup, folder)
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


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options a rank gets from ``inference.py`` (also ``inference_deepspeed.py``'s)."""
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--setup", required=True, help="inference.Setup as JSON")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--out", help="folder for rank<N>.json")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # ds-run's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--worker", choices=("hf", "deepshard"))
    mode.add_argument("--prepare", action="store_true")
    worker_arguments(parser)
    args = parser.parse_args()
    if args.prepare:
        prepare(args)
    else:
        run_worker(args, lambda: {"hf": hf_worker, "deepshard": deepshard_worker}[args.worker](
            args))


if __name__ == "__main__":
    main()
