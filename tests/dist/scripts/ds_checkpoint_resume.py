"""Loads DeepSpeed 0.19.8's checkpoints (``tests/data/deepspeed_checkpoints``) into
deepshard and continues them; reports per rank as ``RESULT <json>``.

``resume <scratch dir> <case> <stage> [<case> <stage> ...]``: for each fixture ``case`` (written at
ZeRO stage s on 2 ranks), a deepshard engine at ``stage`` on this world loads it, checks
the fp32 weights equal DeepSpeed's at the save, then trains the same 3 global batches
DeepSpeed trained after its save; reports the largest difference from DeepSpeed's
weights after each step, the learning rates, the counters and the client state.
``universal_zero2`` (DeepSpeed's ``ds_to_universal`` of ``zero2_fp32``) and
``train <out dir> <stage>``: deepshard's own run of the fixture model, saved, recorded
and converted to universal (see :func:`train`), for DeepSpeed to resume.
``ours:<case>`` (``<case>`` converted by deepshard's ``ds_to_universal`` on rank 0 into a
temporary folder) load with ``checkpoint.load_universal``; both continue as
``zero2_fp32`` / ``<case>`` did in DeepSpeed. ``written:<dir>``: a checkpoint ``train``
wrote in DeepSpeed's layout (``checkpoint.format: "deepspeed"``), continued as
``<dir>/expected.pt`` records.

``train <out dir> <stage> [deepspeed] [bf16]``: ``deepspeed`` saves in DeepSpeed's layout
(and converts nothing), ``bf16`` trains in bf16. ``save-deepspeed <root> <case>...``:
``train`` of each fixture case's stage and precision (``zero2_bf16``...) into
``<root>/<case>``, saved in DeepSpeed's layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))

import ds_fixture_model as fm  # noqa: E402

import deepshard  # noqa: E402
from deepshard.runtime.tensor_fragment import safe_get_full_fp32_param  # noqa: E402


def fp32_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value (masters where the job keeps them)."""
    out = {}
    for name, p in engine.module.named_parameters():
        value = safe_get_full_fp32_param(p) if p.requires_grad else None
        if value is None:
            from deepshard.runtime.zero.init import GatheredParameters

            with GatheredParameters([p]):
                value = p.detach().clone()
        out[name] = value.float().cpu()
    return out


def diff(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _source(case: str, scratch: Path) -> tuple[Path, str, bool]:
    """The save directory to load, the case whose DeepSpeed record it continues, and
    whether it is universal."""
    if case == "universal_zero2":
        return DATA / case / "ckpt", "zero2_fp32", True
    if case.startswith("written:"):
        root = Path(case.split(":", 1)[1])
        return root / "ckpt", str(root), False
    if case.startswith("ours:"):
        from deepshard.runtime.checkpoint.universal import convert

        base = case.split(":", 1)[1]
        root = scratch / base
        if dist.get_rank() == 0:
            convert(DATA / base / "ckpt" / "global_step2", root / "global_step2_universal")
        dist.barrier()
        return root, base, True
    return DATA / case / "ckpt", case, False


def resume(case: str, stage: int, scratch: Path) -> dict:
    deepshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    load_dir, base, universal = _source(case, scratch)
    expected = torch.load(DATA / base / "expected.pt", weights_only=False)
    expected.setdefault("bf16", False)
    torch.manual_seed(123)  # other initial values than DeepSpeed's: the load must set them
    model = fm.Net()
    cfg = fm.config(stage, expected["bf16"])
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    path, client = engine.load_checkpoint(str(load_dir))
    out = {"path": Path(path).name.removesuffix("_universal"), "epoch": client.get("epoch"),
           "global_steps": engine.global_steps, "global_samples": engine.global_samples,
           "at_save": diff(fp32_weights(engine), expected["at_save"]), "after": [],
           "lrs": [], "want_lrs": expected["lrs"]}
    for i, step in enumerate(range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE)):
        fm.train_step(engine, step, rank, world)
        out["after"].append(diff(fp32_weights(engine), expected["after"][i]))
        out["lrs"].append(engine.get_lr()[0])
    engine.destroy() if hasattr(engine, "destroy") else None
    return out


def train(out: Path, stage: int, deepspeed_layout: bool = False, bf16: bool = False) -> None:
    """deepshard trains the fixture model from seed 0 at ``stage`` for the steps before the
    save, saves its checkpoint (``out/ckpt``; in DeepSpeed's layout with
    ``deepspeed_layout``), records what DeepSpeed's fixtures record (``out/expected.pt``)
    over 3 more steps, and (deepshard's format) converts the checkpoint to universal
    (``out/universal/global_step2_universal``) on rank 0."""
    from deepshard.runtime.checkpoint.universal import convert

    deepshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = fm.Net()
    cfg = fm.config(stage, bf16)
    if deepspeed_layout:
        cfg["checkpoint"] = {"format": "deepspeed"}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    for step in range(fm.SAVE_AT):
        fm.train_step(engine, step, rank, world)
    engine.save_checkpoint(str(out / "ckpt"), client_state={"epoch": 3})
    at_save, after, lrs = fp32_weights(engine), [], []
    for step in range(fm.SAVE_AT, fm.SAVE_AT + fm.CONTINUE):
        fm.train_step(engine, step, rank, world)
        after.append(fp32_weights(engine))
        lrs.append(engine.get_lr()[0])
    if rank == 0:
        torch.save({"at_save": at_save, "after": after, "lrs": lrs, "bf16": bf16},
                   out / "expected.pt")
        if not deepspeed_layout:
            convert(out / "ckpt" / "global_step2", out / "universal" / "global_step2_universal")
    dist.barrier()


def main() -> None:
    if "save-deepspeed" in sys.argv:
        at = sys.argv.index("save-deepspeed")
        root = Path(sys.argv[at + 1])
        for case in sys.argv[at + 2:]:  # zero<stage>_<fp32|bf16>
            train(root / case, int(case[4]), True, case.endswith("bf16"))
        return
    if "train" in sys.argv:
        at = sys.argv.index("train")
        train(Path(sys.argv[at + 1]), int(sys.argv[at + 2]), "deepspeed" in sys.argv,
              "bf16" in sys.argv)
        return
    args = sys.argv[sys.argv.index("resume") + 2:]
    scratch = Path(sys.argv[sys.argv.index("resume") + 1])
    results = {}
    for case, stage in zip(args[::2], args[1::2], strict=True):
        results[f"{case}@{stage}"] = resume(case, int(stage), scratch)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "results": results}), flush=True)


if __name__ == "__main__":
    main()
