"""``engine.eval_batch`` on pipelines, against single-process plain torch.

The gloo jobs (``scripts/pipe_eval.py``: 2 stages, one or two replicas) evaluate the example
GPT on a held-out batch between ``train_batch`` steps; the reference trains the dense GPT
in this process on each step's whole global batch and evaluates it in eval mode under
``no_grad``. A one-process group covers argument errors and the single-stage pipeline.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import deepshard
from deepshard.errors import UsageError, render
from tests.dist.test_engine import ADAMW, TINY, write_config
from tests.helpers import ROOT, run_ds

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, rank_indices, sample_batch, stdlib_corpus
from gpt_pipe import gpt_param_name, pipe_gpt

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "pipe_eval.py")
MICRO, GAS, STEPS, EVAL_STEP = 2, 2, 3, 1000  # as in the script


def held_out(corpus, count: int, dp: int, micro_step: int | None = None, replica: int = 0):
    """Global eval batch ``EVAL_STEP`` with ``count`` micro-batches per replica, or one
    replica's micro-batch."""
    if micro_step is not None:
        return sample_batch(corpus, rank_indices(EVAL_STEP, micro_step, replica, dp, MICRO,
                                                 count), 0, TINY.seq_len)
    size = MICRO * count * dp
    return sample_batch(corpus, np.arange(EVAL_STEP * size, (EVAL_STEP + 1) * size,
                                          dtype=np.uint64), 0, TINY.seq_len)


def reference(dp: int):
    """Plain torch: the eval loss before every step and after the last, the training
    curve, and the trained model."""
    torch.manual_seed(0)
    model = GPT(TINY)
    params = ADAMW["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"],
                            eps=1e-8, weight_decay=params["weight_decay"])
    corpus, size = stdlib_corpus(), MICRO * GAS * dp
    evals, losses = [], []
    for step in range(STEPS + 1):
        evals.append(evaluate(model, *held_out(corpus, GAS, dp)))
        if step == STEPS:
            break
        x, y = sample_batch(corpus, np.arange(step * size, (step + 1) * size, dtype=np.uint64),
                            0, TINY.seq_len)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return evals, losses, model


def evaluate(model, x, y=None):
    model.eval()
    with torch.no_grad():
        out = model(x, y)
    model.train()
    return out.item() if y is not None else out


@pytest.fixture(scope="module", params=[(2, 0), (4, 1)], ids=["pp2", "pp2xdp2-zero1"])
def job(request, tmp_path_factory):
    """One ds-run job per layout (world, ZeRO stage): every rank's saved results, and the
    single-process reference."""
    world, zero = request.param
    tmp = tmp_path_factory.mktemp(f"eval{world}")
    cfg = write_config(tmp, train_micro_batch_size_per_gpu=MICRO,
                       gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                       optimizer=ADAMW, pipeline={"stages": 2},
                       zero_optimization={"stage": zero})
    result = run_ds("--num_gpus", str(world), SCRIPT, "--config", cfg, "--out", str(tmp),
                    timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    dp = world // 2
    assert {r["dp_size"] for r in ranks} == {dp}
    return ranks, dp, reference(dp), result


def test_eval_loss_equals_plain_torch_on_every_rank(job):
    ranks, _, (want_evals, _, _), _ = job
    for r in ranks:
        np.testing.assert_allclose(r["evaluated"]["evals"], want_evals, rtol=1e-5, atol=0)
        # in eval mode: dropout off, so the untrained model's eval loss is the same
        np.testing.assert_allclose(r["evaluated_dropout"]["evals"][0], want_evals[0],
                                   rtol=1e-5, atol=0)


def test_evaluating_between_steps_leaves_training_unchanged(job):
    ranks, _, (_, want_losses, _), _ = job
    for r in ranks:
        for evaluated, plain in [("evaluated", "plain"),
                                 ("evaluated_dropout", "plain_dropout")]:
            assert r[evaluated]["losses"] == r[plain]["losses"], evaluated
            got, want = r[evaluated]["state"], r[plain]["state"]
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in got), evaluated
            assert r[evaluated]["counters_moved"] == [False] * (STEPS + 1)
        np.testing.assert_allclose(r["plain"]["losses"], want_losses, rtol=1e-4, atol=0)
        assert r["plain"]["losses"] != r["plain_dropout"]["losses"]  # dropout was live


def test_train_mode_is_restored(job):
    ranks, _, _, _ = job
    for r in ranks:
        assert r["evaluated"]["modes"] == [True] * (STEPS + 1)
        opts = r["options"]
        assert opts["kept_eval"] is False  # called in eval mode: stays in eval
        assert opts["mixed_modes"] == (True, False)  # a frozen submodule stays frozen
        assert opts["raised"] == ("data source failed", True)
        assert opts["after_errors"] is True


