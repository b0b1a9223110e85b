"""``deepshard.integrations.hf_save``: the shard planner against huggingface_hub's, the files
against transformers' own ``save_pretrained``, and, on 2 gloo ranks, models trained at
ZeRO stages 0/2/3 (and a LoRA adapter) that ``from_pretrained`` loads back exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub.serialization import split_state_dict_into_shards_factory

import deepshard
from deepshard.errors import UsageError
from deepshard.integrations import hf_save
from deepshard.integrations.hf_save import consolidated_16bit_state_dict, save_pretrained
from deepshard.integrations.hf_shards import parse_size, plan_shards
from tests.helpers import ROOT, run_ds
from tests.integrations.tiny import batch, tiny_config

SCRIPT = ROOT / "tests" / "integrations" / "scripts" / "hf_save_train.py"
RUNS = ("llama:0", "llama:2", "llama:3", "gpt2:3:bf16", "peft:0", "peft:3")


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind))


def files_of(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


# -- the planner (pure) ------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_plan_splits_as_huggingface_hub(seed):
    rng = random.Random(seed)
    sizes = {f"t{k}": rng.choice([1, 7, 100, 999, 1000, 1001, 4000]) for k in range(40)}
    want = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors",
        max_shard_size=1000)
    plan = plan_shards(sizes, 1000)
    assert {f.name: list(f.keys) for f in plan.files} == want.filename_to_tensors
    assert plan.weight_map() == want.tensor_to_filename
    assert plan.total_size == want.metadata["total_size"]
    assert plan.is_sharded == want.is_sharded


def test_plan_one_file_when_it_fits_and_big_tensors_alone():
    assert [f.name for f in plan_shards({"a": 3, "b": 4}, "1KB").files] == \
        ["model.safetensors"]
    # as huggingface_hub does: the big tensor's file comes before the one being filled
    plan = plan_shards({"a": 3, "big": 50, "b": 4}, 10, "pytorch_model.bin")
    assert [(f.name, f.keys, f.nbytes) for f in plan.files] == [
        ("pytorch_model-00001-of-00002.bin", ("big",), 50),
        ("pytorch_model-00002-of-00002.bin", ("a", "b"), 7)]
    plan = plan_shards({"a": 6, "b": 6, "c": 6}, 10)
    assert [list(r) for r in plan.rounds(2)] == [[0, 1], [2]]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size(" 20kb ") == 20_000
    assert parse_size(123) == 123
    for bad in ("5 GiB", "GB", "-1MB", 0):
        with pytest.raises(UsageError, match="max_shard_size"):
            parse_size(bad)


# -- one process -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2", "loaded_llama"])
def test_files_equal_transformers_own(tmp_path, kind):
    model = tiny(kind.removeprefix("loaded_"))
    if kind.startswith("loaded_"):  # from_pretrained's models save their keys sorted
        model.save_pretrained(tmp_path / "first")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "first")
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    save_pretrained(model, tmp_path / "ds", max_shard_size="20KB")
    assert files_of(tmp_path / "ds") == files_of(tmp_path / "hf")
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert (tmp_path / "ds" / name).read_text() == (tmp_path / "hf" / name).read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ds")
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_stage3_engine_in_one_process(tmp_path, one_process, monkeypatch):
    model = tiny("llama")
    model.model.layers[0].mlp.requires_grad_(False)
    engine, _, _, _ = deepshard.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.backward(engine(**batch(n=2)).loss)
    engine.step()
    assert any(p.numel() == 0 for p in model.parameters()), "nothing partitioned"
    save_pretrained(engine, tmp_path / "all", max_shard_size="20KB")
    save_pretrained(engine, tmp_path / "trainable", exclude_frozen_parameters=True)
    monkeypatch.setattr(hf_save, "GATHER_CHUNK", 10_000)  # gathered in several chunks
    full = consolidated_16bit_state_dict(engine)
    with deepshard.zero.GatheredParameters(list(model.parameters())):
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_same_state(full, want)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "all")
    assert_same_state(loaded.state_dict(), want)
    from safetensors.torch import load_file

    trainable = load_file(tmp_path / "trainable" / "model.safetensors")
    assert not any(".layers.0.mlp." in k for k in trainable)
    assert len(trainable) == len(want) - 3 - 1  # the frozen mlp, the tied head
    engine.destroy()


def test_model_built_under_zero_init(tmp_path, one_process):
    torch.manual_seed(0)
    with deepshard.zero.Init():
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert any(hasattr(p, "ds_shard") and p.numel() == 0 for p in model.parameters())
    save_pretrained(model, tmp_path, max_shard_size="20KB")
    full = consolidated_16bit_state_dict(model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(loaded.state_dict(), full)
    assert all(p.numel() == 0 for p in model.parameters() if hasattr(p, "ds_shard"))


def test_single_file_replaces_an_earlier_sharded_save(tmp_path):
    save_pretrained(tiny("llama", seed=1), tmp_path, max_shard_size="20KB")
    model = tiny("llama")
    save_pretrained(model, tmp_path)
    assert files_of(tmp_path) == ["config.json", "generation_config.json",
                                  "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_failed_write_keeps_the_earlier_save(tmp_path, monkeypatch):
    first = tiny("llama", seed=1)
    save_pretrained(first, tmp_path, max_shard_size="20KB")
    calls = []
    write_file = hf_save._write_file

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return write_file(*args)

    monkeypatch.setattr(hf_save, "_write_file", failing)
    with pytest.raises(UsageError, match="No space left on device"):
        save_pretrained(tiny("llama"), tmp_path, max_shard_size="20KB")
    assert not (tmp_path / hf_save.STAGING).exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(loaded.state_dict(), first.state_dict())


def test_shards_written_elsewhere_are_not_committed(tmp_path, monkeypatch):
    """Another node's rank wrote to its own disk: the main rank refuses to commit."""
    write_file = hf_save._write_file
    elsewhere = tmp_path / "other_node"
    elsewhere.mkdir()

    def on_another_disk(module, state, path, *rest):
        if path.name.startswith("model-00002"):
            return write_file(module, state, elsewhere / path.name, *rest)
        return write_file(module, state, path, *rest)

    monkeypatch.setattr(hf_save, "_write_file", on_another_disk)
    with pytest.raises(UsageError, match="a filesystem all nodes share"):
        save_pretrained(tiny("llama"), tmp_path / "model", max_shard_size="20KB")
    assert files_of(tmp_path / "model") == []


