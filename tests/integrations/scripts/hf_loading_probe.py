"""Loads tiny HF checkpoints partitioned under a live stage-3 ``HfDeepShardConfig`` on
every rank and saves what each rank sees to ``<out_dir>/rank<r>.pt``.

Usage: ``hf_loading_probe.py --ckpt_root DIR --out_dir DIR``; the checkpoint root holds
``<kind>-single`` and ``<kind>-sharded`` causal LM checkpoints, ``qwen2-base`` (the
base model only) and ``llama-wide`` (a bigger one, for the peak RSS while loading). Per
case: whether every parameter is empty with a ``1/W`` slice, the
bytes read, the checkpoint's tensor bytes, whether tied weights are one object, the
stage-3 engine's logits and, once the config is gone, the ordinary ``from_pretrained``'s.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import deepshard  # noqa: E402
from deepshard.integrations import hf_loading  # noqa: E402
from deepshard.integrations.hf_config import HfDeepShardConfig  # noqa: E402
from tests.integrations.tiny import KINDS, batch, tiny_config  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def checkpoint_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors checkpoint: each file less its header."""
    total = 0
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
        total += file.stat().st_size - 8 - header
    return total


def layout(model) -> dict:
    params = list(model.parameters())
    world = dist.get_world_size()
    return {"all_empty": all(p.data.numel() == 0 and hasattr(p, "ds_shard") for p in params),
            "slices_fit": all(p.ds_shard.numel() == -(-p.ds_numel // world) for p in params),
            "largest_numel": max(p.ds_numel for p in params),
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


def whole_sums(model) -> dict:
    with deepshard.zero.GatheredParameters(list(model.parameters())):
        return {n: float(p.double().sum()) for n, p in model.named_parameters()}


def loaded_case(path: Path) -> dict:
    cfg = HfDeepShardConfig(DS_CONFIG)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                    output_loading_info=True)
    found = {**layout(model), "bytes": hf_loading.bytes_read(model),
             "ckpt_bytes": checkpoint_bytes(path), "missing": sorted(info["missing_keys"])}
    engine, *_ = deepshard.initialize(model=model, model_parameters=model.parameters(),
                                      config=DS_CONFIG)
    ids = batch()["input_ids"]
    with torch.no_grad():
        found["logits"] = engine(input_ids=ids).logits
    del cfg, engine, model
    gc.collect()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    found["normal_again"] = not any(hasattr(p, "ds_shard") for p in ref.parameters())
    with torch.no_grad():
        found["ref_logits"] = ref(input_ids=ids).logits
    return found


def missing_case(path: Path) -> dict:
    """A base-model checkpoint into a causal LM: the head is missing and initialised."""
    cfg = HfDeepShardConfig(DS_CONFIG)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                    output_loading_info=True)
    found = {**layout(model), "missing": sorted(info["missing_keys"]),
             "sums": whole_sums(model)}
    del cfg
    return found


def from_config_case() -> dict:
    cfg = HfDeepShardConfig(DS_CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    found = {**layout(model), "sums": whole_sums(model)}
    q = model.model.layers[0].self_attn.q_proj.weight
    with deepshard.zero.GatheredParameters([q]):
        found["q_std"] = float(q.std())
    del cfg
    return found


def status_kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field + ":"))
    return int(line.split()[1])


def rss_case(path: Path) -> dict:
    """The peak RSS growth while loading ``path`` partitioned (VmHWM reset just before)."""
    cfg = HfDeepShardConfig(DS_CONFIG)
    gc.collect()
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    found = {"peak_growth": (status_kib("VmHWM") - before) * 1024,
             "ckpt_bytes": checkpoint_bytes(path), **layout(model)}
    del cfg
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt_root", type=Path, required=True)
    parser.add_argument("--out_dir", type=Path, required=True)
    args, _ = parser.parse_known_args()  # ds-run adds --local_rank
    root, out = args.ckpt_root, args.out_dir
    deepshard.init_distributed(verbose=False)
    cases = {f"{kind}-{layout_}": loaded_case(root / f"{kind}-{layout_}")
             for kind in KINDS for layout_ in ("single", "sharded")}
    cases["qwen2-base"] = missing_case(root / "qwen2-base")
    cases["from_config"] = from_config_case()
    cases["rss"] = rss_case(root / "llama-wide")
    out.mkdir(parents=True, exist_ok=True)
    torch.save(cases, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
