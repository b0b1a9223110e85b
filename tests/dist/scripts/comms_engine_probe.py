"""Trains a 64x64 linear layer 3 steps at the ZeRO stage given on the command line with
the comms_logger section on, then prints log_summary's table (rank 0) and one RESULT line
per rank with the logger's counts: what the engine's own collectives look like there."""

import json
import sys

import torch

import deepshard
import deepshard.comm as comm

stage = int(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
torch.manual_seed(0)
net = torch.nn.Linear(64, 64)
engine, *_ = deepshard.initialize(model=net, model_parameters=net.parameters(), config={
    "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": stage},
    "comms_logger": {"enabled": True, "prof_all": True}})
for _ in range(3):
    engine.backward(engine(torch.randn(2, 64)).pow(2).mean())
    engine.step()
summary = comm.log_summary(return_dict=True)
print("RESULT " + json.dumps({"rank": comm.get_rank(), "summary": {
    op: {str(size): figures["count"] for size, figures in sizes.items()}
    for op, sizes in summary["summary"].items()}}), flush=True)
