"""Activation checkpointing against the same block run without it (exact gradients)."""

from __future__ import annotations

import contextvars
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepshard.errors import UsageError
from deepshard.runtime import activation_checkpointing as ac
from deepshard.runtime.activation_checkpointing import Checkpointer, CheckpointingConfig


def make_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 16),
                         nn.Tanh())


def grads(block: nn.Module, run, seed: int = 7):
    """Output, input gradient and parameter gradients of ``run(block, x)``, from one seed."""
    block.zero_grad(set_to_none=True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(seed)
    out = run(block, x)
    (out * torch.arange(16.0)).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in block.parameters()]


def assert_same(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_gradients_equal_plain_run_with_dropout(cpu_checkpointing):
    block = make_block()
    checkpointer = Checkpointer(CheckpointingConfig(cpu_checkpointing=cpu_checkpointing))
    out, x_grad, p_grads = grads(block, checkpointer.checkpoint)
    ref_out, ref_x_grad, ref_p_grads = grads(block, lambda b, x: b(x))
    assert_same(out, ref_out)
    assert_same(x_grad, ref_x_grad)
    for got, want in zip(p_grads, ref_p_grads, strict=True):
        assert_same(got, want)
    # the dropout mask really was random: another seed gives other gradients
    other = grads(block, checkpointer.checkpoint, seed=8)[1]
    assert not torch.equal(other, ref_x_grad)


def test_rng_state_after_backward_is_that_of_a_plain_run():
    block = make_block()
    grads(block, Checkpointer().checkpoint)
    after_checkpointed = torch.rand(4)
    grads(block, lambda b, x: b(x))
    assert_same(after_checkpointed, torch.rand(4))


def count_saved(run) -> list[torch.Size]:
    """Shapes of the tensors autograd saves for backward while ``run()`` executes."""
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run().sum().backward()
    return saved


def test_only_the_inputs_are_kept_for_backward():
    block = make_block()
    x = torch.randn(8, 16, requires_grad=True)
    plain = count_saved(lambda: block(x))
    checkpointed = count_saved(lambda: Checkpointer().checkpoint(block, x))
    assert checkpointed == [torch.Size([8, 16])]
    # plain keeps the hidden activations too: (8, 64) after Linear, GELU and Dropout
    assert plain.count(torch.Size([8, 64])) >= 3
    assert len(plain) > 4


@pytest.fixture
def offloaded(monkeypatch) -> list[tuple[torch.Size, torch.device]]:
    """(shape, where it is stored) of each tensor torch's save_on_cpu packs in the test."""
    packed: list[tuple[torch.Size, torch.device]] = []

    class Spy(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            real_pack = self.pack_hook

            def pack(tensor):
                device, stored = real_pack(tensor)
                packed.append((tensor.shape, stored.device))
                return device, stored

            self.pack_hook = pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    return packed


def test_cpu_checkpointing_sends_the_saved_inputs_through_save_on_cpu(offloaded):
    block = make_block()
    x = torch.randn(8, 16, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    checkpointer = Checkpointer(CheckpointingConfig(cpu_checkpointing=True))
    out = checkpointer.checkpoint(lambda t, *, s: block(t) * s, x, s=scale)
    assert offloaded == [(torch.Size([8, 16]), torch.device("cpu")),
                                 (torch.Size([]), torch.device("cpu"))]
    out.sum().backward()
    assert x.grad is not None and scale.grad is not None
    offloaded.clear()
    Checkpointer().checkpoint(block, x)
    assert offloaded == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_checkpointing_moves_cuda_inputs_to_host(offloaded):
    block = make_block().cuda()
    checkpointer = Checkpointer(CheckpointingConfig(cpu_checkpointing=True))

    def run(call):
        x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(1),
                        requires_grad=True)
        torch.manual_seed(7)
        call(block, x).sum().backward()
        return x.grad

    grad = run(checkpointer.checkpoint)
    assert offloaded == [(torch.Size([8, 16]), torch.device("cpu"))]
    assert grad.device.type == "cuda"
    assert_same(grad, run(lambda b, x: b(x)))


def test_kwargs_pass_through_and_get_gradients():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)

    def f(x, *, bias, scale=1.0, tag=None):
        assert tag == "kept"
        return torch.sigmoid(layer(x) + bias) * scale

    def run(checkpointed: bool):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
        bias = torch.full((4,), 0.5, requires_grad=True)
        call = Checkpointer().checkpoint if checkpointed else (lambda fn, *a, **k: fn(*a, **k))
        out = call(f, x, bias=bias, scale=3.0, tag="kept")
        out.pow(2).sum().backward()
        return out.detach(), x.grad, bias.grad

    for got, want in zip(run(True), run(False), strict=True):
        assert_same(got, want)


def test_several_outputs_come_back_as_returned():
    x = torch.randn(3, requires_grad=True)
    a, b = Checkpointer().checkpoint(lambda t: (t.sin(), t.cos()), x)
    (a + b).sum().backward()
    assert_same(x.grad, x.detach().cos() - x.detach().sin())


def in_fresh_context(fn):
    return contextvars.Context().run(fn)


def test_configure_is_scoped_to_its_context():
    def configured():
        assert not ac.is_configured()
        notes = ac.configure(None, checkpoint_in_cpu=True, num_checkpoints=4)
        assert notes == []
        assert ac.is_configured()
        return ac._ACTIVE.get().config

    config = in_fresh_context(configured)
    assert config == CheckpointingConfig(cpu_checkpointing=True, number_checkpoints=4)
    assert in_fresh_context(ac.is_configured) is False


def test_module_checkpoint_uses_the_configured_settings(offloaded):
    block = make_block()

    def run():
        x = torch.randn(2, 16, requires_grad=True)
        ac.checkpoint(block, x)  # defaults before configure, as in DeepSpeed
        before = list(offloaded)
        ac.configure(None, checkpoint_in_cpu=True)
        ac.checkpoint(block, x)
        return before, list(offloaded)

    before, after = in_fresh_context(run)
    assert before == [] and after == [(torch.Size([2, 16]), torch.device("cpu"))]


def test_settings_without_effect_are_reported():
    def run():
        return ac.configure(None, partition_activations=True, contiguous_checkpointing=True,
                            synchronize=True, profile=True)

    notes = in_fresh_context(run)
    assert [n.split("=")[0] for n in notes] == [
        "activation_checkpointing.partition_activations",
        "activation_checkpointing.contiguous_memory_optimization",
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "activation_checkpointing.profile"]
    assert all("has no effect" in n for n in notes)


@pytest.mark.parametrize("source", [
    {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 6},
     "train_batch_size": 8},
    {"cpu_checkpointing": True, "number_checkpoints": 6},
    SimpleNamespace(cpu_checkpointing=True, number_checkpoints=6, partition_activations=False),
    SimpleNamespace(activation_checkpointing=SimpleNamespace(cpu_checkpointing=True,
                                                             number_checkpoints=6)),
])
def test_deepspeed_config_forms(source):
    def run():
        ac.configure(None, deepspeed_config=source)
        return ac._ACTIVE.get().config

    assert in_fresh_context(run) == CheckpointingConfig(cpu_checkpointing=True,
                                                        number_checkpoints=6)


