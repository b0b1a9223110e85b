"""``scripts/bf16_backward.py`` (training/bf16_master_weight/train.py's pattern with
``loss.backward(); model_engine.step()``) at ZeRO 1 and 3, bf16.

bf16 training cannot match fp32 at 1e-5, so it is checked twice:

- against the same script with ``model_engine.backward(loss)``: bitwise equal losses, fp32
  masters and bf16 weights (PyTorch-style backward is the engine's backward);
- against plain torch doing what bf16 mixed precision does: the module cast to bf16 and
  fp32 masters copied from it (so they start bf16-rounded), each rank's micro-batch
  forward and backward in bf16, the ranks' gradients averaged and rounded to bf16 (the
  all-reduce runs in the training dtype: ``communication_data_type`` unset), global-norm
  clipping at 1.0 (the default), AdamW on the fp32 masters, masters rounded back into the
  module. Workers and reference run one thread each: bf16 kernels' sums (LayerNorm's weight
  gradient) round differently with the thread count, one bf16 ulp, and through Adam that
  alone moves masters by ~2e-5.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn

from tests.compat.common import DEFAULT_CLIP, SCRIPTS, loss_diff, max_diff, run_compat
from tests.compat.scripts.tiny_models import TinyLM, token_batch

CONFIG = json.loads((SCRIPTS / "bf16_config.json").read_text())
LR = CONFIG["optimizer"]["params"]["lr"]
WORLD, STEPS, SEED = 2, 4, 42  # the script's defaults (and vocab 32, hidden 16, seq 8)
MICRO = CONFIG["train_micro_batch_size_per_gpu"]
# Tolerances from bf16 rounding. An Adam step moves a master by about lr * m / sqrt(v); a
# gradient one bf16 rounding (relative 2**-8) off changes that by about lr * 2**-8, so
# after STEPS steps the masters may differ by STEPS * lr * 2**-8 (1.6e-5). That holds only
# where gradients are not near zero (there a rounding can flip the sign of Adam's first
# step: 2 * lr), so the reference reproduces the workers' roundings rather than tolerating
# them: one thread each, the gradient average rounded to bf16. Measured: 1e-8. A bf16
# value (weight or loss) may still round one ulp, at most 2**-7 relative, the other way;
# the mean of two ranks' bf16 losses is exact in fp32.
MASTER_ATOL = STEPS * LR * 2**-8
BF16_RTOL = 2**-7


@contextlib.contextmanager
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference(half: bool = True):
    """One process doing what bf16 mixed precision on WORLD ranks does (``half=False``: the
    same from the same bf16-rounded start, in fp32): per-step mean losses, fp32 masters
    and module weights."""
    torch.manual_seed(SEED)
    model = TinyLM().bfloat16()
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    if not half:
        model.float()
    params = CONFIG["optimizer"]["params"]
    opt = torch.optim.AdamW(masters, lr=LR, betas=params["betas"], eps=params["eps"],
                            weight_decay=params["weight_decay"])
    losses = []
    with one_thread():
        for step in range(STEPS):
            grads = [torch.zeros_like(m) for m in masters]
            rank_losses = []
            for rank in range(WORLD):
                input_ids, labels = token_batch(step, rank, MICRO)
                logits = model(input_ids)
                loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                   labels.view(-1))
                model.zero_grad()
                loss.backward()
                for g, p in zip(grads, model.parameters(), strict=True):
                    g += p.grad.float()
                rank_losses.append(loss.float().item())
            for m, g in zip(masters, grads, strict=True):
                m.grad = (g / WORLD).to(next(model.parameters()).dtype).float()
            torch.nn.utils.clip_grad_norm_(masters, DEFAULT_CLIP)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
            losses.append(sum(rank_losses) / WORLD)
    names = [n for n, _ in model.named_parameters()]
    return (losses, dict(zip(names, (m.detach() for m in masters), strict=True)),
            {n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One job per (stage, backward style), run on first use: every rank's saved results."""
    done: dict[tuple[int, str], list[dict]] = {}

    def get(stage: int, backward: str) -> list[dict]:
        if (stage, backward) not in done:
            out = tmp_path_factory.mktemp(f"bf16-zero{stage}-{backward}")
            done[stage, backward] = run_compat(
                "bf16_backward.py", out, "--deepspeed_config",
                str(SCRIPTS / "bf16_config.json"), "--stage", str(stage), "--backward",
                backward, "--num_steps", str(STEPS), threads=1)
        return done[stage, backward]

    return get


@pytest.mark.parametrize("stage", [1, 3])
def test_loss_backward_is_engine_backward(stage, runs):
    for torch_style, engine_style in zip(runs(stage, "torch"), runs(stage, "engine"),
                                             strict=True):
        assert torch_style["losses"] == engine_style["losses"]
        for kind in ("masters", "weights"):
            diff, where = max_diff(torch_style[kind], engine_style[kind])
            assert diff == 0.0, (kind, where, diff)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_matches_mixed_precision_reference(stage, runs):
    want_losses, want_masters, want_weights = reference()
    for rank, saved in enumerate(runs(stage, "torch")):
        for name, weight in saved["weights"].items():
            assert weight.dtype == torch.bfloat16, name
            assert torch.equal(weight, saved["masters"][name].bfloat16()), name
        diff, where = max_diff(saved["masters"], want_masters)
        assert diff <= MASTER_ATOL, (rank, where, diff)
        for name, want in want_weights.items():
            torch.testing.assert_close(saved["weights"][name], want, rtol=BF16_RTOL, atol=0)
        for got, want in zip(saved["losses"], want_losses, strict=True):
            assert abs(got - want) <= BF16_RTOL * abs(want), (rank, saved["losses"],
                                                              want_losses)


def test_the_bf16_tolerance_tells_bf16_from_fp32():
    """The tolerances are no formality: fp32 training from the same start ends far outside
    them."""
    bf16, fp32 = reference(), reference(half=False)
    assert max_diff(bf16[1], fp32[1])[0] > 10 * MASTER_ATOL
    assert loss_diff(bf16[0], fp32[0]) > 0.5 * BF16_RTOL * max(bf16[0])
