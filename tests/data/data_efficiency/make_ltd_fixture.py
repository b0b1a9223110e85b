"""Record DeepSpeed 0.19.8's random-LTD schedule for the unit test test_ltd_schedule.py.

Run under a virtual environment with DeepSpeed installed (no GPU needed)::

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/data_efficiency/make_ltd_fixture.py

It writes ltd_schedule_ds0198.json next to itself: for each config, the kept-token value and
the consumed layer tokens after every ``update_seq`` call (two calls per step, as gradient
accumulation makes), ``state_dict()`` every 50 steps, a run resumed from the step-100 state
dict, and ``get_total_layer_tokens``.
"""

from __future__ import annotations

import json
import pathlib

import deepspeed
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

STEPS, CALLS_PER_STEP, RESUME_AT = 200, 2, 100

CONFIGS = {
    # reaches max_value at step 150 and stops there
    "reaches_max": dict(total_layer_num=12, random_ltd_layer_num=10, global_batch_size=8,
                        min_value=16, max_value=128, require_steps=150, seq_per_step=8),
    # min and max not multiples of seq_per_step: the value first drops to 4, then stays one
    # below max until the floor passes it
    "unaligned": dict(total_layer_num=4, random_ltd_layer_num=2, global_batch_size=3,
                      min_value=5, max_value=61, require_steps=37, seq_per_step=4),
    # DeepSpeed's tutorial shape, with require_steps longer than the run
    "tutorial": dict(total_layer_num=24, random_ltd_layer_num=22, global_batch_size=256,
                     min_value=128, max_value=2048, require_steps=300, seq_per_step=16),
}


def scheduler(c: dict) -> RandomLTDScheduler:
    return RandomLTDScheduler({
        "total_layer_num": c["total_layer_num"],
        "random_ltd_layer_num": c["random_ltd_layer_num"],
        "global_batch_size": c["global_batch_size"],
        "random_ltd_schedule": {"min_value": c["min_value"], "max_value": c["max_value"],
                                "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": c["require_steps"],
                                                    "seq_per_step": c["seq_per_step"]}},
        "layer_token_lr_schedule": {"enabled": False},
    })


def run(s: RandomLTDScheduler, steps: range) -> dict:
    values, consumed, state_dicts = [], [], {}
    for step in steps:
        for _ in range(CALLS_PER_STEP):
            s.update_seq(step)
            values.append(s.get_current_seq())
            consumed.append(s.state["consumed_layer_tokens"])
        if step % 50 == 0 or step == RESUME_AT - 1:
            state_dicts[str(step)] = dict(s.state_dict())
    return {"values": values, "consumed": consumed, "state_dicts": state_dicts}


def record(c: dict) -> dict:
    out = {"config": c, "initial_state_dict": dict(scheduler(c).state_dict())}
    out.update(run(scheduler(c), range(STEPS)))
    resumed = scheduler(c)
    resumed.load_state_dict(out["state_dicts"][str(RESUME_AT - 1)])
    out["resumed"] = run(resumed, range(RESUME_AT, STEPS))
    out["total_layer_tokens"] = scheduler(c).get_total_layer_tokens(STEPS)
    return out


def main() -> None:
    fixture = {"deepspeed_version": deepspeed.__version__, "steps": STEPS,
               "calls_per_step": CALLS_PER_STEP, "resume_at": RESUME_AT,
               "configs": {name: record(c) for name, c in CONFIGS.items()}}
    path = pathlib.Path(__file__).with_name("ltd_schedule_ds0198.json")
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
