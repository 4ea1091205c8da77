"""torch.compile per stage, with the options given, keeping parameter names.

A stage's forward is compiled in place (``module.forward = torch.compile(module.forward)``;
``nn.Module.compile()`` leaves the call uncompiled on torch 2.13), so its parameters keep
their names and module hooks (FSDP2, TP styles) run around the compiled code. With the
``inductor`` (default) or ``aot_eager`` backend the backward is compiled in two halves,
input work and weight work (runtime/step/split_compile.py), so the zero-bubble schedules' W does
the weight-gradient work. Other backends, ``mode=`` or ``options=``, and FSDP2 stages
(whose gradient reduction starts when the input gradients are done) get one fused backward:
I runs it whole and W is empty.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.split_compile import SPLIT_BACKENDS, split_backend

__all__ = ["CompileOption", "compile_options", "compile_stage"]

log = logging.getLogger(__name__)

CompileOption = bool | Mapping[str, Any]


def compile_options(option: Any) -> dict[str, Any] | None:
    """The keyword arguments for ``torch.compile``, or None for no compilation."""
    if option is False or option is None:
        return None
    if option is True:
        return {}
    if isinstance(option, Mapping) and all(isinstance(k, str) for k in option):
        return dict(option)
    raise PipelineError(
        f"compile must be False, True or a dict of torch.compile options, got {option!r}"
    )


def compile_stage(module: nn.Module, options: dict[str, Any] | None, split: bool = True) -> str:
    """Compile ``module``'s forward in place: ``"split"`` (the backward in input and weight
    halves), ``"fused"`` (one backward node), or ``""`` when not compiled."""
    if options is None:
        return ""
    opts = dict(options)
    backend = opts.pop("backend", "inductor")
    splittable = (
        split and isinstance(backend, str) and backend in SPLIT_BACKENDS
        and not {"mode", "options"} & set(opts)
    )  # fmt: skip
    if splittable:
        fn = torch.compile(module.forward, backend=split_backend(backend), **opts)
    else:
        fn = torch.compile(module.forward, backend=backend, **opts)
        log.info("stage compiled with one fused backward (backend %r, options %s)", backend, opts)
    module.forward = fn
    return "split" if splittable else "fused"
