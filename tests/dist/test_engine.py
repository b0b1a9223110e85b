"""The engine on real gloo groups started by ds-run, against single-process plain torch.

The example script trains a tiny GPT; the reference trains the same model in this process
on each step's whole global batch with torch.optim.AdamW. Data order depends only on the
seed and the global sample index, so both see the same batches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import deepshard
from deepshard.errors import UsageError
from deepshard.runtime import checkpoint as ckpt
from tests.helpers import ROOT, run_ds, tagged_json

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, GPTConfig, sample_batch, stdlib_corpus

TRAIN = str(ROOT / "examples" / "train_gpt.py")
PROBE = str(ROOT / "tests" / "dist" / "scripts" / "engine_probe.py")
TINY = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
TINY_ARGS = ("--n_layer", "2", "--d_model", "64", "--n_head", "4", "--vocab_size", "256",
             "--seq_len", "32")
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}


# AdamW divides each update by sqrt(v): where a weight's gradient is near zero, the
# rounding of the reduction order (per-rank and per-micro-batch means summed, against one
# whole-batch mean) grows toward lr per step. Measured on an AVX-512 Xeon: up to 2.5e-5
# after 5 steps with the batch in 4 parts, the same at the commit before the strategy
# refactor (these checks then failed at atol 1e-5 / 2e-5); 2 parts stay under 1e-5.
ADAM_ATOL = ADAMW["params"]["lr"] / 50


def assert_weights_close(got: dict, want: dict, rtol: float) -> None:
    """Every entry of ``want`` in ``got`` within ``rtol`` and :data:`ADAM_ATOL`."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        diff = float((got[name] - value).abs().max())
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=ADAM_ATOL,
                                   msg=f"{name}: max abs difference {diff:.3g}")


def write_config(tmp_path, **config) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def losses_of(stdout: str) -> dict[int, str]:
    """``step -> loss text`` from rank 0's ``step <n> loss <value>`` lines."""
    return {int(m[1]): m[2] for m in re.finditer(r"\] step (\d+) loss (\S+)", stdout)}


