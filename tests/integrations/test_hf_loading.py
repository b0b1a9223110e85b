"""Partitioned ``from_pretrained``/``from_config`` under a live stage-3 HfDeepShardConfig.

One process with a one-rank gloo group for the behaviour a HF user expects (dtype, key
prefixes, errors, going back to normal), and one 2-rank job through ds-run for the
partitioning itself: no whole parameter anywhere, half the bytes read per rank, tied
weights kept, and the stage-3 engine's logits equal to plain transformers'.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

from deepshard.errors import UsageError
from deepshard.integrations import hf_loading
from deepshard.integrations.hf_config import HfDeepShardConfig
from tests.helpers import ROOT, run_ds
from tests.integrations.tiny import KINDS, save_tiny, tiny_config

PROBE = ROOT / "tests" / "integrations" / "scripts" / "hf_loading_probe.py"
STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
TOL = 1e-5


@pytest.fixture
def one_rank(one_rank_group):
    """A one-rank gloo group, and no registration left behind by the test."""
    yield
    gc.collect()
    assert hf_loading.active_config() is None, "a stage-3 registration outlived its test"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    for kind in KINDS:
        save_tiny(kind, root / f"{kind}-single")
        save_tiny(kind, root / f"{kind}-sharded", max_shard_size="20KB")
    torch.manual_seed(0)
    transformers.AutoModel.from_config(tiny_config("qwen2")).save_pretrained(root / "qwen2-base")
    save_tiny("llama", root / "llama-wide", max_shard_size="8MB", vocab_size=1024,
              hidden_size=512, intermediate_size=1024, num_hidden_layers=4)  # 42 MB
    return root


def whole(model) -> dict[str, torch.Tensor]:
    """The model's parameters whole (gathered), by name."""
    import deepshard

    with deepshard.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_partitioned(model) -> None:
    for name, p in model.named_parameters():
        assert p.data.numel() == 0 and p.ds_shard.numel() >= p.ds_numel, name


# the reader ---------------------------------------------------------------------------
@pytest.mark.parametrize("block", [hf_loading.BLOCK, 3])
def test_read_range_reads_exactly_the_elements_asked_for(tmp_path, monkeypatch, block):
    monkeypatch.setattr(hf_loading, "BLOCK", block)  # 3: rows of 7 read one by one
    values = {"cube": torch.arange(3 * 5 * 7.0).view(3, 5, 7), "line": torch.arange(11.0),
              "one": torch.tensor(4.0)}
    safetensors_torch.save_file(values, tmp_path / "t.safetensors")
    ckpt = hf_loading.Checkpoint([str(tmp_path / "t.safetensors")])
    for key, full in values.items():
        flat = full.reshape(-1)
        for lo in range(flat.numel() + 1):
            n = flat.numel()  # ends inside, at and past row and matrix boundaries
            for hi in sorted({min(n, lo + d) for d in (0, 1, 2, 6, 7, 8, 13, 34, 35, 36)} | {n}):
                before = ckpt.bytes_read
                assert torch.equal(ckpt.read(key, lo, hi), flat[lo:hi]), (key, lo, hi)
                assert ckpt.bytes_read - before == 4 * (hi - lo)


# one process ---------------------------------------------------------------------------
def test_world_one_load_is_partitioned_and_equal_to_plain(one_rank, ckpts):
    path = ckpts / "llama-sharded"
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = HfDeepShardConfig(STAGE3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert_partitioned(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and model.generation_config is not None
    got, want = whole(model), dict(plain.named_parameters())
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0)
    assert hf_loading.bytes_read(model) == sum(p.numel() * 4 for p in plain.parameters())
    del cfg


def test_without_the_config_loading_is_plain_again(one_rank, ckpts):
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    cfg = HfDeepShardConfig(STAGE3)
    assert hf_loading.active_config() is cfg
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is not original
    del cfg
    gc.collect()
    assert hf_loading.active_config() is None
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpts / "gpt2-single")
    assert not any(hasattr(p, "ds_shard") for p in model.parameters())


def test_a_stage_2_config_leaves_loading_alone(one_rank, ckpts):
    cfg3 = HfDeepShardConfig(STAGE3)
    cfg2 = HfDeepShardConfig({"zero_optimization": {"stage": 2}})  # the latest wins
    assert hf_loading.active_config() is None
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpts / "gpt2-single")
    assert not any(hasattr(p, "ds_shard") for p in model.parameters())
    del cfg3, cfg2


