"""Run by Python at start-up in ``ds-run --deepspeed_compat`` workers (this directory is
first on their ``PYTHONPATH``), before the script: transformers' own ``HfDeepSpeedConfig``
then also registers with deepshard's sliced ZeRO-3 loader, even when the script builds its
``TrainingArguments`` before anything imports ``deepspeed``
(:mod:`deepshard.compat.transformers_hook`; nothing is imported beyond a finder). Then the
``sitecustomize`` this file shadows, if any, runs as it would have.
"""


def _start() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    try:
        from deepshard.compat import transformers_hook

        transformers_hook.adopt()
    except ImportError:  # deepshard not importable by this interpreter: nothing to adopt
        pass
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_start()
