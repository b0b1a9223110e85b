"""``deepspeed.ops.adagrad`` and ``deepspeed.ops.lion``: DeepSpeed's CPU Adagrad, CPU Lion and
FusedLion in torch ops, step for step equal to the formulas of DeepSpeed 0.19.8's kernels
(fp32, 1e-6), to torch's ``Adagrad`` where that is the same update, and to DeepSpeed's own
CPU optimizers run in /tmp/dsvenv; with DeepSpeed's state names, its refusals, and the
``Adagrad`` / ``Lion`` config types."""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from deepshard.errors import UsageError
from deepshard.runtime.optim import (
    DeepSpeedCPUAdagrad,
    DeepSpeedCPULion,
    FusedLion,
    build_optimizer,
)

TOL = dict(rtol=1e-6, atol=1e-6)
MOMENT_TOL = dict(rtol=1e-6, atol=1e-9)  # Lion's exp_avg ~ 1e-3 g early: atol would hide it
LIONS = [DeepSpeedCPULion, FusedLion]
DS_PYTHON = Path("/tmp/dsvenv/bin/python")


def params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen).to(dtype)),
            torch.nn.Parameter(torch.randn(11, generator=gen).to(dtype)),
            torch.nn.Parameter(torch.randn(3, generator=gen).to(dtype))]


def grads_per_step(ps, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in ps] for _ in range(steps)]


def two_groups(ps, **second):
    """The first two params under the defaults, the last with ``second``'s overrides."""
    return [{"params": ps[:2]}, {"params": ps[2:], **second}]


def run(optimizer, ps, history) -> None:
    for grads in history:
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def adagrad_reference(values, history, hps):
    """DeepSpeed's Adagrad from its formulas (``cpu_adagrad.cpp``), in float64;
    ``hps[i]``: (lr, eps, weight_decay) of parameter i."""
    values = [v.detach().double().clone() for v in values]
    sums = [torch.zeros_like(v) for v in values]
    for grads in history:
        for i, g in enumerate(grads):
            lr, eps, wd = hps[i]
            g = g.double() + (wd * values[i] if wd > 0 else 0)
            sums[i] = sums[i] + g * g
            values[i] = values[i] - lr * g / (sums[i].sqrt() + eps)
    return values, sums


def lion_reference(values, history, hps, rule: str):
    """DeepSpeed's Lion from its formulas (``cpu_lion_impl.cpp``, ``multi_tensor_lion.cu``)
    in float64, with the coefficients in fp32 as the kernels compute them; ``rule``: the
    CPU Lion's sign bit or the fused kernel's ``c > 0``."""
    values = [v.detach().double().clone() for v in values]
    moms = [torch.zeros_like(v) for v in values]
    for grads in history:
        for i, g in enumerate(grads):
            lr, (b1, b2), wd = hps[i]
            g = g.double()
            c = f32(b1) * moms[i] + f32(1 - f32(b1)) * g
            up = torch.signbit(c) if rule == "signbit" else ~(c > 0)
            step = torch.where(up, f32(lr), -f32(lr)).double()
            decay = float(1 - torch.tensor(lr, dtype=torch.float32) * f32(wd))
            values[i] = values[i] * (decay if wd > 0 else 1.0) + step
            moms[i] = f32(b2) * moms[i] + f32(1 - f32(b2)) * g
    return values, moms


# -- the updates ---------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_equals_its_formulas_and_torchs_adagrad(weight_decay):
    lr, eps = 5e-2, 1e-6
    ours, twin = params(), params()
    history = grads_per_step(ours, steps=5)
    opt = DeepSpeedCPUAdagrad(two_groups(ours, lr=0.2, weight_decay=0.3), lr=lr, eps=eps,
                              weight_decay=weight_decay)
    run(opt, ours, history)
    # torch's Adagrad with lr_decay=0, initial_accumulator_value=0 is the same update: eps
    # after the square root, L2 decay added to the gradient
    ref_opt = torch.optim.Adagrad(two_groups(twin, lr=0.2, weight_decay=0.3), lr=lr, eps=eps,
                                  weight_decay=weight_decay, lr_decay=0,
                                  initial_accumulator_value=0)
    run(ref_opt, twin, history)
    hps = [(lr, eps, weight_decay)] * 2 + [(0.2, eps, 0.3)]
    want, sums = adagrad_reference(params(), history, hps)
    for p, q, w, s in zip(ours, twin, want, sums, strict=True):
        torch.testing.assert_close(p.detach(), w.float(), **TOL)
        torch.testing.assert_close(p, q, **TOL)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], s.float(), **TOL)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["sum"], **TOL)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("cls", LIONS)