@pytest.mark.parametrize("arg", ["dtype", "torch_dtype"])
def test_dtype_argument_is_the_slices_dtype(one_rank, ckpts, arg):
    path = ckpts / "qwen2-single"
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    cfg = HfDeepShardConfig(STAGE3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **{arg: torch.bfloat16})
    assert {p.ds_shard.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dtype == torch.bfloat16
    for name, value in whole(model).items():
        assert torch.equal(value, plain.get_parameter(name)), name
    del cfg


def test_causal_lm_checkpoint_into_base_model_reports_the_head(one_rank, ckpts):
    path = ckpts / "qwen2-single"
    plain = transformers.AutoModel.from_pretrained(path)
    cfg = HfDeepShardConfig(STAGE3)
    model, info = transformers.AutoModel.from_pretrained(path, output_loading_info=True)
    assert info["unexpected_keys"] == {"lm_head.weight"} and not info["missing_keys"]
    for name, value in whole(model).items():
        assert torch.equal(value, plain.get_parameter(name)), name
    del cfg


def test_base_checkpoint_into_causal_lm_initialises_the_missing_head(one_rank, ckpts):
    cfg = HfDeepShardConfig(STAGE3)
    model, info = transformers.Qwen2ForCausalLM.from_pretrained(ckpts / "qwen2-base",
                                                               output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    assert_partitioned(model)
    head = whole(model)["lm_head.weight"]
    assert 0.01 < float(head.std()) < 0.03  # transformers' normal(0, initializer_range)
    del cfg


def test_from_config_is_partitioned_with_transformers_init(one_rank):
    cfg = HfDeepShardConfig(STAGE3)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert_partitioned(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    values = whole(model)
    assert 0.015 < float(values["model.layers.0.self_attn.q_proj.weight"].std()) < 0.025
    assert torch.equal(values["model.norm.weight"], torch.ones(32))
    del cfg


def test_converted_weights_are_loaded_and_cut(one_rank, tmp_path):
    """Mixtral's per-expert checkpoint tensors fuse into one parameter per layer."""
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
        num_experts_per_tok=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    cfg = HfDeepShardConfig(STAGE3)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe",
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_partitioned(model)
    for name, value in whole(model).items():
        assert torch.equal(value, plain.get_parameter(name)), name
    del cfg


def test_a_state_dict_is_cut_too(one_rank, ckpts):
    plain = transformers.AutoModelForCausalLM.from_pretrained(ckpts / "qwen2-single")
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    cfg = HfDeepShardConfig(STAGE3)
    model = transformers.Qwen2ForCausalLM.from_pretrained(None, config=plain.config,
                                                          state_dict=state)
    assert_partitioned(model)
    for name, value in whole(model).items():
        assert torch.equal(value, plain.get_parameter(name)), name
    del cfg


def test_weights_tied_in_config_but_different_in_checkpoint_stay_apart(one_rank, tmp_path):
    path = save_tiny("llama", tmp_path / "untied", tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    cfg = HfDeepShardConfig(STAGE3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight  # transformers' rule
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(whole(model)["lm_head.weight"], plain.lm_head.weight)
    del cfg


def test_a_directory_without_weights_is_a_usage_error(one_rank, tmp_path):
    tiny_config("gpt2").save_pretrained(tmp_path / "empty")
    cfg = HfDeepShardConfig(STAGE3)
    with pytest.raises(UsageError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "empty")
    text = str(err.value)
    assert str(tmp_path / "empty") in text and "HINT" in text and "\n" not in text
    del cfg


def test_a_shape_mismatch_names_the_file_and_the_tensor(one_rank, ckpts):
    cfg = HfDeepShardConfig(STAGE3)
    with pytest.raises(UsageError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(ckpts / "gpt2-single",
                                                          vocab_size=130)
    text = str(err.value)
    assert "model.safetensors" in text and "transformer.wte.weight" in text
    assert "HINT" in text and "\n" not in text
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpts / "gpt2-single", vocab_size=130, ignore_mismatched_sizes=True,
        output_loading_info=True)
    assert {k for k, *_ in info["mismatched_keys"]} == {"transformer.wte.weight"}
    assert_partitioned(model)
    del cfg


def test_a_pickled_checkpoint_is_a_usage_error(one_rank, ckpts, tmp_path):
    plain = transformers.AutoModelForCausalLM.from_pretrained(ckpts / "gpt2-single")
    folder = tmp_path / "bin"
    plain.config.save_pretrained(folder)
    torch.save(plain.state_dict(), folder / "pytorch_model.bin")
    cfg = HfDeepShardConfig(STAGE3)
    with pytest.raises(UsageError, match=r"pytorch_model\.bin: .*safetensors.*HINT"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    del cfg


# two ranks -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("probe")
    result = run_ds("--num_gpus", "2", str(PROBE), "--ckpt_root", str(ckpts), "--out_dir",
                    str(out), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


LOADED = [f"{kind}-{layout}" for kind in KINDS for layout in ("single", "sharded")]


def test_no_rank_holds_a_whole_parameter(two_ranks):
    for rank, cases in enumerate(two_ranks):
        for name, case in cases.items():
            assert case["all_empty"] and case["slices_fit"], (rank, name)


@pytest.mark.parametrize("case", LOADED)
def test_each_rank_reads_half_the_checkpoint(two_ranks, case):
    got = [two_ranks[r][case]["bytes"] for r in range(2)]
    total = two_ranks[0][case]["ckpt_bytes"]
    assert sum(got) == total  # every element read once, by one rank
    assert all(abs(b - total / 2) <= 0.01 * total for b in got), (got, total)


@pytest.mark.parametrize("case", LOADED)
def test_stage3_engine_logits_equal_plain_transformers(two_ranks, case):
    for rank in range(2):
        found = two_ranks[rank][case]
        assert found["normal_again"], "from_pretrained stayed partitioned without the config"
        torch.testing.assert_close(found["logits"], found["ref_logits"], rtol=0, atol=TOL)


def test_tied_weights_stay_one_parameter(two_ranks):
    tied = {case: two_ranks[r][case]["tied"] for case in LOADED for r in range(2)}
    assert tied == {case: not case.startswith("qwen2") for case in LOADED}
    assert two_ranks[0]["from_config"]["tied"]


@pytest.mark.parametrize("case", ["qwen2-base", "from_config"])
def test_initialised_weights_are_the_same_on_every_rank(two_ranks, case):
    sums = [two_ranks[r][case]["sums"] for r in range(2)]
    assert sums[0] == sums[1]
    if case == "qwen2-base":
        assert two_ranks[0][case]["missing"] == ["lm_head.weight"]
    else:
        assert 0.015 < two_ranks[0][case]["q_std"] < 0.025


def test_peak_rss_while_loading_is_about_half_the_model(two_ranks):
    for rank in range(2):
        found = two_ranks[rank]["rss"]
        assert found["all_empty"]
        assert found["peak_growth"] < 0.7 * found["ckpt_bytes"], (rank, found)