def test_keywords_override_deepspeed_config_and_a_config_without_the_section_is_default():
    def run(source, **keywords):
        ac.configure(None, deepspeed_config=source, **keywords)
        return ac._ACTIVE.get().config

    got = in_fresh_context(lambda: run({"cpu_checkpointing": True}, checkpoint_in_cpu=False,
                                       profile=True))
    assert got == CheckpointingConfig(cpu_checkpointing=False, profile=True)
    assert in_fresh_context(lambda: run({"train_batch_size": 8})) == CheckpointingConfig()


def test_deepspeed_config_file_in_deepspeed_dialect(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  // as users write them\n  "train_batch_size": 8,\n'
                    '  "activation_checkpointing": {"cpu_checkpointing": true,'
                    ' "number_checkpoints": 6, "partition_activations": true,},\n}\n')

    def run():
        notes = ac.configure(None, deepspeed_config=str(path))
        return notes, ac._ACTIVE.get().config

    notes, config = in_fresh_context(run)
    assert config == CheckpointingConfig(cpu_checkpointing=True, number_checkpoints=6,
                                         partition_activations=True)
    assert len(notes) == 1 and notes[0].startswith("activation_checkpointing.partition_")


@pytest.mark.parametrize(("source", "match"), [
    ("no/such/ds_config.json", "no/such/ds_config.json: config file not found"),
    ({"activation_checkpointing": {"cpu_checkpoint": True}},
     "activation_checkpointing.cpu_checkpoint: unknown key, did you mean 'cpu_checkpointing'"),
    ({"cpu_checkpointing": "yes"}, "cpu_checkpointing: expected true or false, got 'yes'"),
    ({"activation_checkpointing": {"number_checkpoints": 2.5}},
     "activation_checkpointing.number_checkpoints: expected a non-negative integer"),
])
def test_bad_deepspeed_config_is_a_usage_error(source, match):
    def run():
        with pytest.raises(UsageError, match=re.escape(match)) as info:
            ac.configure(None, deepspeed_config=source)
        return info.value, ac.is_configured()

    error, configured = in_fresh_context(run)
    assert "HINT:" in str(error)
    assert not configured  # a failed configure leaves the previous settings
