"""A DeepSpeed user's script, unedited: ``import deepspeed`` and DeepSpeed's names.

Run by ds-run --deepspeed_compat, it runs on deepshard. ``join`` (the default) joins the
job with ``deepspeed.init_distributed()`` and prints where it sits; ``missing`` imports a
DeepSpeed module deepshard lacks.
"""

import argparse
import importlib.metadata
import json
import sys

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("mode", nargs="?", default="join", choices=["join", "missing"])
args = parser.parse_args()

if args.mode == "missing":
    import deepspeed.inference.v2  # one line and exit code 2

    sys.exit("not reached")

import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.lr_schedules import WarmupLR  # noqa: E402

deepspeed.init_distributed()
try:
    installed = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:
    installed = None
print("COMPAT " + json.dumps({
    "rank": dist.get_rank(), "world": dist.get_world_size(), "local_rank": args.local_rank,
    "module": deepspeed.__name__, "warmup": WarmupLR.__module__,
    "deepspeed_distribution": installed,
}), flush=True)
dist.destroy_process_group()
