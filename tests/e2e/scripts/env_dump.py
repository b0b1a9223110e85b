"""Prints this worker's view of the launch contract as one JSON line."""

import json
import os
import socket
import sys

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DEEPSHARD_RUN_ID",
        "DEEPSHARD_RESTART_COUNT")
extra = [k for k in os.environ if k.startswith("DSTEST_")]
print("ENV " + json.dumps({
    "env": {k: os.environ.get(k) for k in KEYS},
    "extra": {k: os.fsencode(os.environ[k]).hex() for k in extra},
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "hostname": socket.gethostname(),
    "affinity": sorted(os.sched_getaffinity(0)),
}), flush=True)
