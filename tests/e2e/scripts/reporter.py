"""Reports steps 1-8 with a loss that names its rank (``deepshard.report``), then waits
for the agent to read the last one: the live-view test's worker (torch-free)."""

import os
import time

import deepshard

rank = int(os.environ["RANK"])
for step in range(1, 9):
    deepshard.report(step=step, loss=0.5 + rank + step / 1000)
    time.sleep(0.25)
deepshard.heartbeat(8)  # a beat without a loss keeps the last one shown
time.sleep(2.5)
