"""Sleeps forever after recording its pid and a child's pid (the no-orphan tests).

Arguments: <pid_dir> [--ignore-term] [--die-rank R --die-how kill|exit3] [--exit-leaving-child]
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("pid_dir")
parser.add_argument("--local_rank", type=int)
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--die-how", default="kill")
parser.add_argument("--exit-leaving-child", action="store_true")
parser.add_argument("token", nargs="?")
args = parser.parse_intermixed_args()
rank = int(os.environ["RANK"])

if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# a grandchild in its own session: only the agent's subreaper sweep can find it
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                          args.token or "x"], start_new_session=True)
pid_dir = Path(args.pid_dir)
(pid_dir / f"{rank}.pids.tmp").write_text(f"{os.getpid()} {child.pid}")
os.replace(pid_dir / f"{rank}.pids.tmp", pid_dir / f"{rank}.pids")
print(f"rank {rank} ready", flush=True)

if args.exit_leaving_child:
    sys.exit(0)
if rank == args.die_rank:
    print(f"rank {rank} about to fail", flush=True)
    while len(list(pid_dir.glob("*.pids"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.02)
    print("last words", flush=True)
    if args.die_how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
while True:
    time.sleep(1)
