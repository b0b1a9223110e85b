"""``init_inference``'s config (``deepshard.config.schema_inference``): DeepSpeed 0.19.8's
defaults and aliases, the config/kwargs merge, dtypes as torch objects or names, checkpoint
descriptions, and a one-line error for every refused key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.config.schema_inference import (
    CheckpointDescription,
    InferenceSection,
    InferenceSpec,
    parse_inference_config,
)
from deepshard.errors import UsageError

# Read from DeepSpeed 0.19.8's model: DeepSpeedInferenceConfig().model_dump() (dsvenv, CPU)
DEEPSPEED_0_19_8_DEFAULTS = {
    "replace_with_kernel_inject": False, "dtype": "fp16",  # torch.float16 there
    "enable_cuda_graph": False, "use_triton": False, "triton_autotune": False,
    "triangular_masking": True, "keep_module_on_host": False, "checkpoint": None,
    "base_dir": "", "set_empty_params": False, "save_mp_checkpoint_path": None,
    "return_tuple": True, "training_mp_size": 1, "replace_method": "auto",
    "injection_policy": None, "injection_policy_tuple": None, "config": None,
    "max_out_tokens": 1024, "min_out_tokens": 1, "transposed_mode": False, "mpu": None,
    "ep_size": 1, "ep_group": None, "ep_mp_group": None, "moe_experts": [1],
    "moe_type": "standard"}
DEEPSPEED_0_19_8_TP_DEFAULTS = {"enabled": True, "tp_size": 1, "tp_grain_size": 64,
                                "mpu": None, "tp_group": None}
DEEPSPEED_0_19_8_QUANT_DEFAULTS = {
    "enabled": True,
    "activation": {"enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1},
    "weight": {"enabled": True, "num_bits": 8, "q_type": "symmetric", "q_groups": 1,
               "quantized_initialization": {}, "post_init_quant": {}},
    "qkv": {"enabled": True}}
DEEPSPEED_0_19_8_MOE_DEFAULTS = {"enabled": True, "ep_size": 1, "moe_experts": [1],
                                 "type": "standard", "ep_mp_group": None, "ep_group": None}


def parse(config: object = None, **kwargs: Any) -> InferenceSpec:
    return parse_inference_config(config, kwargs)


def error(config: object = None, **kwargs: Any) -> str:
    with pytest.raises(UsageError) as info:
        parse_inference_config(config, kwargs)
    text = str(info.value)
    assert "\n" not in text and "HINT: " in text
    return text


# ---- defaults ------------------------------------------------------------------------------

def test_defaults_are_deepspeeds() -> None:
    section = InferenceSection()
    dumped = section.model_dump()
    for key, value in DEEPSPEED_0_19_8_DEFAULTS.items():
        # mp_size: None here (not given); DeepSpeed's 1 means the same, tp_size 1
        assert dumped[key] == value, key
    assert dumped["tensor_parallel"] == DEEPSPEED_0_19_8_TP_DEFAULTS
    assert dumped["quant"] == DEEPSPEED_0_19_8_QUANT_DEFAULTS
    assert dumped["moe"] == DEEPSPEED_0_19_8_MOE_DEFAULTS
    spec = parse()
    assert spec == InferenceSpec() == parse({})
    assert (spec.tp_size, spec.dtype, spec.kernel_inject, spec.max_out_tokens,
            spec.min_out_tokens, spec.return_tuple, spec.base_dir, spec.int8,
            spec.notes) == (1, "fp16", False, 1024, 1, True, "", False, ())


def test_every_deepspeed_key_is_classified() -> None:
    """Each of DeepSpeed 0.19.8's DeepSpeedInferenceConfig fields is a field here, and
    named in the module's table."""
    import deepshard.config.schema_inference as module

    ds_fields = {*DEEPSPEED_0_19_8_DEFAULTS, "tensor_parallel", "zero", "moe", "quant",
                 "checkpoint_config", "mp_size"}
    assert set(InferenceSection.model_fields) == ds_fields
    table = module.__doc__ or ""
    for key in ds_fields:
        assert key in table, key