def test_lion_equals_its_formulas(cls, weight_decay):
    lr, betas = 1e-2, (0.8, 0.99)
    ours = params()
    history = grads_per_step(ours, steps=5)
    opt = cls(two_groups(ours, lr=3e-2, betas=(0.9, 0.999), weight_decay=0.5), lr=lr,
              betas=betas, weight_decay=weight_decay)
    run(opt, ours, history)
    hps = [(lr, betas, weight_decay)] * 2 + [(3e-2, (0.9, 0.999), 0.5)]
    want, moms = lion_reference(params(), history, hps, cls.sign_rule)
    for p, w, m in zip(ours, want, moms, strict=True):
        torch.testing.assert_close(p.detach(), w.float(), **TOL)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m.float(), **MOMENT_TOL)


@pytest.mark.parametrize(("cls", "m", "g", "moved"), [
    (DeepSpeedCPULion, 0.0, 0.0, -1.0),  # c = +0: -copysign(lr, +0) = -lr
    (DeepSpeedCPULion, 0.0, -0.0, -1.0),  # +0 + -0 = +0
    (DeepSpeedCPULion, -0.0, -0.0, 1.0),  # c = -0: +lr
    (FusedLion, 0.0, 0.0, 1.0),  # not c > 0: +lr
    (FusedLion, -0.0, -0.0, 1.0),
])
def test_a_zero_interpolation_steps_by_lr_as_each_original_does(cls, m, g, moved):
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), g)
    opt = cls([p], lr=0.5)
    opt.state[p] = {"step": 0, "exp_avg": torch.full((4,), m)}
    opt.step()  # c = 0.9 * m + 0.1 * g is a signed zero: never a zero step
    assert torch.equal(p.detach(), torch.full((4,), 0.5 * moved))


# -- state, dtypes, sparse, refusals -------------------------------------------------------


@pytest.mark.parametrize(("make", "keys"), [
    (lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, weight_decay=0.01), {"step", "exp_avg_sq"}),
    (lambda ps: DeepSpeedCPULion(ps, weight_decay=0.01), {"step", "exp_avg"}),
    (lambda ps: FusedLion(ps, weight_decay=0.01), {"step", "exp_avg"}),
])
def test_state_is_deepspeeds_and_a_state_dict_round_trip_continues_identically(make, keys):
    a, b = params(), params()
    first = make(a)
    run(first, a, grads_per_step(a, 3))
    state = first.state[a[0]]
    assert set(state) == keys and type(state["step"]) is int and state["step"] == 3
    for x, y in zip(a, b, strict=True):
        y.data.copy_(x.data)
    second = make(b)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    later = grads_per_step(a, 2, seed=5)
    run(first, a, later)
    run(second, b, later)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert second.state[b[0]]["step"] == 5


@pytest.mark.parametrize(("make", "key", "state_dtype"), [
    (lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1), "exp_avg_sq", torch.float32),
    (lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, fp32_optimizer_states=False), "exp_avg_sq",
     torch.bfloat16),
    (lambda ps: DeepSpeedCPULion(ps, lr=0.1), "exp_avg", torch.float32),
    (lambda ps: DeepSpeedCPULion(ps, lr=0.1, fp32_optimizer_states=False), "exp_avg",
     torch.bfloat16),
    (lambda ps: FusedLion(ps, lr=0.1), "exp_avg", torch.bfloat16),  # the param's dtype
])
def test_bf16_params_are_updated_in_fp32_and_rounded_once(make, key, state_dtype):
    low = params(dtype=torch.bfloat16)
    high = [torch.nn.Parameter(p.detach().float()) for p in low]
    history = grads_per_step(low, steps=1)
    opt = make(low)
    run(opt, low, history)
    run(make(high), high, [[g.float() for g in grads] for grads in history])
    for p, q in zip(low, high, strict=True):
        assert torch.equal(p.detach(), q.detach().bfloat16())
        assert opt.state[p][key].dtype == state_dtype


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sparse_adagrad_updates_the_rows_of_the_gradient_only(weight_decay):
    sparse, dense = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Embedding(10, 3)
    dense.weight.data.copy_(sparse.weight.data)
    before = sparse.weight.detach().clone()
    opts = [DeepSpeedCPUAdagrad(m.parameters(), lr=0.1, weight_decay=weight_decay)
            for m in (sparse, dense)]
    ids = torch.tensor([[1, 4, 4], [7, 1, 2]])  # repeated ids: the gradient is coalesced
    for _ in range(3):
        for model, opt in zip((sparse, dense), opts, strict=True):
            opt.zero_grad()
            model(ids).pow(2).sum().backward()
            opt.step()
    rows = torch.tensor([1, 2, 4, 7])
    rest = torch.tensor([0, 3, 5, 6, 8, 9])
    torch.testing.assert_close(sparse.weight[rows], dense.weight[rows], **TOL)
    sums = [opt.state[m.weight]["exp_avg_sq"] for opt, m in zip(opts, (sparse, dense),
                                                                  strict=True)]
    torch.testing.assert_close(sums[0][rows], sums[1][rows], **TOL)
    assert torch.equal(sparse.weight[rest], before[rest]) and not sums[0][rest].any()


