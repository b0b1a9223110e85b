"""deepshard.initialize in one process (a real gloo group of one): the API's contracts."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch.utils.data import TensorDataset

import deepshard
from deepshard.errors import UsageError, render

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


@pytest.fixture(autouse=True)
def _one_process_group(one_process):
    """Every test here builds its engine in a one-process group of its own."""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_returns_engine_optimizer_loader_and_scheduler():
    data = TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "optimizer": ADAMW,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine, opt, loader, sched = deepshard.initialize(model=model(), config=config,
                                                      training_data=data)
    assert isinstance(engine, deepshard.DeepShardEngine)
    assert engine.optimizer is opt and engine.lr_scheduler is sched
    assert isinstance(opt, torch.optim.AdamW)
    assert engine.train_batch_size() == 4 and engine.train_micro_batch_size_per_gpu() == 2
    assert [len(x) for x, _ in loader] == [2, 2, 2, 2, 2]
    assert engine.get_lr() == [0.0]  # WarmupLR starts at warmup_min_lr
    assert engine.is_gradient_accumulation_boundary() is False


def test_accumulation_scales_the_loss_and_steps_at_the_boundary():
    net = model()
    reference = model()
    engine, _, _, _ = deepshard.initialize(
        model=net, config={"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2,
                           "gradient_clipping": 0, "optimizer": {"type": "SGD",
                                                                 "params": {"lr": 0.1}}})
    assert engine.gradient_accumulation_steps() == 3
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    before = [p.detach().clone() for p in net.parameters()]
    for i in range(3):
        loss = torch.nn.functional.mse_loss(engine(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2])
        engine.backward(loss)
        if i < 2:
            engine.step()
            assert engine.global_steps == 0
            assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    engine.step()
    assert engine.global_steps == 1 and engine.micro_steps == 3
    torch.nn.functional.mse_loss(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert all(float(p.grad.abs().sum()) == 0 for p in net.parameters())  # zeroed after step


def test_client_optimizer_steps_fp32_masters_under_bf16():
    net = model()
    client = torch.optim.SGD(net.parameters(), lr=0.5)
    engine, opt, _, _ = deepshard.initialize(
        model=net, optimizer=client, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(
            o, step_size=1, gamma=0.5),
        config={"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}})
    assert opt is client
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    loss = engine(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    assert engine.get_lr() == [0.25]
    masters = opt.param_groups[0]["params"]
    for p, m in zip(engine.module.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"config": {"train_micro_batch_size_per_gpu": 1}, "args": "with-config"},
     "a config was given both as --deepspeed_config and as config="),
    ({}, "no DeepSpeed config given"),
    ({"config": {"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2}}},
     "pipeline.stages: pipeline.stages is 2 but the model is a plain"),
])
def test_usage_errors_are_catchable_one_line_errors(tmp_path, kwargs, fragment):
    net = model()
    if kwargs.get("args") == "with-config":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
        kwargs["args"] = argparse.Namespace(deepspeed_config=str(path))
    with pytest.raises(UsageError) as exc:
        deepshard.initialize(model=net, **kwargs)
    line = render(exc.value)
    assert "\n" not in line and line.startswith("deepshard: error: ") and fragment in line


def test_args_config_file_and_add_config_arguments(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_micro_batch_size_per_gpu: 3\noptimizer:\n  type: SGD\n"
                    "  params: {lr: 0.1}\n")
    parser = deepshard.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    net = model()
    engine, opt, _, _ = deepshard.initialize(args=args, model=net,
                                             model_parameters=net.parameters())
    assert engine.train_batch_size() == 3 and isinstance(opt, torch.optim.SGD)


def _train_one(engine, dtype=torch.float32):
    loss = engine(torch.randn(3, 4, dtype=dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def test_zero_grad_on_the_returned_optimizer_does_not_stop_training():
    """DeepSpeed scripts call optimizer.zero_grad(); with bf16 masters it must stay harmless."""
    engine, opt, _, _ = deepshard.initialize(
        model=model(), config={"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for _ in range(3):
        before = [p.detach().clone() for p in engine.module.parameters()]
        opt.zero_grad()
        _train_one(engine, torch.bfloat16)
        assert any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters(),
                                                         strict=True))


def test_backward_returns_the_accumulation_scaled_loss():
    engine, _, _, _ = deepshard.initialize(
        model=model(), config={"train_batch_size": 4, "gradient_accumulation_steps": 4,
                               "optimizer": ADAMW})
    loss = engine(torch.randn(1, 4)).pow(2).mean()
    assert torch.equal(engine.backward(loss), loss / 4)


def test_checkpoint_tags_latest_and_precision_changes(tmp_path):
    """bf16 run saves; an fp32 run loads the fp32 masters, not the rounded bf16 weights;
    save_latest=False leaves ``latest``; re-saving a tag replaces it; bad tags are errors."""
    config = {"train_micro_batch_size_per_gpu": 3, "optimizer": ADAMW}
    half, _, _, _ = deepshard.initialize(model=model(),
                                         config={**config, "bf16": {"enabled": True}})
    _train_one(half, torch.bfloat16)
    half.save_checkpoint(tmp_path, tag="a", client_state={"k": 1})
    _train_one(half, torch.bfloat16)
    half.save_checkpoint(tmp_path, tag="b", save_latest=False)
    assert (tmp_path / "latest").read_text() == "a"
    masters = half.strategy.masters_by_name(half.module)
    _train_one(half, torch.bfloat16)
    half.save_checkpoint(tmp_path, tag="b", save_latest=False)  # same tag again: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest", "zero_to_fp32.py"]
    fresh = half.strategy.masters_by_name(half.module)
    full, _, _, _ = deepshard.initialize(model=model(), config=config)
    path, client = full.load_checkpoint(tmp_path, tag="b")
    assert path == str(tmp_path / "b") and client == {}
    for name, p in full.module.named_parameters():
        assert torch.equal(p, fresh[name]) and not torch.equal(p, masters[name])
    path, client = full.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "a") and client == {"k": 1}
    for bad in ("latest", "", "../x"):
        with pytest.raises(UsageError, match="cannot be a directory name"):
            full.save_checkpoint(tmp_path, tag=bad)


def test_tied_weights_keep_fp32_masters_under_every_name(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model()
            self.extra = torch.nn.Linear(8, 1)
            self.extra.weight = self.body[2].weight  # tied: one parameter, two names

        def forward(self, x):
            return self.body(x)

    net = Tied()
    engine, _, _, _ = deepshard.initialize(
        model=net, config={"train_micro_batch_size_per_gpu": 3, "fp16": {"enabled": True},
                           "optimizer": ADAMW})
    _train_one(engine, torch.float16)
    engine.save_checkpoint(tmp_path, tag="t")
    state = deepshard.get_fp32_state_dict(tmp_path)
    assert torch.equal(state["extra.weight"], state["body.2.weight"])
    assert state["body.2.weight"].dtype == torch.float32
    assert not torch.equal(state["body.2.weight"], state["body.2.weight"].half().float())


def test_activation_checkpointing_section_configures_deepshard_checkpointing(caplog):
    """As DeepSpeed scripts expect, the config's section drives deepshard.checkpointing;
    run in a copied context so the setting does not leak into other tests."""
    import contextvars

    from deepshard.runtime import activation_checkpointing as ac

    def run():
        assert not deepshard.checkpointing.is_configured()
        deepshard.initialize(model=model(), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW,
            "activation_checkpointing": {"cpu_checkpointing": True,
                                         "partition_activations": True}})
        assert deepshard.checkpointing.is_configured()
        return ac._ACTIVE.get().config

    with caplog.at_level("WARNING", logger="deepshard"):
        settings = contextvars.copy_context().run(run)
    assert settings.cpu_checkpointing and settings.partition_activations
    assert any("partition_activations" in r.getMessage() for r in caplog.records)
    assert not deepshard.checkpointing.is_configured()


def test_unknown_config_key_is_one_warning_and_a_near_miss_an_error(caplog):
    config = {"train_batch_size": 4, "optimizer": ADAMW, "cuda_visible_devices": 0}
    with caplog.at_level("WARNING", logger="deepshard"):
        deepshard.initialize(model=model(), config=config)
    warnings = [r.getMessage() for r in caplog.records if "cuda_visible_devices" in
                r.getMessage()]
    assert len(warnings) == 1 and "ignored as DeepSpeed does" in warnings[0]
    with pytest.raises(UsageError, match="did you mean 'gradient_clipping'"):
        deepshard.initialize(model=model(), config={**config, "gradient_cliping": 1.0})


def test_comms_logger_section_configures_deepshard_comm():
    import deepshard.comm as comm

    try:
        deepshard.initialize(model=model(), config={
            "train_batch_size": 4, "optimizer": ADAMW,
            "comms_logger": {"enabled": True, "prof_all": True}})
        assert comm.comms_logger.enabled
        comm.all_reduce(torch.ones(2))
        assert comm.get_comm_operation_count() >= 1
    finally:
        comm.configure(enabled=False)
        comm.reset_log()


def test_client_optimizer_wins_over_the_config_section_with_one_warning(caplog):
    # DeepSpeedExamples' GAN and ImageNet scripts pass optimizer= with an optimizer section
    net = model()
    client = torch.optim.SGD(net.parameters(), lr=0.125)
    with caplog.at_level("WARNING", logger="deepshard"):
        _, opt, _, _ = deepshard.initialize(
            model=net, optimizer=client,
            config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW})
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.125
    assert sum("optimizer section (AdamW) is ignored" in r.getMessage()
               for r in caplog.records) == 1


def test_fp16_loss_backward_needs_engine_scale_as_in_deepspeed():
    engine, _, _, _ = deepshard.initialize(model=model(), config={
        "train_batch_size": 4, "optimizer": ADAMW, "fp16": {"enabled": True}})
    x = torch.randn(4, 4, dtype=torch.half)
    with pytest.raises(UsageError, match=r"engine\.scale\(loss\)\.backward\(\)"):
        engine(x).float().pow(2).mean().backward()
    engine.zero_grad()
    engine.scale(engine(x).float().pow(2).mean()).backward()
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