def test_given_state_dict_and_bin_files(tmp_path):
    model = tiny("gpt2")
    save_pretrained(model, tmp_path, state_dict=model.state_dict(), safe_serialization=False,
                    max_shard_size="20KB")
    assert (tmp_path / "pytorch_model.bin.index.json").is_file()
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_usage_errors(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        save_pretrained(tiny("llama"), tmp_path / "file")
    with pytest.raises(UsageError, match="not a transformers PreTrainedModel"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    with pytest.raises(UsageError, match="no rank passed is_main_process=True"):
        save_pretrained(tiny("llama"), tmp_path / "nobody", is_main_process=False)

    class Memory:
        available = 1000

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    with pytest.raises(UsageError, match=r"does not fit .* HINT: .*save_pretrained\(engine"):
        consolidated_16bit_state_dict(tiny("llama"))


# -- two ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One 2-rank job for every run in RUNS (the launches dominate the time)."""
    out = tmp_path_factory.mktemp("hf_save")
    result = run_ds("--num_gpus", "2", str(SCRIPT), "--out_dir", str(out), "--runs", *RUNS,
                    timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.parametrize("run", [r for r in RUNS if not r.startswith("peft")])
def test_two_ranks_model_loads_back(job, run):
    out = job / run.replace(":", "_")
    expected = torch.load(out / "expected.pt")
    written = [json.loads((out / f"written_rank{r}.json").read_text()) for r in (0, 1)]
    assert written[0] and written[1], "both ranks write shards"
    assert not set(written[0]) & set(written[1])
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out / "model", output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.dtype == (torch.bfloat16 if run.endswith(":bf16") else torch.float32)
    assert_same_state(loaded.state_dict(), expected["gathered"])
    assert_same_state(expected["consolidated"], expected["gathered"])
    with torch.no_grad():
        logits = loaded(input_ids=expected["input_ids"]).logits.float()
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-4, atol=1e-4)
    # the index and every file, as transformers writes the same model (built from its
    # config as the script's was: from_pretrained's would list its keys sorted)
    same = tiny(run.split(":")[0]).to(loaded.dtype)
    same.load_state_dict(expected["gathered"])
    same.save_pretrained(out / "resaved", max_shard_size="20KB")
    assert files_of(out / "model") == files_of(out / "resaved")
    assert sorted(written[0] + written[1]) == \
        [n for n in files_of(out / "model") if n.endswith(".safetensors")]
    index = "model.safetensors.index.json"
    assert (out / "model" / index).read_text() == (out / "resaved" / index).read_text()


@pytest.mark.parametrize("run", [r for r in RUNS if r.startswith("peft")])
def test_two_ranks_peft_adapter_loads_back(job, run):
    import peft

    out = job / run.replace(":", "_")
    expected = torch.load(out / "expected.pt")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(files_of(out / "model"))
    model = peft.PeftModel.from_pretrained(tiny("llama"), out / "model")
    assert_same_state(model.state_dict(), expected["gathered"])
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits.float()
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-4, atol=1e-4)
