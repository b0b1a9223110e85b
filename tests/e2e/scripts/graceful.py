"""On SIGTERM: counts it, takes a second to 'save', writes <dir>/saved_<rank>, exits 0.

Run directly, or under `sh -c` to be a grandchild of the agent (the grace must cover it).
"""

import os
import signal
import sys
import time
from pathlib import Path

out = Path(sys.argv[-1])
rank = os.environ.get("RANK", "0")
terms = []


def on_term(signum, frame):
    terms.append(signum)
    print(f"SIGTERM #{len(terms)}", flush=True)
    if len(terms) == 1:
        time.sleep(1.0)
        (out / f"saved_{rank}").write_text(str(len(terms)))
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
(out / f"ready_{rank}").write_text(str(os.getpid()))
print("ready", flush=True)
while True:
    time.sleep(0.1)