def test_the_module_does_not_import_torch() -> None:
    code = ("import sys, deepshard.config.schema_inference as m; "
            "m.parse_inference_config({'dtype': 'bf16'}, {}); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- aliases and merging -------------------------------------------------------------------

@pytest.mark.parametrize(("given", "attribute", "expected"), [
    ({"kernel_inject": True}, "kernel_inject", True),
    ({"replace_with_kernel_inject": True}, "kernel_inject", True),
    ({"tp": {"tp_size": 4}}, "tp_size", 4),
    ({"tensor_parallel": {"tp_size": 4}}, "tp_size", 4),
    ({"max_tokens": 64}, "max_out_tokens", 64),
    ({"min_tokens": 0}, "min_out_tokens", 0),
    ({"injection_dict": {"Block": ("attn.o_proj",)}}, "injection_policy",
     {"Block": ("attn.o_proj",)}),
])
def test_aliases(given: dict[str, Any], attribute: str, expected: object) -> None:
    assert getattr(parse(given), attribute) == expected
    assert getattr(parse(**given), attribute) == expected


def test_no_effect_aliases_are_accepted() -> None:
    spec = parse(tm=False, ckpt_config={}, moe={"num_experts": [8], "expert_group": None})
    assert spec.tp_size == 1


def test_kwargs_join_the_config_and_the_dict_is_left_alone() -> None:
    config = {"dtype": "bf16", "tp": {"tp_size": 2}}
    spec = parse(config, max_tokens=64, dtype=torch.bfloat16, tensor_parallel={"tp_size": 2})
    assert (spec.dtype, spec.tp_size, spec.max_out_tokens) == ("bf16", 2, 64)
    assert config == {"dtype": "bf16", "tp": {"tp_size": 2}}  # DeepSpeed adds the kwargs


def test_a_key_given_both_ways_with_different_values_is_an_error() -> None:
    text = error({"dtype": "fp16"}, dtype=torch.bfloat16)
    assert text.startswith("init_inference: dtype: 'fp16' in the config and torch.bfloat16")
    # one key in two spellings, one in the config and one as a keyword argument
    assert error({"tp": {"tp_size": 2}}, tensor_parallel={"tp_size": 4}).startswith(
        "init_inference: tensor_parallel: ")


def test_two_spellings_of_one_key_in_one_dict() -> None:
    assert "given twice, as 'kernel_inject' and 'replace_with_kernel_inject'" in error(
        {"kernel_inject": True, "replace_with_kernel_inject": False})
    assert parse({"max_tokens": 8, "max_out_tokens": 8}).max_out_tokens == 8


def test_auto_values_are_dropped() -> None:
    spec = parse({"dtype": "auto", "tensor_parallel": {"tp_size": "auto"},
                  "zero": {"stage": "auto"}})
    assert (spec.dtype, spec.tp_size) == ("fp16", 1)


def test_a_config_that_is_neither_a_dict_nor_a_path() -> None:
    assert error(5).startswith("init_inference: config: expected a dict or a path")


# ---- config files --------------------------------------------------------------------------

def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_inference.json"
    path.write_text('{"dtype": "bf16", // a comment, as DeepSpeed configs carry\n'
                    ' "tensor_parallel": {"tp_size": 2}}')
    for config in (str(path), path):
        spec = parse(config, replace_with_kernel_inject=True)
        assert (spec.dtype, spec.tp_size, spec.kernel_inject) == ("bf16", 2, True)


def test_a_bad_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_inference.json"
    path.write_text(json.dumps({"tensor_parallel": {"tp_sze": 2}}))
    text = error(str(path))
    assert text.startswith(f"{path}: tensor_parallel.tp_sze: unknown key, did you mean "
                           "'tp_size'")
    # a key from the keyword arguments is named as init_inference's
    path.write_text(json.dumps({"dtype": "fp16"}))
    assert error(str(path), max_tokens=0).startswith("init_inference: max_out_tokens: ")
    assert error(str(tmp_path / "missing.json")).startswith(f"{tmp_path / 'missing.json'}: ")


def test_unknown_keys_say_did_you_mean() -> None:
    assert "did you mean 'dtype'" in error(dtyp="fp16")
    assert "did you mean 'ep_size'" in error(moe={"ep_sze": 2})
    assert error(foo=1).startswith("init_inference: foo: unknown key")
    assert "did you mean 'stage'" in error(zero={"stgae": 0})
    assert error(zero={"foo": 1}).startswith("init_inference: zero.foo: unknown key")


# ---- dtypes --------------------------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    (torch.float16, "fp16"), (torch.half, "fp16"), (torch.bfloat16, "bf16"),
    (torch.float32, "fp32"), (torch.float, "fp32"), (torch.int8, "int8"),
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("bf16", "bf16"),
    ("bfloat16", "bf16"), ("fp32", "fp32"), ("float", "fp32"), ("float32", "fp32"),
    ("int8", "int8"), ("torch.float16", "fp16"), ("FP16", "fp16"), (None, None),
])
def test_dtypes(given: object, expected: str | None) -> None:
    spec = parse(dtype=given)
    assert spec.dtype == expected
    assert spec.float_dtype == (None if expected == "int8" else expected)
    assert spec.int8 == (expected == "int8")


