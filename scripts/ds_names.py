#!/usr/bin/env python3
"""Every ``deepspeed.X`` name a Python file or an installed package uses, and whether
deepshard resolves it under ``--deepspeed_compat``:

    python scripts/ds_names.py transformers accelerate peft trl lightning my_train.py
    python scripts/ds_names.py --missing-only transformers

(The work is :mod:`deepshard.compat.audit`.)"""

import sys

from deepshard.compat.audit import main

if __name__ == "__main__":
    sys.exit(main())
