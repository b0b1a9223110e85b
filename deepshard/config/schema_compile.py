"""The ``compile`` config section, in both of the schemas DeepSpeed has had.

DeepSpeed 0.19.8's schema is DeepCompile's (``deepspeed.compile.config.CompileConfig``):
``{"compile": {"deepcompile": true, ...}}``, the graph passes that compile ZeRO's
collectives into the model. Up to DeepSpeed 0.15 the section was ``torch.compile``'s:
``{"compile": {"disable": false, "backend": "inductor"}}`` (the form Axolotl ships in
``zero{1,2}_torch_compile.json``), with ``enabled`` and ``kwargs`` in 0.14. DeepSpeed 0.19.8
refuses the older form (its model forbids extra keys); deepshard accepts both, one per
section.

Either way deepshard compiles the model with ``torch.compile`` at ``initialize`` (see
:attr:`CompileConfig.at_initialize`); at ZeRO stage 3 its gathers and releases run outside
the compiled regions, which stands in for DeepCompile. DeepCompile's memory switches that
would change what is kept where are refused with what deepshard does instead; its
scheduling switches (double buffering, syncs around collectives, kept inputs) change no
result and are accepted with no effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ValidationInfo, model_validator

from deepshard.config.schema_base import (
    Bool,
    Int,
    KeyLog,
    Section,
    doc,
    fail,
    key_log,
    one_of,
)
from deepshard.errors import UsageError

PassName = Annotated[Literal["z1", "z3", "autosp", "autotp"],
                     one_of("z1", "z3", "autosp", "autotp")]

_LEGACY_KEYS = ("enabled", "disable", "backend", "kwargs")
"""The keys of the ``torch.compile`` schema (DeepSpeed <= 0.15); every other key of the
section is DeepCompile's (DeepSpeed 0.19.8)."""

_REFUSED: dict[str, tuple[str, str]] = {
    "free_activation": (
        "DeepCompile's eager freeing of activations is not implemented",
        "remove it; to save activation memory use activation_checkpointing"),
    "offload_activation": (
        "DeepCompile's activation offload is not implemented",
        "remove it; to keep activations in host memory use "
        "activation_checkpointing.cpu_checkpointing"),
    "offload_opt_states": (
        "DeepCompile's optimizer-state offload is not implemented",
        "remove it; to keep optimizer states in host memory use "
        "zero_optimization.offload_optimizer"),
    "offload_parameters": (
        "DeepCompile's parameter offload is not implemented",
        "remove it; to keep parameters in host memory use zero_optimization.offload_param"),
    "symmetric_memory": (
        "DeepCompile's CUDA symmetric-memory collectives are not implemented",
        "remove it or set it to false (deepshard has no counterpart)"),
    "autoep_non_moe": (
        "compiling only the parents of AutoEP layers is not implemented",
        "remove it: engine.compile() compiles every block of the model, MoE layers included"),
}
"""DeepCompile's boolean switches deepshard refuses when true: (what, the fix)."""

_REFUSED_PASSES = {
    "autosp": "remove 'autosp' and use sequence_parallel_size (Ulysses sequence "
              "parallelism)",
    "autotp": "remove 'autotp' and set tensor_parallel.autotp_size",
}


