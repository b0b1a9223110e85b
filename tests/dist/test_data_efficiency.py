"""The ``data_efficiency`` section through the engine on 2 gloo ranks started by ds-run.

``tests/dist/scripts/data_efficiency_train.py`` trains a tiny GPT and reports each step's
loss, the sequence length and sample ids of every micro-batch and the learning rate:

- curriculum learning (``seqlen_truncate``) and random-LTD at ZeRO 1 and 2 against plain
  torch in this process, trained on the global batches the ranks reported, cut to their
  lengths, with the tokens each rank kept (the draws are keyed by seed, rank, micro-step
  and layer, so the reference draws the same);
- curriculum + random-LTD at ZeRO-3 saved mid-run and resumed: the resumed steps equal
  the uninterrupted ones bit for bit (the sampler's position, the schedule and the
  kept-token draws all continue);
- dynamic batching: every micro-batch within the token budget and the learning rate of
  each step the plan's (DeepSpeed's linear scaling).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from deepshard.data_efficiency.dynamic_batching import plan_batches, scale_lr
from deepshard.data_efficiency.ltd_schedule import RandomLtdSchedule, RandomLtdSpec
from deepshard.data_efficiency.random_ltd import bind_random_ltd, convert_layers_by_id
from deepshard.runtime.checkpoint import format as fmt
from tests.helpers import ROOT, run_ds, tagged_json

sys.path.insert(0, str(ROOT / "tests" / "dist" / "scripts"))
from data_efficiency_train import TINY, Windows

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "data_efficiency_train.py")
LR = 3e-3
CURRICULUM = {"enabled": True, "curriculum_learning": {"enabled": True, "curriculum_metrics": {
    "seqlen_truncate": {"min_difficulty": 8, "max_difficulty": 32,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 4,
                                            "difficulty_step": 8}}}}}
RANDOM_LTD = {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2,
    "random_ltd_layer_id": [1, 2],
    "random_ltd_schedule": {"min_value": 8, "max_value": 32,
                            "schedule_config": {"require_steps": 6, "seq_per_step": 8}}}}


def config(stage: int, micro: int = 2, gas: int = 2, **efficiency) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "data_efficiency": {"enabled": True, "seed": 7, **efficiency}}


def train(tmp_path, cfg: dict, steps: int, *extra: str, name: str = "cfg") -> dict[int, dict]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    done = run_ds("--num_gpus", "2", SCRIPT, str(path), str(steps), *extra, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = {rank: data for rank, (_, data) in tagged_json(done.stdout, "DE").items()}
    assert sorted(reports) == [0, 1]
    return reports


@pytest.mark.parametrize("stage", [1, 2])
def test_curriculum_and_random_ltd_on_two_ranks_equal_plain_torch(tmp_path, stage):
    cfg = config(stage, data_sampling=CURRICULUM, data_routing=RANDOM_LTD)
    reports = train(tmp_path, cfg, steps=5)
    seqs = reports[0]["seqs"]
    assert seqs == reports[1]["seqs"]  # every rank cuts its micro-batch alike
    assert seqs == [8, 8, 16, 16, 24, 24, 32, 32, 32, 32]  # fixed_linear over 4 steps
    data = Windows()
    torch.manual_seed(0)
    model = GPT(TINY)
    spec = RandomLtdSpec.from_dict(RANDOM_LTD["random_ltd"], global_batch_size=8)
    schedule = RandomLtdSchedule(spec, seed=7)
    convert_layers_by_id(model, spec.random_ltd_layer_id)
    bind_random_ltd(model, schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=1e-8)
    for step, want in enumerate(reports[0]["losses"]):
        opt.zero_grad()
        micro = [(m, r) for m in (2 * step, 2 * step + 1) for r in (0, 1)]
        last = []
        for m, rank in micro:
            ids, seq = reports[rank]["ids"][m], seqs[m]
            schedule.update_seq(step)
            schedule.rank, schedule.position = rank, m  # the draw rank `rank` made
            x = torch.stack([data[i][0][:seq] for i in ids])
            y = torch.stack([data[i][1][:seq] for i in ids])
            loss = model(x, y)
            (loss / len(micro)).backward()
            last.append(float(loss))
        opt.step()
        # the script reports the mean over ranks of each rank's last micro-batch loss
        assert float(torch.tensor(last[2:]).mean()) == pytest.approx(want, abs=2e-5)
    ids = [i for r in (0, 1) for batch in reports[r]["ids"] for i in batch]
    assert len(ids) == len(set(ids))  # no sample twice in the first epoch's batches


def test_curriculum_and_random_ltd_resume_exactly_at_zero3(tmp_path):
    cfg = config(3, data_sampling=CURRICULUM, data_routing=RANDOM_LTD)
    whole = train(tmp_path, cfg, 6, "--save", f"{tmp_path / 'ck'}:3")
    resumed = train(tmp_path, cfg, 3, "--load", str(tmp_path / "ck"))
    for rank in (0, 1):
        assert resumed[rank]["ids"] == whole[rank]["ids"][6:]
        assert resumed[rank]["seqs"] == whole[rank]["seqs"][6:]
        assert resumed[rank]["losses"] == whole[rank]["losses"][3:]  # bit for bit
    manifest = fmt.resolve_tag(tmp_path / "ck", None)
    saved = fmt.load_file(tmp_path / "ck" / manifest.tag, fmt.SHARED_FILE)["features"]
    states = saved["data_efficiency"]
    assert states["data_sampler"]["consumed_samples"] == 3 * 8  # 3 global batches of 8
    assert states["random_ltd"]["current_value"] == 16  # fixed_linear 8 -> 32 at step 2


def test_dynamic_batching_budget_and_learning_rates(tmp_path):
    budget = 64
    cfg = config(0, micro=1, gas=2, data_sampling={"enabled": True, "dynamic_batching": {
        "enabled": True, "max_tokens": budget, "lr_scaling_method": "linear",
        "sequence_picking_order": "seqlen"}})
    reports = train(tmp_path, cfg, 3, "--dynamic", "1", name="dynamic")
    seqlens = [Windows.length(i) for i in range(len(Windows()))]
    for rank in (0, 1):
        for ids in reports[rank]["ids"]:
            assert sum(seqlens[i] for i in ids) <= budget
    plan = plan_batches(seqlens, budget, sequence_picking_order="seqlen",
                        effective_batch_size=4)
    want = [scale_lr(4, size, LR, "linear") for size in plan.batch_sizes[:3]]
    got = reports[0]["lrs"][::2]  # the LR of each step's first micro-batch
    assert got == pytest.approx(want)
    assert reports[1]["lrs"] == reports[0]["lrs"]
    assert reports[0]["losses"] == reports[1]["losses"]
