"""A synchronous loop: each rank works 30 ms, marks its arrival
(:func:`deepshard.liveness.arrive`), all-reduces and beats. Rank ``STRAGGLER_RANK``
(default 1) has a helper process ``SIGSTOP`` it for 150 ms of its work in every step, as a
preempted or throttled host would be: every rank's step then takes ~0.2 s, and only the
time before arriving tells the stopped rank apart. The straggler test's worker."""

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import deepshard
from deepshard.liveness import arrive

STEPS = int(os.environ.get("STRAGGLER_STEPS", "30"))
# stops the process named by argv[1] for 150 ms whenever a byte arrives on stdin
STOPPER = """
import os, signal, sys, time
pid = int(sys.argv[1])
while sys.stdin.buffer.read(1):
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.15)
    os.kill(pid, signal.SIGCONT)
"""

dist.init_process_group("gloo")
rank = dist.get_rank()
stopper = None
if rank == int(os.environ.get("STRAGGLER_RANK", "1")):
    stopper = subprocess.Popen([sys.executable, "-c", STOPPER, str(os.getpid())],
                               stdin=subprocess.PIPE)
grad = torch.ones(1024)
for step in range(1, STEPS + 1):
    if stopper is not None:
        stopper.stdin.write(b"x")
        stopper.stdin.flush()
    time.sleep(0.03)  # this rank's own work of the step
    arrive()
    dist.all_reduce(grad)
    deepshard.heartbeat(step)
if stopper is not None:
    stopper.stdin.close()
    stopper.wait()
dist.barrier()
time.sleep(1.5)  # the agent reads the last steps' times once a second
dist.destroy_process_group()
print("done", flush=True)
