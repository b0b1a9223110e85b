"""Not imported by name: this directory goes on the workers' ``PYTHONPATH`` under
``ds-run --deepspeed_compat``, for the ``deepspeed`` package inside it (see
:mod:`deepshard.compat`). This file only makes the directory part of the installed
package."""