def reference(steps: int, global_batch: int, seed: int = 0, clip: float = 1.0,
              model_cfg: GPTConfig = TINY):
    """Plain torch, one process, the whole global batch per step."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    params = ADAMW["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"],
                            eps=1e-8, weight_decay=params["weight_decay"])
    corpus = stdlib_corpus()
    losses = []
    for step in range(steps):
        idx = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.uint64)
        x, y = sample_batch(corpus, idx, seed, model_cfg.seq_len)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize(("world", "micro", "gas", "wire"),
                         [(2, 4, 1, None), (4, 2, 2, None), (2, 4, 1, "bf16")])
def test_data_parallel_matches_single_process(tmp_path, world, micro, gas, wire):
    """``wire``: communication_data_type; bf16 on the wire rounds every reduced gradient to
    8 bits of mantissa, so that case only has to follow the curve closely."""
    steps = 5
    extra = {"communication_data_type": wire} if wire else {}
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=micro,
                       gradient_accumulation_steps=gas, gradient_clipping=1.0, optimizer=ADAMW,
                       steps_per_print=1000, **extra)
    result = run_ds("--num_gpus", str(world), TRAIN, "--deepspeed_config", cfg,
                    "--steps", str(steps), *TINY_ARGS, "--checkpoint_dir",
                    str(tmp_path / "ckpt"), "--save_interval", str(steps), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses_of(result.stdout)
    want, want_state = reference(steps, micro * gas * world)
    assert sorted(got) == list(range(1, steps + 1))
    curve = [float(got[s + 1]) for s in range(steps)]
    assert want[-1] < want[0]
    state = deepshard.get_fp32_state_dict(tmp_path / "ckpt")
    assert state.keys() == want_state.keys()
    if wire:
        np.testing.assert_allclose(curve[:1], want[:1], rtol=2e-5)  # before any update
        np.testing.assert_allclose(curve, want, rtol=2e-3)
        drift = max(abs(float((state[k] - v).abs().max())) for k, v in want_state.items())
        assert 1e-5 < drift < 1e-2, f"bf16 wire: weights drift {drift} from fp32"
        return
    np.testing.assert_allclose(curve, want, rtol=2e-5)
    assert_weights_close(state, want_state, rtol=1e-4)


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    """Save at step 3, stop; a new job resumes and ends exactly where one run of 6 ends.
    Dropout makes the RNG state part of what must be restored."""
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=2,
                       gradient_accumulation_steps=2, gradient_clipping=1.0, optimizer=ADAMW,
                       scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4,
                                                                 "warmup_max_lr": 3e-3}})
    common = ("--num_gpus", "2", TRAIN, "--deepspeed_config", cfg, *TINY_ARGS,
              "--dropout", "0.1", "--save_interval", "3")
    whole = run_ds(*common, "--steps", "6", "--checkpoint_dir", str(tmp_path / "a"),
                   timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_ds(*common, "--steps", "3", "--checkpoint_dir", str(tmp_path / "b"),
                   timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_ds(*common, "--steps", "6", "--checkpoint_dir", str(tmp_path / "b"),
                    timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    uninterrupted, resumed = losses_of(whole.stdout), losses_of(second.stdout)
    assert sorted(resumed) == [4, 5, 6]
    assert {s: uninterrupted[s] for s in (4, 5, 6)} == resumed
    a = deepshard.get_fp32_state_dict(tmp_path / "a")
    b = deepshard.get_fp32_state_dict(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the whole run"
    shared_a = ckpt.load_file(tmp_path / "a" / "global_step6", ckpt.SHARED_FILE)
    shared_b = ckpt.load_file(tmp_path / "b" / "global_step6", ckpt.SHARED_FILE)
    opt_a, opt_b = shared_a["optimizer"]["state"], shared_b["optimizer"]["state"]
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)
    assert shared_a["lr_scheduler"] == shared_b["lr_scheduler"]
    assert shared_b["counters"]["global_steps"] == 6


def test_restarted_job_resumes_by_itself(tmp_path):
    """Rank 1 dies after step 4; ds-run restarts the job; the engine loads the step-3
    checkpoint named by checkpoint.resume_dir; the curve equals an uninterrupted run."""
    ckdir = tmp_path / "ckpt"
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=2, optimizer=ADAMW,
                       checkpoint={"resume_dir": str(ckdir)})
    args = ("--deepspeed_config", cfg, *TINY_ARGS, "--steps", "6")
    whole = run_ds("--num_gpus", "2", TRAIN, *args, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    crashed = run_ds("--num_gpus", "2", "--max_restarts", "1", PROBE, "crash-at", "4", *args,
                     "--checkpoint_dir", str(ckdir), "--save_interval", "3", timeout=300)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout + crashed.stderr
    assert "global_step3" in crashed.stdout + crashed.stderr
    want = losses_of(whole.stdout)
    lines = re.findall(r"\] step (\d+) loss (\S+)", crashed.stdout)
    after_restart = dict((int(s), v) for s, v in lines[-3:])
    assert after_restart == {s: want[s] for s in (4, 5, 6)}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_ranks_agree_and_learn(tmp_path, precision):
    section = ({"enabled": True, "initial_scale_power": 20, "loss_scale_window": 4,
                "hysteresis": 1} if precision == "fp16" else {"enabled": True})
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=4, gradient_clipping=1.0,
                       optimizer=ADAMW, **{precision: section})
    result = run_ds("--num_gpus", "2", PROBE, "precision", cfg, "16", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = {r: d for r, (_, d) in tagged_json(result.stdout, "RESULT").items()}
    assert sorted(ranks) == [0, 1]
    r0, r1 = ranks[0], ranks[1]
    assert r0["dtype"] == f"torch.{'float16' if precision == 'fp16' else 'bfloat16'}"
    assert r0["checksum"] == r1["checksum"], "ranks diverged"
    assert r0["losses"][-1] < r0["losses"][0]
    n, k = r0["numel"], r0["nparams"]
    half = 2 * n
    # module params and grads in half precision; AdamW state (2 fp32 moments + a step
    # scalar per tensor) plus fp32 master params and master grads
    assert r0["state_bytes"] == {"params": half, "grads": half,
                                 "optimizer": 8 * n + 4 * k + 8 * n, "nvme": 0}
    if precision == "fp16":
        # 2**20 overflows at once; with hysteresis 1 each overflow halves the scale and the
        # step is skipped on both ranks alike
        assert r0["skipped"] >= 1 and r0["skipped"] == r1["skipped"]
        assert r0["scales"][0] < 2.0**20
        assert r0["global_steps"] == 16
        assert r0["skipped"] < 10


def test_state_bytes_fp32(tmp_path):
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=2, optimizer=ADAMW)
    result = run_ds("--num_gpus", "2", PROBE, "precision", cfg, "1", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    r0 = tagged_json(result.stdout, "RESULT")[0][1]
    n, k = r0["numel"], r0["nparams"]
    assert r0["state_bytes"] == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * k,
                                 "nvme": 0}


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, PROBE, "slow-save", str(directory)], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("STALLED") or time.monotonic() > deadline:
                break
        assert (directory / ".bad.partial").is_dir()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (directory / ckpt.LATEST).read_text() == "good"
    assert not (directory / "bad").exists()
    manifest = ckpt.resolve_tag(directory, None)
    assert manifest is not None and manifest.tag == "good" and manifest.global_steps == 1
    state = deepshard.get_fp32_state_dict(directory)
    assert state["head.weight"].dtype == torch.float32
    shared = ckpt.load_file(directory / "good", ckpt.SHARED_FILE)
    assert shared["client_state"] == {"note": "good"}
    with pytest.raises(UsageError, match="no complete checkpoint with tag 'bad'"):
        ckpt.resolve_tag(directory, "bad")


def test_example_configs_activation_checkpointing_and_profiler(tmp_path):
    """The shipped accumulation config (triad from train_batch_size, OneCycle, flops profiler
    at step 2) trains; recomputing blocks in backward gives the very same curve."""
    cfg = str(ROOT / "examples" / "configs" / "accumulation.json")
    common = ("--num_gpus", "2", TRAIN, "--deepspeed_config", cfg, *TINY_ARGS, "--steps", "4")
    plain = run_ds(*common, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    recomputed = run_ds(*common, "--activation_checkpointing", timeout=300)
    assert recomputed.returncode == 0, recomputed.stderr[-3000:]
    assert losses_of(plain.stdout) == losses_of(recomputed.stdout)
    assert len(losses_of(plain.stdout)) == 4
    assert plain.stdout.count("deepshard flops profiler") == 1
    assert re.search(r"\[localhost:0\] fwd FLOPs: +\d", plain.stdout)
    assert "blocks.1 (Block)" in plain.stdout


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_engine_frees_its_model_and_state(tmp_path, stage):
    """Gradient hooks on the parameters must not keep the engine alive: dropping it frees
    the model and the ZeRO/bucket state, and a second engine then trains the same way as
    the first."""
    cfg = write_config(tmp_path, train_micro_batch_size_per_gpu=2, optimizer=ADAMW,
                       zero_optimization={"stage": stage})
    result = run_ds("--num_gpus", "2", PROBE, "release", cfg, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = tagged_json(result.stdout, "RESULT")
    assert sorted(found) == [0, 1]
    for _, data in found.values():
        first, second = data["rounds"]
        for r in (first, second):
            assert r["engine_freed"] and r["model_freed"], r
            assert r["left"] == {}, r
        assert first["loss"] == second["loss"]