@pytest.mark.parametrize("given", [torch.float64, "float64", 16, "int4"])
def test_other_dtypes_are_refused(given: object) -> None:
    assert error(dtype=given).startswith("init_inference: dtype: expected a dtype: ")


# ---- refusals ------------------------------------------------------------------------------

REFUSED = [
    ({"use_triton": True}, "use_triton"),
    ({"set_empty_params": True}, "set_empty_params"),
    ({"transposed_mode": True}, "transposed_mode"),
    ({"save_mp_checkpoint_path": "/tmp/out"}, "save_mp_checkpoint_path"),
    ({"training_mp_size": 2}, "training_mp_size"),
    ({"injection_policy_tuple": ("a",)}, "injection_policy_tuple"),
    ({"args": {"hidden_size": 8}}, "config"),
    ({"mpu": object()}, "mpu"),
    ({"tensor_parallel": {"mpu": object()}}, "tensor_parallel.mpu"),
    ({"ep_size": 2}, "ep_size"),
    ({"expert_group": object()}, "ep_group"),
    ({"expert_mp_group": object()}, "ep_mp_group"),
    ({"moe": {"ep_size": 2}}, "moe.ep_size"),
    ({"moe": {"expert_group": object()}}, "moe.ep_group"),
    ({"moe": {"ep_mp_group": object()}}, "moe.ep_mp_group"),
    ({"zero": {"stage": 3, "offload_param": {"device": "cpu"}}}, "zero.stage"),
    ({"injection_policy": {"Block": ("o_proj",)}, "kernel_inject": True}, "injection_policy"),
    ({"enable_cuda_graph": True, "tp": {"tp_size": 2}}, "enable_cuda_graph"),
    ({"tensor_parallel": {"enabled": False, "tp_size": 2}}, "tensor_parallel.enabled"),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "mp_size"),
    ({"dtype": "int8", "quant": {"weight": {"num_bits": 4}}}, "quant.weight.num_bits"),
    ({"dtype": "int8", "quant": {"weight": {"q_type": "asymmetric"}}}, "quant.weight.q_type"),
    ({"dtype": "int8", "quant": {"weight": {"quantized_initialization": {"num_bits": 4}}}},
     "quant.weight.quantized_initialization"),
    ({"dtype": "int8", "quant": {"weight": {"post_init_quant": {"fc": {"num_bits": 4}}}}},
     "quant.weight.post_init_quant"),
    ({"dtype": "int8", "quant": {"activation": {"num_bits": 8}}}, "quant.activation.enabled"),
    ({"dtype": "int8", "quant": {"qkv": {"enabled": False}}}, "quant.qkv.enabled"),
    ({"quant": {"weight": {"num_bits": 4}}}, "quant.weight.num_bits"),
    ({"dtype": "int8", "quant": {"enabled": False}}, "quant.enabled"),
    ({"dtype": "int8", "quant": {"weight": {"enabled": False}}}, "quant.weight.enabled"),
    ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size"),
    ({"max_tokens": 0}, "max_out_tokens"),
]


@pytest.mark.parametrize(("given", "key"), REFUSED, ids=[k for _, k in REFUSED])
def test_refused_keys_give_one_line(given: dict[str, Any], key: str) -> None:
    assert error(**given).startswith(f"init_inference: {key}: ")