def test_options(job):
    ranks, dp, (_, _, model), result = job
    corpus = stdlib_corpus()
    last = [r for r in ranks if r["stage"] == 1]
    assert len(last) == dp
    for r in ranks:
        opts, replica, is_last = r["options"], r["dp_rank"], r["stage"] == 1
        # reduce_output=None: this replica's loss per micro-batch, broadcast to the pipe
        want = [evaluate(model, *held_out(corpus, GAS, dp, mb, replica)) for mb in range(GAS)]
        np.testing.assert_allclose(opts["per_micro_batch"], want, rtol=1e-5, atol=0)
        # bcast_loss=False: only the last stage has it
        if is_last:
            np.testing.assert_allclose(opts["no_bcast"], evaluate(
                model, *held_out(corpus, GAS, dp)), rtol=1e-5, atol=0)
        else:
            assert opts["no_bcast"] is None
        # return_logits: (loss, logits of the last micro-batch on the last stage)
        loss, logits = opts["with_logits"]
        np.testing.assert_allclose(loss, evaluate(model, *held_out(corpus, GAS, dp)),
                                   rtol=1e-5, atol=0)
        x, _ = held_out(corpus, GAS, dp, GAS - 1, replica)
        if is_last:
            torch.testing.assert_close(logits, evaluate(model, x), rtol=1e-4, atol=1e-5)
        else:
            assert logits is None
        # num_micro_batches=3 (not gradient_accumulation_steps)
        np.testing.assert_allclose(opts["three_micro_batches"], evaluate(
            model, *held_out(corpus, 3, dp)), rtol=1e-5, atol=0)
        # compute_loss=False: the outputs averaged over micro-batches and replicas, on the
        # last stage only (DeepSpeed broadcasts losses only)
        if is_last:
            mean = torch.stack([evaluate(model, held_out(corpus, GAS, dp, mb, rep)[0])
                                for mb in range(GAS) for rep in range(dp)]).mean(0)
            torch.testing.assert_close(opts["outputs"], mean, rtol=1e-4, atol=1e-5)
        else:
            assert opts["outputs"] is None
        # caught in the script: the exception's one line, nothing printed, no exit
        assert opts["bad_reduce"].startswith("deepshard: error: engine.eval_batch: "
                                             "reduce_output='sum' is not a reduction. HINT: ")
        assert opts["bad_count"].startswith("deepshard: error: engine.eval_batch: "
                                            "num_micro_batches=0 is not a count of "
                                            "micro-batches. HINT: ")
    assert "deepshard: error:" not in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


# One process, a single-stage pipeline ---------------------------------------------------


@pytest.fixture
def single_stage(one_process):
    deepshard.init_distributed(verbose=False)
    model = pipe_gpt(TINY, num_stages=1, seed=0)
    engine, _, _, _ = deepshard.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                "optimizer": ADAMW, "pipeline": {"stages": 1}})
    return engine  # one_process destroys its group after the test


def test_single_stage_matches_the_dense_model(single_stage):
    engine, corpus = single_stage, stdlib_corpus()
    batches = [held_out(corpus, GAS, 1, mb) for mb in range(GAS)]
    torch.manual_seed(0)
    dense = GPT(TINY)
    assert {gpt_param_name(k, TINY) for k in engine.module.state_dict()} == \
        set(dense.state_dict())
    grads = [None if p.grad is None else p.grad.clone() for p in engine.module.parameters()]
    got = engine.eval_batch(iter(batches))
    np.testing.assert_allclose(float(got), evaluate(dense, *held_out(corpus, GAS, 1)),
                               rtol=1e-5, atol=0)
    per_mb, logits = engine.eval_batch(iter(batches), reduce_output=None, return_logits=True)
    assert len(per_mb) == GAS
    np.testing.assert_allclose([float(v) for v in per_mb],
                               [evaluate(dense, *b) for b in batches], rtol=1e-5, atol=0)
    torch.testing.assert_close(logits, evaluate(dense, batches[-1][0]), rtol=1e-4, atol=1e-5)
    assert not logits.requires_grad and not got.requires_grad  # under no_grad
    assert engine.module.training and engine.global_steps == 0
    after = [p.grad for p in engine.module.parameters()]
    assert all(a is None if g is None else torch.equal(a, g) for g, a in
               zip(grads, after, strict=True))


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"reduce_output": "mean"}, "reduce_output='mean' is not a reduction. HINT: pass "
                                'reduce_output="avg"'),
    ({"num_micro_batches": 0}, "num_micro_batches=0 is not a count of micro-batches. HINT:"),
    ({"num_micro_batches": 1.5}, "num_micro_batches=1.5 is not a count"),
    ({"data_iter": None}, "needs data_iter on the first and last stages. HINT:"),
])
def test_bad_arguments_are_one_line_usage_errors(single_stage, kwargs, fragment):
    corpus = stdlib_corpus()
    data = iter([held_out(corpus, GAS, 1, mb) for mb in range(GAS)])
    with pytest.raises(UsageError) as exc:
        single_stage.eval_batch(**{"data_iter": data, **kwargs})
    line = render(exc.value)
    assert "\n" not in line and line.startswith("deepshard: error: engine.eval_batch: ")
    assert fragment in line
    assert single_stage.module.training
