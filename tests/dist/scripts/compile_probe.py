"""Eager against compiled training on real gloo groups, run by ds-run.

    compile_probe.py <cases.json>

``cases.json`` is a list of cases, each ``{"name", "config", "how", "steps"}`` plus
optional ``"checkpointing": true`` (every block through ``deepshard.checkpointing``),
``"pipe": true`` (the GPT as a 2-stage ``PipelineModule``, trained with ``train_batch``),
``"autograd": true`` (``compiled_autograd_enabled=True``) and ``"shapes": [seq, ...]``
(one sequence length per step: a changing shape). ``how`` says how the compiled twin
compiles: ``"call"`` (``engine.compile()`` after ``initialize``) or ``"config"`` (the
config's own ``compile`` section, given in ``"compile"``).

Each case trains the tiny GPT twice from the same seed on the same batches, eager then
compiled, and prints one ``RESULT {json}`` line per rank and case: both loss curves, the
largest difference of the final weights (gathered whole at ZeRO-3), the graphs and graph
breaks the compiled twin made, whether it says it is compiled, and the log lines
``engine.compile`` wrote on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, GPTConfig, rank_indices, sample_batch, stdlib_corpus  # noqa: E402
from gpt_pipe import pipe_gpt  # noqa: E402

import deepshard  # noqa: E402
from deepshard.runtime.parallel.topology import Topology  # noqa: E402

TINY = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=4, d_model=64)


class Lines(logging.Handler):
    """Keeps the ``engine.compile`` log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "engine.compile" in record.getMessage():
            self.lines.append(record.getMessage())


def batches(corpus, engine, step: int, seq: int):
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    return [sample_batch(corpus, rank_indices(step, mb, engine.dp_rank, engine.dp_world_size,
                                              micro, gas), 0, seq) for mb in range(gas)]


def whole_state(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with deepshard.zero.GatheredParameters(params):
        return {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}


def run(case: dict, corpus, compiled: bool) -> dict:
    torch._dynamo.reset()
    config = dict(case["config"])
    if compiled and case["how"] == "config":
        config["compile"] = case["compile"]
    cfg = dataclasses.replace(TINY, seq_len=max(case.get("shapes", [TINY.seq_len])))
    torch.manual_seed(0)
    if case.get("pipe"):
        model = pipe_gpt(cfg, seed=0, topology=Topology.from_config(dist.get_world_size(), 2))
    else:
        model = GPT(cfg, checkpoint=deepshard.checkpointing.checkpoint
                    if case.get("checkpointing") else None)
    engine, _, _, _ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    if compiled and case["how"] == "call":
        engine.compile(compiled_autograd_enabled=bool(case.get("autograd")))
        engine.compile()  # a second call changes nothing
    losses, graphs = [], []
    shapes = case.get("shapes") or [cfg.seq_len] * case["steps"]
    for step, seq in enumerate(shapes):
        micro = batches(corpus, engine, step, seq)
        if case.get("pipe"):
            losses.append(float(engine.train_batch(iter(micro))))
        else:
            total = 0.0
            for x, y in micro:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / len(micro)
            losses.append(total)
        if compiled:
            graphs.append(engine._compiled.graphs)
    out = {"losses": losses, "compiled": engine.is_compiled, "state": whole_state(engine)}
    if compiled:
        out |= {"graphs": graphs, "graph_breaks": engine._compiled.graph_breaks,
                "regions": list(engine._compiled.plan.regions)}
    engine.destroy()
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[-1]).read_text())
    deepshard.init_distributed(verbose=False)
    lines = Lines()
    logging.getLogger("deepshard").addHandler(lines)
    logging.getLogger("deepshard").setLevel(logging.INFO)
    corpus = stdlib_corpus()
    for case in cases:
        eager = run(case, corpus, compiled=False)
        lines.lines.clear()
        compiled = run(case, corpus, compiled=True)
        diff = max(float((eager["state"][k] - v).abs().max())
                   for k, v in compiled["state"].items())
        result = {"rank": dist.get_rank(), "case": case["name"], "eager": eager["losses"],
                  "compiled_losses": compiled["losses"], "weights_diff": diff,
                  "eager_is_compiled": eager["compiled"], "is_compiled": compiled["compiled"],
                  "graphs": compiled["graphs"], "graph_breaks": compiled["graph_breaks"],
                  "regions": compiled["regions"], "log": list(lines.lines)}
        print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
