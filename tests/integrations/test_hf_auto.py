"""``HfTrainerDeepShardConfig`` fills "auto" exactly as transformers' own class does (its
methods run here over the same base, side by side), and reports mismatches as one line.
No processes: ``TrainingArguments`` without ``deepspeed=`` and a world of one."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from deepshard.errors import UsageError
from deepshard.integrations.hf_auto import HfTrainerDeepShardConfig
from deepshard.integrations.hf_config import HfDeepShardConfig

ALL_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": "auto"},
}


def transformers_class():
    """transformers' ``HfTrainerDeepSpeedConfig`` methods over deepshard's base (its own
    base needs the deepspeed package)."""
    from transformers.integrations import deepspeed as hf

    body = {name: hf.HfTrainerDeepSpeedConfig.__dict__[name]
            for name in ("fill_match", "fill_only", "is_auto", "dtype",
                         "trainer_config_process", "trainer_config_finalize")}

    def __init__(self, source):
        HfDeepShardConfig.__init__(self, source)
        self._dtype, self.mismatches = None, []

    return type("Theirs", (HfDeepShardConfig,), {**body, "__init__": __init__})


def training_args(tmp_path, **kwargs):
    import transformers

    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=3,
                    gradient_accumulation_steps=2, learning_rate=3e-4, adam_beta1=0.8,
                    adam_beta2=0.99, adam_epsilon=1e-7, weight_decay=0.1, max_grad_norm=0.7,
                    warmup_steps=5, report_to="none", use_cpu=True)
    return transformers.TrainingArguments(**{**defaults, **kwargs})


def model(hidden: int = 32):
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))


def both(config: dict, args, steps: int = 40, mdl=None) -> tuple[dict, dict]:
    ours, theirs = HfTrainerDeepShardConfig(config), transformers_class()(config)
    for cfg in (ours, theirs):
        cfg.trainer_config_process(args)
        cfg.trainer_config_finalize(args, mdl or model(), steps)
    assert ours.dtype() == theirs.dtype()
    return ours.config, theirs.config


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_all_auto_filled_as_transformers(tmp_path, stage):
    config = copy.deepcopy(ALL_AUTO)
    config["zero_optimization"]["stage"] = stage
    ours, theirs = both(config, training_args(tmp_path))
    assert ours == theirs
    assert ours["train_micro_batch_size_per_gpu"] == 3 and ours["train_batch_size"] == 6
    assert ours["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-7,
                                           "weight_decay": 0.1}
    assert ours["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                           "warmup_num_steps": 5, "total_num_steps": 40}
    assert ours["zero_optimization"]["reduce_bucket_size"] == 32 * 32
    assert ours["gradient_clipping"] == 0.7


def test_precision_and_node_storage_as_transformers(tmp_path):
    args = training_args(tmp_path, bf16=True, save_on_each_node=True, warmup_steps=0)
    ours, theirs = both(ALL_AUTO, args)
    assert ours == theirs
    assert ours["bf16"]["enabled"] is True and ours["fp16"]["enabled"] is False
    assert ours["checkpoint"] == {"use_node_local_storage": True}
    assert ours["scheduler"]["params"]["warmup_num_steps"] == 1  # kept positive


def test_hidden_sizes_and_text_config_as_transformers(tmp_path):
    args = training_args(tmp_path)
    for mdl in (SimpleNamespace(config=SimpleNamespace(hidden_sizes=[8, 24, 16])),
                SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(
                    hidden_size=12)))):
        ours, theirs = both(ALL_AUTO, args, mdl=mdl)
        assert ours == theirs


def test_set_values_that_agree_stay(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.7, "zero_optimization": {"stage": 2}}
    ours, theirs = both(config, training_args(tmp_path))
    assert ours == theirs == config


def test_mismatches_are_one_line_naming_both(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}
    cfg = HfTrainerDeepShardConfig(config)
    cfg.trainer_config_process(training_args(tmp_path))  # collects, raises at finalize
    with pytest.raises(UsageError) as info:
        cfg.trainer_config_finalize(training_args(tmp_path), model(), 10)
    text = str(info.value)
    assert "\n" not in text
    assert "train_micro_batch_size_per_gpu=8 but TrainingArguments " \
           "per_device_train_batch_size=3" in text
    assert "gradient_clipping=1.0 but TrainingArguments max_grad_norm=0.7" in text
    assert "optimizer.params.lr=0.001 but TrainingArguments learning_rate=0.0003" in text
    assert "gradient_accumulation_steps=2" not in text  # agrees
    assert 'HINT: set train_micro_batch_size_per_gpu, gradient_clipping, ' \
           'optimizer.params.lr to "auto"' in text


def test_auto_batch_finder_does_not_check_the_micro_batch(tmp_path):
    cfg = HfTrainerDeepShardConfig({"train_micro_batch_size_per_gpu": 8})
    cfg.trainer_config_process(training_args(tmp_path), auto_find_batch_size=True)
    assert cfg.mismatches == []


def test_auto_buckets_need_a_hidden_size(tmp_path):
    cfg = HfTrainerDeepShardConfig(ALL_AUTO)
    cfg.trainer_config_process(training_args(tmp_path))
    with pytest.raises(UsageError, match=r"neither hidden_size nor hidden_sizes.*HINT"):
        cfg.trainer_config_finalize(training_args(tmp_path), SimpleNamespace(), 10)


def test_accelerate_fills_what_transformers_leaves():
    cfg = HfTrainerDeepShardConfig({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto",
                              "stage3_gather_16bit_weights_on_model_save": "auto"}})
    cfg.fill_accelerate_defaults(model(10), world_size=4)
    assert cfg.config["train_batch_size"] == 24 and cfg.config["gradient_clipping"] == 1.0
    assert cfg.config["zero_optimization"] == {
        "stage": 2, "stage3_prefetch_bucket_size": 90,
        "stage3_gather_16bit_weights_on_model_save": False}


def test_dtype_before_process_is_an_error():
    with pytest.raises(UsageError, match="trainer_config_process"):
        HfTrainerDeepShardConfig({}).dtype()


def test_finalize_again_for_other_steps_starts_from_the_processed_values(tmp_path):
    args = training_args(tmp_path)
    cfg = HfTrainerDeepShardConfig(ALL_AUTO)
    cfg.trainer_config_process(args)
    config = cfg.config
    cfg.trainer_config_finalize(args, model(), 0)  # evaluate() first: an inference engine
    cfg.trainer_config_finalize(args, model(), 40)  # then train(): no mismatch with the 0
    assert cfg.config is config and config["scheduler"]["params"]["total_num_steps"] == 40