def test_keys_with_no_effect_are_accepted() -> None:
    spec = parse(triangular_masking=False, triton_autotune=True, moe=True,
                 moe_experts=[8], moe_type="residual", zero={"stage": 0},
                 tensor_parallel={"tp_grain_size": 32, "tp_group": None},
                 quant={"activation": {"enabled": False}, "weight": {"q_groups": 64}},
                 dtype=torch.int8)
    assert spec.int8 and spec.quant_bits == 8 and spec.notes == ()


def test_passed_through_objects_keep_their_identity() -> None:
    group, policy = object(), {torch.nn.Linear: ("fc2",)}
    spec = parse(tensor_parallel={"tp_size": 2, "tp_group": group}, injection_policy=policy)
    assert spec.tp_group is group and spec.injection_policy == policy


# ---- notes: deprecated and ignored keys ----------------------------------------------------

def test_mp_size_is_read_as_tp_size_with_a_note() -> None:
    spec = parse(mp_size=2)
    assert spec.tp_size == 2
    assert len(spec.notes) == 1 and spec.notes[0].startswith(
        "init_inference: mp_size: deprecated, read as tensor_parallel.tp_size=2")
    assert parse(mp_size=2, tp={"tp_size": 2}).tp_size == 2  # DeepSpeed refuses even this


def test_notes_for_ignored_keys() -> None:
    notes = parse(replace_method="auto", checkpoint_config={"checkpoint_dir": "/c"},
                  quant={"enabled": True}).notes
    assert [n.split(":")[1].strip() for n in notes] == [
        "replace_method", "checkpoint_config", "quant"]
    assert all("\n" not in n and "HINT: " in n for n in notes)


# ---- checkpoints ---------------------------------------------------------------------------

def test_checkpoint_description_as_a_dict() -> None:
    spec = parse(checkpoint={"type": "BLOOM", "checkpoints": ["a.pt", "b.pt"],
                             "version": 1.0}, base_dir="/w")
    assert spec.checkpoint == CheckpointDescription(
        type="bloom", checkpoints=("a.pt", "b.pt"), version=1.0)
    assert spec.base_dir == "/w"


def test_checkpoint_description_in_a_json_file(tmp_path: Path) -> None:
    # the form DeepSpeed's save_mp_checkpoint_path writes (ds_inference_config.json)
    path = tmp_path / "ds_inference_config.json"
    path.write_text(json.dumps({
        "type": "ds_model", "base_dir": "/ckpt", "version": 1.0, "parallelization": "tp",
        "checkpoints": {"non_tp": ["non-tp.pt"], "tp": ["tp_00_00.pt", "tp_01_00.pt"]},
        "tp_size": 2, "dtype": "float16"}))
    description = parse(checkpoint=str(path)).checkpoint
    assert description == CheckpointDescription(
        type="ds_model", checkpoints=("tp_00_00.pt", "tp_01_00.pt"), non_tp=("non-tp.pt",),
        version=1.0, parallelization="tp", tp_size=2, base_dir="/ckpt", dtype="fp16",
        source=str(path))


def test_checkpoint_errors_name_the_file_or_the_key(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    path.write_text(json.dumps({"type": "ds_model", "checkpoint": ["a.pt"], "version": 1}))
    assert error(checkpoint=str(path)).startswith(
        f"{path}: checkpoint: unknown key, did you mean 'checkpoints'")
    assert error(checkpoint={"type": "ds_model", "checkpoints": ["a.pt"]}).startswith(
        "init_inference: checkpoint.version: required key is missing")
    assert error(checkpoint={"type": "gguf", "checkpoints": ["a"], "version": 1}).startswith(
        "init_inference: checkpoint.type: ")
    assert error(checkpoint={"type": "Megatron", "checkpoints": [], "version": 0}).startswith(
        "init_inference: checkpoint.checkpoints: ")
    assert error(checkpoint={"type": "Megatron", "checkpoints": ["a"], "version": 0,
                             "tp_size": 2, "mp_size": 4}).startswith(
        "init_inference: checkpoint.mp_size: mp_size is 4 and tp_size is 2")


def test_checkpoint_paths(tmp_path: Path) -> None:
    assert parse(checkpoint=str(tmp_path)).checkpoint == str(tmp_path)  # for the loader
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0")
    assert "is a weights file" in error(checkpoint=str(weights))
    assert "does not exist" in error(checkpoint=str(tmp_path / "nowhere"))
    assert error(checkpoint=3).startswith("init_inference: checkpoint: expected a path")
