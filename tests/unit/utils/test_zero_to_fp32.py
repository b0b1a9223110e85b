"""``deepshard.runtime.checkpoint.zero_to_fp32`` on real deepshard checkpoints (one process,
stages 0 and 2): DeepSpeed's functions, the files it writes, and the script next to the
checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import deepshard
from deepshard.errors import UsageError
from deepshard.runtime.checkpoint import zero_to_fp32 as z


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.register_buffer("index", torch.arange(3))  # a non-float buffer

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train_and_save(save_dir, stage: int, freeze: bool = False, **save) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    if freeze:
        model.a.requires_grad_(False)
    engine, _, _, _ = deepshard.initialize(
        model=model, config={"train_batch_size": 2, "zero_optimization": {"stage": stage},
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    engine.save_checkpoint(save_dir, **save)
    return model


def expected(model: nn.Module) -> dict[str, torch.Tensor]:
    with deepshard.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(params=[0, 2], ids=["stage0", "stage2"])
def checkpoint(request, tmp_path, one_process):
    model = train_and_save(tmp_path / "ckpt", request.param)
    return tmp_path / "ckpt", expected(model)


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == (torch.float32 if value.is_floating_point() else value.dtype)
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def test_state_dict_equals_the_models(checkpoint):
    ckpt, want = checkpoint
    assert_same(z.get_fp32_state_dict_from_zero_checkpoint(ckpt), want)
    assert_same(z.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step2",
                                                           lazy_mode=True), want)
    with pytest.raises(UsageError, match="no complete checkpoint with tag"):
        z.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step9")


def test_load_state_dict_from_zero_checkpoint_fills_a_fresh_model(checkpoint):
    ckpt, want = checkpoint
    torch.manual_seed(1)
    fresh = z.load_state_dict_from_zero_checkpoint(Tiny(), ckpt)
    assert_same(fresh.state_dict(), want)


def test_convert_writes_a_torch_load_able_file(checkpoint, tmp_path):
    ckpt, want = checkpoint
    written = z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out")
    assert written == [tmp_path / "out" / "pytorch_model.bin"]
    assert_same(torch.load(written[0], weights_only=True), want)


def test_convert_shards_past_max_shard_size_with_an_index(checkpoint, tmp_path):
    ckpt, want = checkpoint
    written = z.convert_zero_checkpoint_to_state_dict(ckpt, tmp_path / "out", dtype="bf16",
                                                      max_shard_size=100)
    index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert [p.name for p in written[:-1]] == shards == [
        f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin" for i in range(1, len(shards) + 1)]
    merged = {}
    for name in shards:
        merged.update(torch.load(tmp_path / "out" / name, weights_only=True))
    assert set(merged) == set(want) == set(index["weight_map"])
    assert merged["a.weight"].dtype == torch.bfloat16 and merged["index"].dtype == torch.int64
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in merged.values())
    torch.testing.assert_close(merged["b.weight"], want["b.weight"].bfloat16())


def test_safetensors_output(checkpoint, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    ckpt, want = checkpoint
    (path,) = z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out",
                                                           safe_serialization=True)
    assert path.name == "model.safetensors"
    got = safetensors.load_file(str(path))
    assert set(got) == set(want)  # a safetensors file keeps its own order (by dtype, name)
    assert_same({name: got[name] for name in want}, want)


def test_the_script_next_to_the_checkpoints_converts_them(checkpoint, tmp_path):
    ckpt, want = checkpoint
    script = z.write_script(ckpt)
    assert script == ckpt / "zero_to_fp32.py" and script.stat().st_mode & 0o111
    assert z.write_script(ckpt) == script  # again: unchanged, still there
    result = subprocess.run([sys.executable, str(script), str(ckpt), str(tmp_path / "out"),
                             "-t", "global_step2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_same(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), want)


def test_the_command_line_reports_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    assert z.main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no complete checkpoint" in err[0] and "HINT" in err[0]


def test_exclude_frozen_parameters(tmp_path, one_process):
    model = train_and_save(tmp_path / "ckpt", 0, freeze=True, exclude_frozen_parameters=True)
    got = z.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt",
                                                     exclude_frozen_parameters=True)
    assert list(got) == ["index", "b.weight", "b.bias"]  # the module's state_dict order
    torch.testing.assert_close(got["b.weight"], model.b.weight.detach())


def test_exclude_frozen_parameters_leaves_out_the_recorded_frozen_ones(tmp_path, one_process):
    model = train_and_save(tmp_path / "ckpt", 0, freeze=True)
    state = z.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt",
                                                       exclude_frozen_parameters=True)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and not frozen & set(state)
    assert set(state) == set(expected(model)) - frozen
    # the checkpoint root carries DeepSpeed's converter script, as DeepSpeed's do
    assert (tmp_path / "ckpt" / "zero_to_fp32.py").is_file()


def test_split_in_shards_cuts_in_order_and_keeps_tied_tensors_together():
    a, big, tied = torch.zeros(10), torch.zeros(100), torch.zeros(5)
    state = {"a": a, "big": big, "t1": tied, "c": torch.zeros(10), "t2": tied}
    shards = z.split_in_shards(state, 80)  # bytes: a 40, big 400, t 20, c 40
    # huggingface_hub's order: an oversized tensor's shard is closed at once, before the
    # open one; a tied tensor joins its first name's shard
    assert [list(s) for s in shards] == [["big"], ["a", "t1", "t2"], ["c"]]
    assert [list(s) for s in z.split_in_shards(state, None)] == [list(state)]
    assert z.shard_names("model.safetensors", 2) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_sizes_and_dtypes_parse_as_in_deepspeed():
    assert z.parse_size("5GB") == 5 * 10**9 and z.parse_size(" 1.5mb ") == 1_500_000
    assert z.parse_size(123) == 123 and z.parse_size("300") == 300
    with pytest.raises(ValueError, match="unit"):
        z.parse_size("5GiB")
    assert z.resolve_output_dtype("torch.bfloat16") is torch.bfloat16
    assert z.resolve_output_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="Unsupported output dtype"):
        z.resolve_output_dtype("int8")
