"""Heartbeats once, then blocks forever in blocked_here() (a hang under a wrapper)."""

import time

import deepshard


def blocked_here() -> None:
    while True:
        time.sleep(1)


deepshard.heartbeat(1)
print("beat once", flush=True)
blocked_here()