def test_amsgrad_is_refused():
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdagrad does not support the AMSGrad"):
        DeepSpeedCPUAdagrad(params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdagrad([{"params": params(), "amsgrad": True}])
    assert DeepSpeedCPUAdagrad(params()).param_groups[0]["amsgrad"] is False  # as DeepSpeed's


@pytest.mark.parametrize(("make", "match"), [
    (lambda ps: DeepSpeedCPUAdagrad(ps, lr=-1.0), "lr must be >= 0"),
    (lambda ps: DeepSpeedCPUAdagrad(ps, weight_decay=-0.1), "weight_decay must be >= 0"),
    (lambda ps: DeepSpeedCPULion(ps, betas=(0.9, 1.0)), r"betas must be two values in \[0, 1\)"),
    (lambda ps: FusedLion(ps, weight_decay=-1.0), "lr and weight_decay must be >= 0"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(params())


@pytest.mark.parametrize("cls", LIONS)
def test_lion_refuses_sparse_gradients(cls):
    emb = torch.nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(NotImplementedError, match=f"{cls.__name__} does not support sparse"):
        cls(emb.parameters()).step()


def test_fused_lion_zero_grad_follows_set_grad_none():
    ps = params()
    for set_grad_none, expect_none in ((True, True), (False, False)):
        opt = FusedLion(ps, set_grad_none=set_grad_none)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.zero_grad()
        assert all((p.grad is None) == expect_none for p in ps)


# -- the config's optimizer.type -----------------------------------------------------------


@pytest.mark.parametrize(("type_name", "cpu_offload", "cls"), [
    ("Adagrad", False, torch.optim.Adagrad),
    ("Adagrad", True, DeepSpeedCPUAdagrad),
    ("Lion", False, FusedLion),
    ("Lion", True, DeepSpeedCPULion),
])
def test_config_types_pick_by_offload_as_deepspeed(type_name, cpu_offload, cls):
    opt = build_optimizer(type_name, {"lr": 0.05, "weight_decay": 0.01}, params(),
                          cpu_offload=cpu_offload)
    assert type(opt) is cls
    assert opt.defaults["lr"] == 0.05 and opt.defaults["weight_decay"] == 0.01
    if type_name == "Adagrad":
        assert opt.defaults["eps"] == 1e-10  # DeepSpeed's and torch's default


@pytest.mark.parametrize(("type_name", "cpu_offload", "settings", "key"), [
    ("Adagrad", False, {"amsgrad": True}, "amsgrad"),
    ("Adagrad", True, {"amsgrad": True}, "amsgrad"),
    ("Adagrad", True, {"lr_decay": 0.1}, "lr_decay"),
    ("Adagrad", False, {"fp32_optimizer_states": False}, "fp32_optimizer_states"),
    ("Lion", True, {"set_grad_none": False}, "set_grad_none"),
    ("Lion", False, {"fp32_optimizer_states": False}, "fp32_optimizer_states"),
    ("Lion", False, {"eps": 1e-8}, "eps"),
])
def test_config_keys_the_picked_optimizer_lacks_are_usage_errors(type_name, cpu_offload,
                                                                  settings, key):
    with pytest.raises(UsageError) as err:
        build_optimizer(type_name, settings, params(), cpu_offload=cpu_offload)
    assert err.value.where == f"optimizer.params.{key}" and err.value.hint


# -- on a GPU, and against DeepSpeed itself ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", [DeepSpeedCPUAdagrad, *LIONS])
def test_gpu_tensors_step_as_cpu_tensors(cls):
    cpu = params()
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    history = grads_per_step(cpu, steps=4)
    run(cls(two_groups(cpu, lr=0.2), weight_decay=0.1), cpu, history)
    run(cls(two_groups(gpu, lr=0.2), weight_decay=0.1), gpu,
        [[g.cuda() for g in grads] for grads in history])
    for p, q in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(p, q.cpu(), **TOL)


def run_case(classes, case):
    """One case, for our classes here and DeepSpeed's in its venv (this function's source is
    run there): params, groups and grads per step in, params and state out."""
    params = [torch.nn.Parameter(t.clone()) for t in case["params"]]
    groups = [{**g, "params": [params[i] for i in g["params"]]} for g in case["groups"]]
    opt = classes[case["kind"]](groups, **case["kwargs"])
    for grads in case["grads"]:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [(p.detach().clone(), dict(opt.state[p])) for p in params]


def deepspeed_cases():
    """Sizes around DeepSpeed's AVX spans (8, 4 and 1 times 16 lanes) so that its vector and
    scalar loops both run; a bf16 param (fp32 state); a param whose grads are all zero
    (Lion steps it by -lr each time: the sign of +0); two groups; decay on and off."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(300,), (7, 5), (1,), (64,)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    values[3] = values[3].bfloat16()
    values.append(torch.zeros(16))  # in the first group: lr 1e-2, the case's decay
    grads = [[torch.randn(v.shape, generator=gen).to(v.dtype) for v in values[:4]]
             + [torch.zeros(16)] for _ in range(4)]
    cases = {}
    for kind, kwargs in (("adagrad", dict(lr=5e-2, eps=1e-8)),
                         ("lion", dict(lr=1e-2, betas=(0.8, 0.99)))):
        for wd in (0.0, 0.1):
            second = {"params": [2, 3], "lr": 2e-2, "weight_decay": 0.3}
            cases[f"{kind}-wd{wd}"] = dict(kind=kind, params=values, grads=grads,
                                           groups=[{"params": [0, 1, 4]}, second],
                                           kwargs={**kwargs, "weight_decay": wd})
    return cases


DS_MAIN = """
import sys
import torch
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.lion import DeepSpeedCPULion

cases = torch.load(sys.argv[1])
classes = {"adagrad": DeepSpeedCPUAdagrad, "lion": DeepSpeedCPULion}
torch.save({name: run_case(classes, case) for name, case in cases.items()}, sys.argv[2])
"""


@pytest.mark.timeout(900)
@pytest.mark.skipif(not DS_PYTHON.exists(), reason=f"DeepSpeed's venv ({DS_PYTHON}) is absent")
def test_equals_deepspeeds_own_cpu_adagrad_and_lion(tmp_path):
    """DeepSpeed 0.19.8's DeepSpeedCPUAdagrad and DeepSpeedCPULion (its C++ ops, built on
    first use: minutes, then cached under ~/.cache/torch_extensions) on the same params and
    grads, run in its venv with DS_ACCELERATOR=cpu."""
    cases = deepspeed_cases()
    torch.save(cases, tmp_path / "cases.pt")
    script = tmp_path / "run_deepspeed.py"
    script.write_text("import torch\n\n" + textwrap.dedent(inspect.getsource(run_case))
                      + DS_MAIN)
    done = subprocess.run([str(DS_PYTHON), str(script), str(tmp_path / "cases.pt"),
                           str(tmp_path / "out.pt")], env={**os.environ, "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=850, check=False)
    if "failed to build/load" in done.stderr:
        pytest.skip(f"DeepSpeed's CPU ops do not build here: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    classes = {"adagrad": DeepSpeedCPUAdagrad, "lion": DeepSpeedCPULion}
    for name, case in cases.items():
        key = "exp_avg_sq" if case["kind"] == "adagrad" else "exp_avg"
        ours = run_case(classes, case)
        for i, ((p, state), (q, ds_state)) in enumerate(zip(ours, theirs[name], strict=True)):
            where = f"{name}, param {i}"
            tol = TOL if p.dtype == torch.float32 else {}  # bf16: torch's bf16 tolerance
            torch.testing.assert_close(p, q, **tol, msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(state[key], ds_state[key], **MOMENT_TOL,
                                       msg=lambda m, w=where, k=key: f"{w} {k}: {m}")
            assert state["step"] == ds_state["step"] == 4
    moved = theirs["lion-wd0.0"][4][0]  # all-zero grads: four steps of -lr (the sign of +0)
    torch.testing.assert_close(moved, torch.full((16,), -4 * 1e-2), **TOL)
