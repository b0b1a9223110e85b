"""deepshard.config: real users' configs, DeepSpeed's defaults, "auto", the batch
triad, and a one-line error with key path and hint for every mistake."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deepshard.config import (
    AdamParams,
    AdamWParams,
    DeepShardConfig,
    LoadedConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    load_config,
)
from deepshard.config.schema import validate_config
from deepshard.errors import UsageError
from tests.helpers import ROOT

# a copy of the shared folder's data/ds_configs (its README says what each must give)
DS_CONFIGS = ROOT / "tests" / "data" / "ds_configs"


def load(config: dict, world_size: int = 1, **kwargs) -> LoadedConfig:
    return load_config({"train_batch_size": 8, **config} if not _has_triad(config) else config,
                       world_size=world_size, **kwargs)


def _has_triad(config: dict) -> bool:
    return any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps"))


def error_of(source: object, world_size: int = 1, **kwargs) -> UsageError:
    if isinstance(source, dict) and not _has_triad(source):
        source = {"train_batch_size": 8, **source}
    with pytest.raises(UsageError) as info:
        load_config(source, world_size=world_size, **kwargs)
    return info.value


# ---- real users' configs ------------------------------------------------------------------

HF_AUTO_VALUES = {
    "bf16.enabled": True,
    "optimizer.params.lr": 3e-4, "optimizer.params.betas": [0.9, 0.95],
    "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.01,
    "scheduler.params.total_num_steps": 1000, "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 3e-4, "scheduler.params.warmup_num_steps": 100,
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
}


def test_llama_13b_zero3_offload_loads_at_world_size_8():
    loaded = load_config(DS_CONFIGS / "llama_13b_zero3_offload.json", world_size=8)
    cfg = loaded.config
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (64, 2, 4)
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.overlap_comm and zero.sub_group_size == 1_000_000_000
    assert zero.reduce_bucket_size == 200_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)
    assert zero.offload_param is None
    assert cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params.betas == (0.9, 0.95) and cfg.optimizer.params.lr == 2e-5
    assert isinstance(cfg.scheduler.params, WarmupDecayLRParams)
    assert cfg.scheduler.params.total_num_steps == 100_000
    assert loaded.unimplemented == ()
    assert loaded.origin == str(DS_CONFIGS / "llama_13b_zero3_offload.json")


def test_gpt_neox_20b_zero3_loads_at_world_size_8():
    cfg = load_config(DS_CONFIGS / "gpt_neox_20b_zero3.json", world_size=8).config
    assert cfg.gradient_accumulation_steps == 8
    assert cfg.zero_optimization.offload_param == OffloadParamConfig(device="cpu")
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 200_000_000


@pytest.mark.parametrize(("name", "world_size", "optimizer", "params"), [
    ("bert_large_pretraining.json", 8, "OneBitLamb",
     {"lr": 3e-4, "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 1000}),
    ("llama_70b_multi_node.json", 32, "OneBitAdam",
     {"lr": 1e-5, "betas": (0.9, 0.95), "freeze_step": 2000, "comm_backend_name": "nccl"}),
])
def test_one_bit_optimizer_configs_load(name, world_size, optimizer, params):
    # initialize refuses their ZeRO stages (1 for OneBitLamb, 3): test_onebit_config.py
    cfg = load_config(DS_CONFIGS / name, world_size=world_size).config
    assert cfg.optimizer.type == optimizer
    dumped = cfg.optimizer.params.model_dump()
    assert {k: dumped[k] for k in params} == params


def test_hf_auto_config_without_values_names_every_unresolved_key():
    err = error_of(DS_CONFIGS / "hf_autotp_auto.json", 4)
    assert err.where == str(DS_CONFIGS / "hf_autotp_auto.json")
    for key in HF_AUTO_VALUES:
        assert key in err.message
    assert "auto_values" in err.hint


def test_hf_auto_config_loads_once_values_are_supplied():
    loaded = load_config(DS_CONFIGS / "hf_autotp_auto.json", world_size=4,
                         auto_values=HF_AUTO_VALUES)
    cfg = loaded.config
    assert cfg.bf16.enabled and cfg.optimizer.params.lr == 3e-4
    assert cfg.optimizer.params.betas == (0.9, 0.95)
    assert cfg.scheduler.params.warmup_num_steps == 100
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (32, 4, 2)
    assert cfg.tensor_parallel.autotp_size == 4
    assert loaded.unimplemented == () and cfg.wall_clock_breakdown is False


def test_commented_nvme_config_loads_at_world_size_2():
    loaded = load_config(DS_CONFIGS / "zero3_nvme_commented.json", world_size=2)
    zero = loaded.config.zero_optimization
    assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == "nvme-swap"
    assert zero.offload_param.buffer_count == 5
    assert zero.offload_optimizer.device == "cpu"
    # "auto" without a model: DeepSpeed's defaults
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert loaded.unimplemented == ("aio",)


@pytest.mark.parametrize(("name", "world_size", "arithmetic"), [
    ("llama_13b_zero3_offload.json", 4,
     "train_batch_size 64 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 4 "
     "* world size 4 = 32"),
    ("gpt_neox_20b_zero3.json", 16,
     "train_batch_size 64 != train_micro_batch_size_per_gpu 1 * gradient_accumulation_steps 8 "
     "* world size 16 = 128"),
    ("zero3_nvme_commented.json", 1,
     "train_batch_size 4 != train_micro_batch_size_per_gpu 1 * gradient_accumulation_steps 2 "
     "* world size 1 = 2"),
])
def test_real_configs_at_another_world_size_show_the_arithmetic(name, world_size, arithmetic):
    err = error_of(DS_CONFIGS / name, world_size)
    assert err.message == arithmetic
    assert err.where == str(DS_CONFIGS / name)
    assert "data-parallel world size of" in err.hint


# ---- unknown keys, wrong types, wrong values ----------------------------------------------

def test_top_level_typo_suggests_the_key_and_lists_accepted_ones():
    err = error_of({"train_batch_sise": 8})
    assert err.where == "<dict>: train_batch_sise"
    assert "did you mean 'train_batch_size'" in err.message
    assert "gradient_clipping" in err.hint and "zero_optimization" in err.hint


def test_nested_typo_suggests_the_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stgae": 2}}')
    err = error_of(path)
    assert err.where == f"{path}: zero_optimization.stgae"
    assert "did you mean 'stage'" in err.message
    assert "zero_optimization accepts" in err.hint and "reduce_bucket_size" in err.hint
    assert str(err).startswith(f"{path}: zero_optimization.stgae: unknown key")


def test_typo_in_optimizer_params_is_checked_against_the_type():
    err = error_of({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})
    assert err.where == "<dict>: optimizer.params.momentun"
    assert "did you mean 'momentum'" in err.message
    assert "nesterov" in err.hint


def test_unknown_key_without_a_close_match_is_recorded_not_an_error():
    # DeepSpeed ignores keys it does not know; DeepSpeedExamples' ImageNet configs carry one
    loaded = load({"train_batch_size": 8, "fp16": {"zzzz": 1}, "cuda_visible_devices": 0})
    assert sorted(loaded.unknown) == ["cuda_visible_devices", "fp16.zzzz"]
    assert loaded.unimplemented == ()
    assert loaded.config.train_batch_size == 8


@pytest.mark.parametrize(("config", "where", "expected"), [
    ({"zero_optimization": {"reduce_bucket_size": "big"}},
     "zero_optimization.reduce_bucket_size", "a positive integer"),
    ({"zero_optimization": {"allgather_bucket_size": -1}},
     "zero_optimization.allgather_bucket_size", "a non-negative integer"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled", "true or false"),
    ({"gradient_clipping": [1]}, "gradient_clipping", "a non-negative number"),
    ({"steps_per_print": True}, "steps_per_print", "a positive integer"),
    ({"train_batch_size": 2.5}, "train_batch_size", "a positive integer"),
    ({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, "optimizer.params.betas",
     "two numbers in [0, 1), e.g. [0.9, 0.999]"),
    ({"zero_optimization": 7}, "zero_optimization", "a mapping of keys to values"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 2}}},
     "zero_optimization.offload_optimizer.ratio", "a number from 0 to 1"),
])
def test_wrong_type_names_key_value_and_expectation(config, where, expected):
    err = error_of(config)
    assert err.where == f"<dict>: {where}"
    assert err.message.startswith(f"expected {expected}, got ")
    assert expected in err.hint


@pytest.mark.parametrize(("config", "where", "given", "accepted"), [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "4", "0, 1, 2 or 3"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device", "'gpu'", "'none', 'cpu', 'nvme'"),
    ({"communication_data_type": "int8"}, "communication_data_type", "'int8'",
     "'fp32', 'fp16', 'bf16'"),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation", "'maybe'",
     "'Ignore', 'Warn', 'Fail'"),
    ({"checkpoint": {"resume": "sometimes"}}, "checkpoint.resume", "'sometimes'",
     "'on_restart', 'always', 'never'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}},
     "scheduler.params.warmup_type", "'cos'", "'log', 'linear'"),
])
def test_wrong_value_lists_the_accepted_ones(config, where, given, accepted):
    err = error_of(config)
    assert err.where == f"<dict>: {where}"
    assert err.message == f"{given} is not an accepted value"
    assert err.hint == f"use one of: {accepted}"


def test_missing_required_key_says_where_to_add_it():
    err = error_of({"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    assert err.where == "<dict>: scheduler.params.total_num_steps"
    assert err.message == "required key is missing"
    assert err.hint == "add 'total_num_steps' to scheduler.params"


def test_no_pydantic_error_escapes():
    for config in ({"optimizer": 3}, {"scheduler": {"type": "OneCycle"}},
                   {"activation_checkpointing": {"number_checkpoints": "x"}}):
        err = error_of(config)
        assert "pydantic" not in str(err) and "\n" not in str(err)


def test_fp16_and_bf16_both_enabled():
    err = error_of({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert err.where == "<dict>: bf16.enabled"
    assert err.message == "fp16 and bf16 are both enabled"
    assert "fp16.enabled" in err.hint


def test_dynamic_loss_scaling_needs_a_window():
    err = error_of({"fp16": {"enabled": True, "loss_scale_window": 0}})
    assert err.where == "<dict>: fp16.loss_scale_window"


def test_nvme_offload_needs_a_path_and_partial_offload_needs_stage_3():
    err = error_of({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert err.where == "<dict>: zero_optimization.offload_param.nvme_path"
    err = error_of({"zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5}}})
    assert err.where == "<dict>: zero_optimization.offload_optimizer.ratio"
    assert "stage 3" in err.message


# ---- optimizer and scheduler types ---------------------------------------------------------

@pytest.mark.parametrize(("given", "canonical"), [("adamw", "AdamW"), ("ADAM", "Adam"),
                                                  ("sgd", "SGD"), ("Lamb", "LAMB")])
def test_optimizer_type_is_case_insensitive(given, canonical):
    assert load({"optimizer": {"type": given}}).config.optimizer.type == canonical


def test_unknown_optimizer_suggests_a_name():
    err = error_of({"optimizer": {"type": "Adamm"}})
    assert err.where == "<dict>: optimizer.type"
    assert "did you mean 'Adam'" in err.message
    assert err.hint == ("use one of: Adam, AdamW, SGD, LAMB, Adagrad, Lion, OneBitAdam, "
                        "ZeroOneAdam, OneBitLamb")


@pytest.mark.parametrize("name", ["muon", "RMSprop", "Adafactor"])
def test_optimizers_deepspeed_knows_are_not_yet_supported(name):
    err = error_of({"optimizer": {"type": name}})
    assert err.message == f"{name!r} is not yet supported by deepshard"


def test_max_grad_norm_points_to_gradient_clipping():
    err = error_of({"optimizer": {"type": "LAMB", "params": {"max_grad_norm": 1.0}}})
    assert err.where == "<dict>: optimizer.params.max_grad_norm"
    assert "gradient_clipping" in err.hint


def test_scheduler_names_are_case_sensitive_as_in_deepspeed():
    err = error_of({"scheduler": {"type": "warmuplr"}})
    assert "did you mean 'WarmupLR'" in err.message
    err = error_of({"scheduler": {"type": "StepLR"}})
    assert err.message == "'StepLR' is not yet supported by deepshard"
    assert "WarmupCosineLR" in err.hint and "LRRangeTest" in err.hint


def test_optimizer_params_model_follows_the_type():
    adam = load({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert isinstance(adam.config.optimizer.params, AdamParams)
    assert adam.config.optimizer.params.adam_w_mode is False
    adamw = load({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert type(adamw.config.optimizer.params) is AdamWParams
    assert not hasattr(adamw.config.optimizer.params, "adam_w_mode")
    assert adamw.unimplemented == ("optimizer.params.adam_w_mode",)


def test_lamb_rejects_amsgrad():
    err = error_of({"optimizer": {"type": "LAMB", "params": {"amsgrad": True}}})
    assert err.where == "<dict>: optimizer.params.amsgrad"
    assert load({"optimizer": {"type": "LAMB", "params": {"eps_inside_sqrt": True}}}
                ).config.optimizer.params.eps_inside_sqrt is True


def test_learning_rates_may_be_per_parameter_group():
    params = load({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 1}}}).config.scheduler.params
    assert params.cycle_min_lr == (0.1, 0.2) and params.cycle_max_lr == 1.0


# ---- keys DeepSpeed knows that deepshard ignores -------------------------------------------

def test_unimplemented_keys_are_listed_not_raised():
    loaded = load({
        "memory_breakdown": True, "autotuning": {"enabled": True}, "aio": "auto",
        "bf16": {"enabled": True, "immediate_grad_update": True},
        "zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8},
                              "offload_optimizer": {"device": "cpu", "super_offload": True}},
        "optimizer": {"type": "AdamW", "legacy_fusion": False, "params": {"foreach": True}},
        "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}},
    })
    assert sorted(loaded.unimplemented) == [
        "aio", "autotuning", "bf16.immediate_grad_update", "memory_breakdown",
        "optimizer.legacy_fusion", "optimizer.params.foreach",
        "scheduler.params.last_batch_iteration",
        "zero_optimization.offload_optimizer.super_offload",
        "zero_optimization.zeropp_loco_param"]


# ---- DeepSpeed's aliases and legacy forms --------------------------------------------------

def test_deepspeed_aliases():
    cfg = load({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "gather_16bit_weights_on_model_save": True,
        "prefetch_bucket_size": 123, "max_live_parameters": 7}}).config
    assert cfg.bf16.enabled
    zero = cfg.zero_optimization
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.stage3_prefetch_bucket_size == 123 and zero.stage3_max_live_parameters == 7
    err = error_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert err.where == "<dict>: bfloat16"


def test_legacy_zero_forms():
    zero = load({"zero_optimization": {"stage": 2, "cpu_offload": True}}).config.zero_optimization
    assert zero.offload_optimizer == OffloadOptimizerConfig(device="cpu")
    assert load({"zero_optimization": True}).config.zero_optimization.stage == 1
    err = error_of({"zero_optimization": {"cpu_offload": True,
                                          "offload_optimizer": {"device": "cpu"}}})
    assert err.where == "<dict>: zero_optimization.cpu_offload"


def test_overlap_comm_defaults_by_stage_as_in_deepspeed():
    assert load({"zero_optimization": {"stage": 3}}).config.zero_optimization.overlap_comm
    assert not load({"zero_optimization": {"stage": 2}}).config.zero_optimization.overlap_comm
    assert not load({"zero_optimization": {"stage": 3, "overlap_comm": False}}
                    ).config.zero_optimization.overlap_comm


def test_case_insensitive_choices_store_the_canonical_spelling():
    cfg = load({"checkpoint": {"tag_validation": "FAIL"},
                "communication_data_type": "BF16"}).config
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.communication_data_type == "bf16"


# ---- DeepSpeed's defaults ------------------------------------------------------------------

def test_defaults_are_deepspeeds():
    cfg = load({"optimizer": {"type": "Adam"}}).config
    # runtime/constants.py (0.19): clipping on at 1.0, steps_per_print None
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None
    assert cfg.gradient_predivide_factor == 1.0 and cfg.prescale_gradients is False
    # runtime/precision_config.py
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.min_loss_scale) == (False, 0.0, 16, 1000, 2, 1.0)
    # runtime/zero/config.py
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.allgather_bucket_size) == \
        (0, 500_000_000, 500_000_000)
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance,
            zero.sub_group_size) == (50_000_000, 100_000, 10**9, 10**9, 10**9)
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    # runtime/zero/offload_config.py
    assert OffloadParamConfig().buffer_count == 5 and OffloadOptimizerConfig().buffer_count == 4
    assert OffloadParamConfig().buffer_size == 10**8 and OffloadParamConfig().max_in_cpu == 10**9
    # ops/adam/fused_adam.py + engine: Adam is AdamW-style by default
    adam = cfg.optimizer.params
    assert (adam.lr, adam.betas, adam.eps, adam.weight_decay, adam.adam_w_mode) == \
        (1e-3, (0.9, 0.999), 1e-8, 0.0, True)
    # runtime/lr_schedules.py
    assert WarmupLRParams().warmup_max_lr is None
    assert WarmupDecayLRParams(total_num_steps=10).warmup_max_lr == 0.001
    assert WarmupCosineLRParams(total_num_steps=10).cos_min_ratio == 0.0001
    # profiling/constants.py, runtime/constants.py
    assert (cfg.flops_profiler.top_modules, cfg.flops_profiler.module_depth) == (1, -1)
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.checkpoint.resume == "on_restart"
    assert cfg.activation_checkpointing.number_checkpoints is None


def test_models_are_frozen():
    cfg = load({}).config
    with pytest.raises(ValidationError):
        cfg.fp16.enabled = True  # type: ignore[misc]


def test_every_field_is_documented():
    import deepshard.config as package

    for name in package.__all__:
        model = getattr(package, name)
        for field, info in getattr(model, "model_fields", {}).items():
            assert info.description, f"{name}.{field} has no docstring"


# ---- the batch triad -----------------------------------------------------------------------

@pytest.mark.parametrize(("given", "world_size", "triad"), [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
])
def test_triad_resolution(given, world_size, triad):
    cfg = load_config(given, world_size=world_size).config
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == triad


def test_inconsistent_triad_shows_the_arithmetic_and_fixes():
    err = error_of({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 4}, world_size=2)
    assert err.message == ("train_batch_size 64 != train_micro_batch_size_per_gpu 2 * "
                           "gradient_accumulation_steps 4 * world size 2 = 16")
    assert "train_batch_size 16" in err.hint
    assert "gradient_accumulation_steps 16" in err.hint
    assert "train_micro_batch_size_per_gpu 8" in err.hint
    assert "world size of 8" in err.hint


@pytest.mark.parametrize(("given", "world_size", "where", "words"), [
    ({"gradient_accumulation_steps": 4}, 1, "<dict>: gradient_accumulation_steps",
     "train_micro_batch_size_per_gpu"),
    ({}, 1, "<dict>", "train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1, "<dict>",
     "multiple of 4"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 2}, 2, "<dict>", "multiple of 4"),
    ({"train_batch_size": 10}, 4, "<dict>", "multiple of 4"),
])
def test_triad_errors(given, world_size, where, words):
    with pytest.raises(UsageError) as info:
        load_config(given, world_size=world_size)
    assert info.value.where == where
    assert words in info.value.hint


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        load_config({"train_batch_size": 8}, world_size=0)


# ---- "auto" --------------------------------------------------------------------------------

def test_auto_values_fill_only_auto_keys():
    loaded = load_config({"train_batch_size": "auto", "optimizer": {
        "type": "AdamW", "params": {"lr": "auto", "eps": 1e-6}}}, world_size=2,
        auto_values={"train_batch_size": 16, "optimizer.params.lr": 3e-4,
                     "optimizer.params.eps": 1.0, "scheduler.params.total_num_steps": 5})
    params = loaded.config.optimizer.params
    assert params.lr == 3e-4 and params.eps == 1e-6
    assert loaded.config.train_micro_batch_size_per_gpu == 8


def test_auto_left_over_is_one_error_listing_every_key():
    err = error_of({"train_batch_size": 8, "gradient_clipping": "auto",
                    "fp16": {"enabled": "auto"}, "memory_breakdown": "auto",
                    "optimizer": {"type": "Adam", "params": {"lr": "auto"}}})
    assert err.message == ("'auto' left unresolved for gradient_clipping, fp16.enabled, "
                           "optimizer.params.lr")
    assert "auto_values" in err.hint


def test_undetermined_auto_triad_members_are_listed():
    err = error_of({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": "auto"})
    assert "train_batch_size" in err.message and "gradient_accumulation_steps" in err.message


class _Param:
    def __init__(self, *shape: int):
        self.shape = shape

    def numel(self) -> int:
        total = 1
        for dim in self.shape:
            total *= dim
        return total


class _Model:
    def __init__(self, *shapes: tuple[int, ...]):
        self._params = [_Param(*shape) for shape in shapes]

    def parameters(self):
        return iter(self._params)

    def modules(self):
        return iter([self])


AUTO_ZERO = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                   "stage3_prefetch_bucket_size": "auto",
                                   "param_persistence_threshold": "auto"}}


def test_auto_zero_buckets_are_sized_from_the_models_hidden_size():
    model = _Model((64, 32), (32, 64), (64, 64), (128, 64), (64,))
    zero = load(AUTO_ZERO, model=model).config.zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.stage3_param_persistence_threshold == 640


def test_auto_zero_buckets_prefer_the_models_config_hidden_size():
    model = _Model((64, 32))
    model.config = SimpleNamespace(hidden_size=100)
    assert load(AUTO_ZERO, model=model).config.zero_optimization.reduce_bucket_size == 10_000


def test_auto_zero_buckets_without_a_model_are_deepspeeds_defaults():
    zero = load(AUTO_ZERO).config.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (500_000_000, 50_000_000, 100_000)


# ---- the package ---------------------------------------------------------------------------

def test_yaml_config_loads(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_micro_batch_size_per_gpu: 2\nzero_optimization:\n  stage: 2\n"
                    "  reduce_bucket_size: 5e8\noptimizer:\n  type: adamw\n")
    cfg = load_config(path, world_size=2).config
    assert cfg.train_batch_size == 4 and cfg.zero_optimization.reduce_bucket_size == 5 * 10**8
    assert cfg.optimizer.type == "AdamW"


def test_config_package_does_not_import_torch():
    code = ("import sys, deepshard.config as c; "
            "c.load_config({'train_batch_size': 2}, world_size=1); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_config_type_is_deepshard_config():
    assert isinstance(load({}).config, DeepShardConfig)


def test_an_hjson_file_reads_as_deepspeed_reads_it(tmp_path):
    """DeepSpeed 0.19.8 reads every config file with hjson: unquoted keys and strings, no
    commas, comments (measured: mbs 2, steps_per_print 5, SGD lr 0.05, stage 1)."""
    path = tmp_path / "ds.json"
    path.write_text("{\n  # DeepSpeed reads this\n  train_micro_batch_size_per_gpu: 2\n"
                    "  steps_per_print: 5\n  optimizer: {\n    type: SGD\n"
                    "    params: { lr: 0.05 }\n  }\n  zero_optimization: { stage: 1 }\n}\n")
    c = load_config(str(path), world_size=1).config
    assert (c.train_micro_batch_size_per_gpu, c.steps_per_print, c.optimizer.type,
            c.optimizer.params.lr, c.zero_optimization.stage) == (2, 5, "SGD", 0.05, 1)
    path.write_text("{\n  train_micro_batch_size_per_gpu: 2\n"
                    "  train_micro_batch_size_per_gpu: 4\n}\n")
    with pytest.raises(UsageError, match="duplicate key 'train_micro_batch_size_per_gpu'"):
        load_config(str(path), world_size=1)
    path.write_text('{"train_micro_batch_size_per_gpu": 2,, }')
    with pytest.raises(UsageError, match="invalid JSON"):
        load_config(str(path), world_size=1)


@pytest.mark.parametrize(("precision", "accum", "ok"), [
    ({}, "fp32", True), ({}, "bf16", False), ({}, "fp16", False),
    ({"bf16": {"enabled": True}}, "bf16", True), ({"bf16": {"enabled": True}}, "fp32", False),
    ({"fp16": {"enabled": True}}, "FP16", True), ({"fp16": {"enabled": True}}, "bf16", False),
])
def test_grad_accum_dtype_is_honoured_or_refused(precision, accum, ok):
    """DeepSpeed 0.19.8 refuses fp32 + bf16/fp16 and bf16 + fp32/fp16 at stage 0
    (NotImplementedError) and accepts every mix at stages 1-2 (stage 1 bf16 + fp32 through
    its BF16_Optimizer). deepshard accumulates in the training dtype at every stage: that
    value is accepted, another refused, naming the key (it used to be warned and ignored)."""
    config = {"train_batch_size": 2, "data_types": {"grad_accum_dtype": accum}, **precision}
    if ok:
        assert validate_config(config)[0].data_types.grad_accum_dtype.lower() == accum.lower()
    else:
        with pytest.raises(UsageError, match=r"data_types\.grad_accum_dtype.*training dtype"):
            validate_config(config)


@pytest.mark.parametrize(("zero", "error"), [
    ({"stage": 3, "zero_hpz_partition_size": 2}, None),
    ({"stage": 3, "mics_shard_size": -1}, None),
    ({"stage": 2, "zero_hpz_partition_size": 2}, r"zero_hpz_partition_size 2 needs ZeRO "
                                                  r"stage 3"),
    ({"stage": 3, "zero_quantized_weights": True}, None),
    ({"stage": 2, "zero_quantized_weights": True}, r"zero_quantized_weights True needs ZeRO "
                                                    r"stage 3"),
    ({"stage": 3, "zero_quantized_gradients": True}, None),
    ({"stage": 1, "zero_quantized_gradients": True}, r"zero_quantized_gradients True needs"),
    ({"stage": 3, "zero_quantized_nontrainable_weights": True}, None),
    ({"stage": 2, "zero_quantized_nontrainable_weights": True}, r"nontrainable_weights True "
                                                                 r"needs ZeRO stage 3"),
    ({"stage": 3, "mics_shard_size": 2}, None),
    ({"stage": 2, "mics_shard_size": 2}, r"mics_shard_size 2 needs ZeRO stage 3"),
    ({"stage": 3, "mics_shard_size": 0}, r"mics_shard_size 0 is not a group size"),
    ({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}, r"MiCS with hpZ"),
    ({"stage": 3, "mics_hierarchical_params_gather": True}, r"mics_hierarchical"),
    ({"stage": 3, "zero_quantized_nontrainable_weights": True,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, r"swapped to NVMe"),
])
def test_zeropp_keys_are_honoured_or_refused(zero, error):
    """ZeRO++'s and MiCS's keys used to be warned about and ignored; every one is built
    now but MiCS's hierarchical gather, which is refused by name."""
    config = {"train_batch_size": 2, "zero_optimization": zero}
    if error is None:
        assert validate_config(config)[0].zero_optimization.stage == 3
    else:
        with pytest.raises(UsageError, match=r"zero_optimization\.\w+.*" + error):
            validate_config(config)
