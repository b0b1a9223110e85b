"""The AutoTP plan of real HF models, the slice readers and the engine, in one process.

The multi-rank behaviour (logits and tokens against the dense model) is
``tests/dist/test_inference.py``; here: what the planner decides for Llama, GPT-2 and T5,
that a safetensors slice read by offset equals the library's, and the engine's contract.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepshard.errors import UsageError
from deepshard.inference.sharding import linearize_conv1d
from deepshard.inference.sources import SafetensorsSource, open_source
from deepshard.runtime.parallel.autotp import apply_autotp, plan_autotp
from tests.inference_models import configs

transformers = pytest.importorskip("transformers")


def _model(family: str, meta: bool = True) -> nn.Module:
    auto, config = configs()[family]
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return getattr(transformers, auto).from_config(config)


def test_llama_attention_splits_by_heads_read_from_its_config():
    plan = plan_autotp(_model("llama"), 4, pad_vocab=True)
    kinds = plan.kinds()
    assert kinds["model.layers.0.self_attn.k_proj"] == "column"
    assert kinds["model.layers.0.self_attn.o_proj"] == "row"
    assert kinds["model.layers.0.mlp.down_proj"] == "row"
    assert kinds["lm_head"] == "column" and kinds["model.embed_tokens"] == "vocab"
    assert {a.strategy for a in plan.attention} == {"heads"}
    assert all(a.heads == () for a in plan.attention)  # nothing to divide: -1 heads
    assert "config.num_key_value_heads=4" in plan.attention[0].reason


def test_heads_that_do_not_divide_are_an_error_naming_the_module():
    with pytest.raises(UsageError, match=r"config\.num_key_value_heads=4 attention heads do "
                                         r"not divide by the tensor-parallel size 8"):
        plan_autotp(_model("llama"), 8)


def test_gpt2_conv1d_becomes_linear_with_the_same_function():
    model = _model("gpt2", meta=False).eval()
    ids = torch.randint(0, 200, (2, 5))
    before = model(ids).logits
    names = linearize_conv1d(model)
    assert "transformer.h.0.attn.c_attn" in names and len(names) == 8
    assert type(model.get_submodule("transformer.h.1.mlp.c_proj")) is nn.Linear
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)


def test_gpt2_plan_splits_fused_qkv_by_section_and_pads_the_odd_vocabulary():
    model = _model("gpt2")
    linearize_conv1d(model)
    plan = plan_autotp(model, 2, pad_vocab=True)
    qkv = plan.entry("transformer.h.0.attn.c_attn")
    assert qkv.kind == "column" and qkv.sections == (64, 64, 64)
    assert plan.entry("transformer.h.0.attn.c_proj").kind == "row"
    changes = {(h.attribute, h.heads, h.local_heads) for h in plan.attention[0].heads}
    assert changes == {("num_heads", 4, 2), ("split_size", 64, 32)}
    wte, head = plan.entry("transformer.wte"), plan.entry("lm_head")
    assert wte.kind == "vocab" and wte.padded and head.kind == "column" and head.padded
    assert ("transformer.wte", "lm_head") in plan.ties
    assert "126 rows a rank" in head.reason
    with pytest.raises(UsageError, match="pads a vocabulary"):
        apply_autotp(model, plan, None)  # training layers do not take padding
    unpadded = plan_autotp(model, 2)
    assert unpadded.entry("lm_head").kind == "replicate"


def test_t5_position_bias_is_split_with_its_heads():
    plan = plan_autotp(_model("t5"), 2)
    bias = plan.entry("encoder.block.0.layer.0.SelfAttention.relative_attention_bias")
    assert bias.kind == "head_split" and bias.weight_spec().dim == 1
    first = plan.attention[0]
    assert first.strategy == "heads"
    assert {(h.attribute, h.local_heads) for h in first.heads} == {("n_heads", 2),
                                                                   ("inner_dim", 32)}


def test_safetensors_slices_by_offset_equal_the_library(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(7, 5), "b": torch.arange(12, dtype=torch.int64),
               "c": torch.randn(3, 4, dtype=torch.bfloat16), "s": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr("deepshard.inference.sources._BLOCK", 40)  # columns: 2 rows a read
    source = open_source(tmp_path)
    assert isinstance(source, SafetensorsSource)
    whole = load_file(str(tmp_path / "model.safetensors"))
    assert source.shape("a") == (7, 5) and set(source.keys()) == set(whole)
    for key in whole:
        assert torch.equal(source.read(key), whole[key]), key
    assert torch.equal(source.read("a", 0, [(1, 3), (5, 7)]),
                       torch.cat([whole["a"][1:3], whole["a"][5:7]]))
    assert torch.equal(source.read("a", 1, [(0, 2), (4, 5)]),
                       torch.cat([whole["a"][:, 0:2], whole["a"][:, 4:5]], dim=1))
    assert torch.equal(source.read("c", 1, [(1, 3)]), whole["c"][:, 1:3])


def test_a_missing_checkpoint_directory_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="is not a directory"):
        open_source(tmp_path / "nope")


def test_engine_answers_the_models_attributes_and_checks_max_out_tokens():
    import deepshard

    model = _model("llama", meta=False)
    engine = deepshard.init_inference(model, dtype=torch.float32, max_out_tokens=8)
    assert engine.config is model.config and engine.can_generate()
    assert engine.device == torch.device("cpu")
    engine.profile_model_time()
    ids = torch.randint(3, 200, (1, 4))
    out = engine.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6) and len(engine.model_times()) == 1 and engine.model_times() == []
    with pytest.raises(UsageError, match="more than max_out_tokens=8"):
        engine.generate(torch.randint(3, 200, (1, 9)), max_new_tokens=1)
    engine.destroy()
    with pytest.raises(AttributeError):
        engine.module  # noqa: B018


def test_a_meta_model_without_a_checkpoint_is_refused():
    import deepshard

    with pytest.raises(UsageError, match=r"on the meta device .* no checkpoint was given"):
        deepshard.init_inference(_model("llama"), dtype=torch.float32)
