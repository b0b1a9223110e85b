"""The 1-bit optimizers' config sections as DeepSpeedExamples writes them (its 18 1-bit
ds_configs use four shapes, reproduced here), DeepSpeed's defaults and spellings, and the
combinations they cannot run in."""

from __future__ import annotations

import pytest
import torch

import deepshard
from deepshard.config import load_config
from deepshard.errors import UsageError

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
# (type as spelled there, params) for bing_bert's and BingBertSquad's 1-bit configs
EXAMPLES = [
    ("OneBitAdam", {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False,
                    "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"}),
    ("OnebitAdam", {"lr": 3e-5, "weight_decay": 0.0, "bias_correction": False,
                    "freeze_step": 400, "cuda_aware": True, "comm_backend_name": "mpi"}),
    ("ZeroOneAdam", {"lr": 4e-4, "weight_decay": 0.01, "bias_correction": False,
                     "var_freeze_step": 12500, "local_step_scaler": 32678,
                     "cuda_aware": False, "comm_backend_name": "nccl"}),
    ("OneBitLamb", {"lr": 2e-3, "weight_decay": 0.01, "bias_correction": False,
                    "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 6100,
                    "cuda_aware": False, "comm_backend_name": "mpi", "coeff_beta": 0.9,
                    "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}),
]
CANONICAL = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
             "onebitlamb": "OneBitLamb"}


def config(type_name: str, params: dict, **extra) -> dict:
    return {"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64,
            "steps_per_print": 100, "prescale_gradients": False, "gradient_clipping": 1.0,
            "wall_clock_breakdown": False, "fp16": FP16,
            "optimizer": {"type": type_name, "params": params}, **extra}


@pytest.mark.parametrize(("type_name", "params"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_deepspeed_examples_one_bit_configs_load(type_name, params):
    cfg = load_config(config(type_name, params), world_size=64).config
    assert cfg.optimizer.type == CANONICAL[type_name.lower()]
    dumped = cfg.optimizer.params.model_dump()
    assert {k: dumped[k] for k in params} == params
    assert cfg.gradient_accumulation_steps == 1


def test_defaults_are_deepspeeds():
    adam = load_config(config("OneBitAdam", {}), world_size=64).config.optimizer.params
    assert (adam.lr, adam.freeze_step, adam.betas, adam.eps, adam.eps_inside_sqrt) == \
        (1e-3, 100000, (0.9, 0.999), 1e-8, False)
    assert (adam.bias_correction, adam.cuda_aware, adam.comm_backend_name) == \
        (True, False, "nccl")
    zo = load_config(config("ZeroOneAdam", {}), world_size=64).config.optimizer.params
    assert (zo.var_freeze_step, zo.var_update_scaler, zo.local_step_scaler,
            zo.local_step_clipper) == (100000, 16, 32678, 16)
    lamb = load_config(config("OneBitLamb", {}), world_size=64).config.optimizer.params
    assert (lamb.max_coeff, lamb.min_coeff, lamb.coeff_beta, lamb.factor_max,
            lamb.factor_min, lamb.factor_threshold) == (10.0, 0.01, 0.9, 4.0, 0.5, 0.1)


@pytest.mark.parametrize(("key", "value", "message", "hint"), [
    ("comm_backend_name", "gloo", "'gloo' is not an accepted value",
     "use one of: 'nccl', 'mpi', 'compressed'"),
    ("amsgrad", True, "the 1-bit optimizers have no AMSGrad variant", "remove amsgrad"),
    ("var_freeze_step", 10, "unknown key, did you mean 'freeze_step'",
     "rename it to 'freeze_step'"),  # ZeroOneAdam's key on OneBitAdam
])
def test_bad_one_bit_params_are_one_line_with_the_key(key, value, message, hint):
    with pytest.raises(UsageError) as err:
        load_config(config("OneBitAdam", {key: value}), world_size=64)
    assert err.value.where == f"<dict>: optimizer.params.{key}"
    assert err.value.message == message
    assert err.value.hint.startswith(hint)


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


@pytest.mark.parametrize(("type_name", "stage", "hint"), [
    ("OneBitAdam", 2, "use stage 0 or 1"), ("OneBitAdam", 3, "use stage 0 or 1"),
    ("ZeroOneAdam", 1, "use stage 0:"), ("OneBitLamb", 1, "stage 0 for OneBitLamb")])
def test_stages_a_one_bit_optimizer_cannot_run_at(one_process, type_name, stage, hint):
    model = tiny()
    with pytest.raises(UsageError) as err:
        deepshard.initialize(model=model, model_parameters=model.parameters(), config={
            "train_batch_size": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": type_name, "params": {"freeze_step": 1}
                          if type_name != "ZeroOneAdam" else {}}})
    assert hint in err.value.hint
    assert err.value.where.endswith(("zero_optimization.stage", "optimizer.type"))


def test_a_client_one_bit_optimizer_gets_the_same_rules(one_process):
    from deepshard.runtime.optim.onebit import OneBitAdam, ZeroOneAdam

    for stage, cls in ((1, ZeroOneAdam), (2, OneBitAdam)):
        model = tiny()
        with pytest.raises(UsageError) as err:
            deepshard.initialize(model=model, optimizer=cls(model.parameters(), lr=1e-3),
                                 config={"train_batch_size": 2,
                                         "zero_optimization": {"stage": stage}})
        assert err.value.message == f"{cls.__name__} at ZeRO stage {stage}"
        assert err.value.where == "zero_optimization.stage"
    model = tiny()
    engine, *_ = deepshard.initialize(model=model, optimizer=OneBitAdam(model.parameters()),
                                      config={"train_batch_size": 2,
                                              "zero_optimization": {"stage": 1}})
    assert type(engine.strategy).__name__ == "OneBitZeroStrategy"