class CompileConfig(Section):
    """``compile``: compile the model at ``initialize``, in either of DeepSpeed's schemas.

    DeepSpeed <= 0.15 (``enabled``, ``disable``, ``backend``, ``kwargs``: ``torch.compile``
    with that backend and those keyword arguments) or DeepSpeed 0.19.8 (DeepCompile's keys,
    its defaults); a section mixing the two is refused. DeepSpeed 0.19.8 itself refuses the
    older schema; deepshard accepts it. Read it through :attr:`at_initialize`,
    :attr:`backend_name`, :attr:`compile_kwargs` and :attr:`debug`.
    """

    # ---- DeepSpeed <= 0.15: torch.compile's options --------------------------------------
    enabled: Bool = doc("DeepSpeed 0.14: compile the model at initialize.", default=False)
    disable: Bool | None = doc(
        "DeepSpeed <= 0.13: false compiles the model at initialize, true does not; None: not "
        "given.", default=None)
    backend: str = doc("The torch.compile backend (old schema).", default="inductor")
    kwargs: dict[str, Any] = doc("Keyword arguments to torch.compile (old schema).",
                                 default_factory=dict)

    # ---- DeepSpeed 0.19.8: DeepCompile -----------------------------------------------------
    deepcompile: Bool = doc(
        "Compile the model at initialize (deepshard: torch.compile, with ZeRO-3's gathers "
        "outside the compiled regions, in place of DeepCompile's passes).", default=False)
    autoep_non_moe: Bool = doc("Compile only the parents of AutoEP layers: refused when "
                               "true.", default=False)
    free_activation: Bool = doc("Free activations eagerly: refused when true.",
                                default=False)
    free_activation_threshold: Int = doc("Bytes from which free_activation frees: no effect "
                                         "in deepshard.", default=10 * 1024 * 1024)
    offload_activation: Bool = doc("Offload saved activations to host memory: refused when "
                                   "true.", default=False)
    offload_activation_pin_memory: Bool = doc("Pin offload_activation's host buffers: no "
                                              "effect in deepshard.", default=True)
    offload_opt_states: Bool = doc("Offload optimizer states to host memory: refused when "
                                   "true.", default=False)
    double_buffer: Bool = doc("Double-buffer prefetched parameters: no effect in "
                              "deepshard.", default=True)
    symmetric_memory: Bool = doc("Collectives over CUDA symmetric memory: refused when "
                                 "true.", default=False)
    debug_log: Bool = doc("Log each graph break's reason and every recompilation (the "
                          "graphs and graph breaks are logged at the first step anyway).",
                          default=False)
    offload_parameters: Bool = doc("Offload parameters to host memory: refused when true.",
                                   default=False)
    sync_before_reduce: Bool = doc("Synchronize before each reduce: no effect in deepshard.",
                                   default=False)
    sync_after_reduce: Bool = doc("Synchronize after each reduce: no effect in deepshard.",
                                  default=False)
    sync_before_allgather: Bool = doc("Synchronize before each all-gather: no effect in "
                                      "deepshard.", default=False)
    sync_after_allgather: Bool = doc("Synchronize after each all-gather: no effect in "
                                     "deepshard.", default=False)
    keep_int_input_tensors: Bool = doc("Keep integer inputs' values for recompilation: no "
                                       "effect in deepshard.", default=True)
    keep_all_input_tensors: Bool = doc("Keep all inputs' values for recompilation: no effect "
                                       "in deepshard.", default=False)
    passes: list[PassName] | None = doc(
        "DeepCompile's passes: 'z1'/'z3' are accepted where they match "
        "zero_optimization.stage (deepshard's ZeRO comes from that stage), 'autosp' and "
        "'autotp' are refused; None: DeepSpeed's default schedule.", default=None)

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        legacy = [k for k in data if k in _LEGACY_KEYS]
        current = [k for k in data if k not in _LEGACY_KEYS]
        if legacy and current:
            raise UsageError(
                f"{current[0]!r} (DeepSpeed 0.19's DeepCompile schema) and {legacy[0]!r} "
                "(the torch.compile schema of DeepSpeed <= 0.15) are mixed in one section",
                where=log.where(legacy[0]),
                hint=f"keep either {', '.join(current)} (DeepSpeed 0.19) or "
                     f"{', '.join(legacy)} (DeepSpeed <= 0.15), not both")
        return data

    @model_validator(mode="after")
    def _refusals(self, info: ValidationInfo) -> CompileConfig:
        log = key_log(info) or KeyLog()
        if not self.backend.strip():
            raise fail(log, "backend", "the torch.compile backend is empty",
                       "name a torch.compile backend, e.g. 'inductor', or remove the key")
        if self.enabled and self.disable is True:
            raise fail(log, "disable", "enabled is true and disable is true",
                       "keep one of them: enabled: true or disable: false compiles")
        if not self.enabled and self.disable is False and "enabled" in self.model_fields_set:
            raise fail(log, "disable", "enabled is false and disable is false",
                       "keep one of them: enabled: true or disable: false compiles")
        for key, (what, hint) in _REFUSED.items():
            if getattr(self, key):
                raise fail(log, key, what, hint)
        for name in self.passes or ():
            if name in _REFUSED_PASSES:
                raise fail(log, "passes", f"DeepCompile's {name!r} pass is not implemented",
                           _REFUSED_PASSES[name])
        return self

    @property
    def at_initialize(self) -> bool:
        """Whether ``initialize`` compiles the model: ``enabled: true`` or ``disable:
        false`` (DeepSpeed <= 0.15), ``deepcompile: true`` (DeepSpeed 0.19.8)."""
        return self.enabled or self.disable is False or self.deepcompile

    @property
    def backend_name(self) -> str:
        """The ``torch.compile`` backend (``backend``; ``"inductor"`` by default)."""
        return self.backend

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments to ``torch.compile`` (a copy of ``kwargs``)."""
        return dict(self.kwargs)

    @property
    def debug(self) -> bool:
        """Whether to log each graph break's reason and every recompilation
        (``debug_log``)."""
        return self.debug_log


__all__ = ["CompileConfig"]
