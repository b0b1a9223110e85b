"""The ``compile`` section: DeepSpeed 0.19.8's DeepCompile schema and the torch.compile one of
DeepSpeed <= 0.15 (Axolotl's), what each means for ``initialize``, and the refusals, each
naming its key path."""

from __future__ import annotations

import pytest

from deepshard.config.schema import validate_config
from deepshard.errors import UsageError

# deepspeed.compile.config.CompileConfig().model_dump() under DeepSpeed 0.19.8
DEEPSPEED_0_19_8_DEFAULTS = {
    "deepcompile": False, "autoep_non_moe": False, "free_activation": False,
    "free_activation_threshold": 10485760, "offload_activation": False,
    "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
    "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True,
    "keep_all_input_tensors": False, "passes": None}

# Axolotl's deepspeed_configs/zero{1,2}_torch_compile.json
AXOLOTL = {"disable": False, "backend": "inductor"}


def compile_section(section: dict, stage: int = 0):
    cfg, unimplemented, unknown = validate_config(
        {"train_batch_size": 8, "zero_optimization": {"stage": stage}, "compile": section})
    assert unimplemented == () and unknown == ()
    return cfg.compile


def error(section: dict, stage: int = 0) -> str:
    with pytest.raises(UsageError) as info:
        validate_config({"train_batch_size": 8, "zero_optimization": {"stage": stage},
                         "compile": section}, origin="ds.json")
    assert "\n" not in str(info.value)
    return str(info.value)


def test_an_empty_or_missing_section_compiles_nothing():
    for cfg in (compile_section({}), validate_config({"train_batch_size": 8})[0].compile):
        assert not cfg.at_initialize
        assert cfg.backend_name == "inductor" and cfg.compile_kwargs == {}
        assert not cfg.debug


def test_axolotls_section_compiles_at_initialize():
    cfg = compile_section(AXOLOTL)
    assert cfg.at_initialize and cfg.backend_name == "inductor"
    assert not compile_section({"disable": True}).at_initialize


def test_deepspeed_0_14s_section_gives_its_backend_and_kwargs():
    cfg = compile_section({"enabled": True, "backend": "aot_eager",
                           "kwargs": {"mode": "max-autotune", "dynamic": False}})
    assert cfg.at_initialize and cfg.backend_name == "aot_eager"
    assert cfg.compile_kwargs == {"mode": "max-autotune", "dynamic": False}
    cfg.compile_kwargs["mode"] = "default"  # a copy: the frozen config keeps its own
    assert cfg.kwargs["mode"] == "max-autotune"


def test_deepspeed_0_19_8s_defaults_parse_and_dump_back():
    cfg = compile_section(DEEPSPEED_0_19_8_DEFAULTS)
    assert not cfg.at_initialize
    dumped = cfg.model_dump()
    assert {k: dumped[k] for k in DEEPSPEED_0_19_8_DEFAULTS} == DEEPSPEED_0_19_8_DEFAULTS
    assert compile_section({}).model_dump() == dumped  # the same defaults when left out


def test_deepcompile_compiles_at_initialize_and_the_no_op_keys_are_accepted():
    cfg = compile_section({"deepcompile": True, "debug_log": True, "double_buffer": False,
                           "sync_before_reduce": True, "sync_after_allgather": True,
                           "keep_all_input_tensors": True, "free_activation_threshold": 1,
                           "offload_activation_pin_memory": False}, stage=3)
    assert cfg.at_initialize and cfg.debug and cfg.backend_name == "inductor"


@pytest.mark.parametrize("passes, stage", [(["z1"], 1), (["z1"], 2), (["z3"], 3), ([], 3)])
def test_a_zero_pass_matching_the_stage_is_accepted(passes, stage):
    assert compile_section({"deepcompile": True, "passes": passes}, stage).passes == passes


@pytest.mark.parametrize("key, value, hint", [
    ("free_activation", True, "activation_checkpointing"),
    ("offload_activation", True, "activation_checkpointing.cpu_checkpointing"),
    ("offload_opt_states", True, "zero_optimization.offload_optimizer"),
    ("offload_parameters", True, "zero_optimization.offload_param"),
    ("symmetric_memory", True, "no counterpart"),
    ("autoep_non_moe", True, "engine.compile() compiles every block of the model"),
    ("passes", ["z3", "autosp"], "sequence_parallel_size"),
    ("passes", ["autotp"], "tensor_parallel.autotp_size"),
])
def test_deepcompile_features_deepshard_lacks_are_refused(key, value, hint):
    message = error({"deepcompile": True, key: value}, stage=3)
    assert message.startswith(f"ds.json: compile.{key}: ")
    assert hint in message.split("HINT: ")[1]


@pytest.mark.parametrize("key", ["free_activation", "offload_activation", "symmetric_memory",
                                 "offload_opt_states", "offload_parameters", "autoep_non_moe"])
def test_a_refused_switch_left_at_its_default_is_accepted(key):
    assert not getattr(compile_section({"deepcompile": True, key: False}), key)


@pytest.mark.parametrize("passes, stage, wrong", [(["z1"], 3, "'z1'"), (["z3"], 0, "'z3'"),
                                                  (["z3"], 2, "'z3'"),
                                                  (["z1", "z3"], 3, "'z1'")])
def test_a_zero_pass_that_disagrees_with_the_stage_is_refused(passes, stage, wrong):
    message = error({"deepcompile": True, "passes": passes}, stage)
    assert message.startswith("ds.json: compile.passes: ")
    assert f"{wrong} does not match ZeRO stage {stage}" in message
    assert "zero_optimization.stage" in message


@pytest.mark.parametrize("section, key, words", [
    ({"deepcompile": True, "backend": "inductor"}, "backend", "are mixed in one section"),
    ({"enabled": True, "passes": ["z1"]}, "enabled", "are mixed in one section"),
    ({"disable": False, "debug_log": True}, "disable", "are mixed in one section"),
    ({"enabled": True, "disable": True}, "disable", "enabled is true and disable is true"),
    ({"enabled": False, "disable": False}, "disable", "enabled is false and disable is false"),
    ({"backend": " "}, "backend", "backend is empty"),
    ({"backend": 3}, "backend", "expected a string"),
    ({"kwargs": ["mode"]}, "kwargs", "expected a mapping"),
    ({"passes": ["z2"]}, "passes.0", "'z2' is not an accepted value"),
])
def test_contradictory_or_malformed_sections_are_refused(section, key, words):
    message = error(section)
    assert message.startswith(f"ds.json: compile.{key}: ")
    assert words in message


def test_a_misspelt_key_gets_did_you_mean():
    message = error({"deepcompil": True})
    assert message.startswith("ds.json: compile.deepcompil: ")
    assert "did you mean 'deepcompile'" in message
