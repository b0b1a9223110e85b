"""``engine.compile()`` and the ``compile`` config section, eager against compiled, on 2
gloo ranks (one ds-run for every case: compile time counts against the suite).

Every case trains the tiny GPT eagerly and compiled from the same seed on the same batches
(``scripts/compile_probe.py``): losses and final weights equal at fp32 (1e-5; bf16 and
fp16 round differently once inductor fuses, so they get the half-precision tolerance), and
every block shares one compiled graph with no graph break (at ZeRO-3 too).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_ds

PROBE = str(ROOT / "tests" / "dist" / "scripts" / "compile_probe.py")
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "optimizer": ADAMW}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def _case(name: str, how: str = "call", steps: int = 4, **extra) -> dict:
    config = {**BASE, **extra.pop("config", {})}
    return {"name": name, "how": how, "steps": steps, "config": config, **extra}


CASES = [
    _case("z0-checkpointing", checkpointing=True, config={"gradient_accumulation_steps": 2}),
    _case("z1-bf16", config={"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}),
    _case("z2-offload-axolotl", how="config",
          compile={"disable": False, "backend": "inductor"},
          config={"gradient_accumulation_steps": 2, "zero_optimization": {
              "stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    _case("z2-fp16", config={"zero_optimization": {"stage": 2},
                             "fp16": {"enabled": True, "initial_scale_power": 8}}),
    _case("z3-offload-checkpointing", checkpointing=True,
          config={"zero_optimization": {**Z3, **OFFLOAD}}),
    _case("z3-deepcompile-shapes", how="config", compile={"deepcompile": True},
          shapes=[32, 24, 16, 28, 20], config={"zero_optimization": Z3}),
    _case("pipe", pipe=True, config={"gradient_accumulation_steps": 2}),
    _case("z2-compiled-autograd", autograd=True, config={"zero_optimization": {"stage": 2}}),
]
HALF = {"z1-bf16": 2e-2, "z2-fp16": 2e-2}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[int, dict]]:
    cases = tmp_path_factory.mktemp("compile") / "cases.json"
    cases.write_text(json.dumps(CASES))
    result = run_ds("--num_gpus", "2", PROBE, str(cases), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, dict[int, dict]] = {}
    for line in result.stdout.splitlines():
        _, _, payload = line.partition(" RESULT ")
        if payload:
            data = json.loads(payload)
            found.setdefault(data["case"], {})[data["rank"]] = data
    assert sorted(found) == sorted(c["name"] for c in CASES), result.stdout[-3000:]
    return found


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_compiled_training_equals_eager(results, case):
    tol = HALF.get(case, 1e-5)
    for rank, got in results[case].items():
        assert got["is_compiled"] and not got["eager_is_compiled"], rank
        assert got["compiled_losses"] == pytest.approx(got["eager"], rel=tol, abs=tol), rank
        assert got["weights_diff"] <= tol * 10, (rank, got["weights_diff"])
        assert all(g >= 1 for g in got["graphs"]), got["graphs"]


@pytest.mark.parametrize("case", [c["name"] for c in CASES
                                  if not c.get("pipe") and not c.get("autograd")])
def test_each_block_compiles_once_without_graph_breaks(results, case):
    """At every stage (at stage 3 with the gathers outside the compiled code): the three
    blocks share one graph, with no graph break."""
    got = results[case][0]
    assert got["regions"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert got["graphs"][0] == 1 and got["graph_breaks"] == 0, got
    assert any("3 regions" in line and "1 graph(s), 0 graph break(s)" in line
               for line in got["log"]), got["log"]


def test_a_changing_sequence_length_recompiles_once_and_warns_once(results):
    got = results["z3-deepcompile-shapes"][0]
    # 32, then 24 (torch marks the length dynamic: one more graph), then no more
    assert got["graphs"] == [1, 2, 2, 2, 2], got["graphs"]
    warnings = [line for line in got["log"] if "compiled 1 more graph" in line]
    assert len(warnings) == 1 and "HINT" in warnings[0], got["log"]
