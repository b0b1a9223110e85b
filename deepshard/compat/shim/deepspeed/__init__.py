"""``import deepspeed`` under ``ds-run --deepspeed_compat``: becomes deepshard.

This file is only found as ``deepspeed`` because the launcher put its parent directory on
the worker's ``PYTHONPATH``; the work is in :mod:`deepshard.compat.alias`. Imported
under its package name (``deepshard.compat.shim.deepspeed``) it does nothing.
"""

import os as _os

if __name__ == "deepspeed":
    from deepshard.compat import alias as _alias

    # replaces sys.modules["deepspeed"]: the import statement then binds deepshard itself
    _alias.install(shim_dir=_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
