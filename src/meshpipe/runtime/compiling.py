"""torch.compile per stage, with the options given, keeping parameter names.

A stage is compiled in place (``module.compile(**options)``), so its parameters keep their
names and FSDP2/TP wrapping still applies to the module itself. A compiled stage's backward
is one fused node computing input and weight gradients together, so the zero-bubble split
cannot separate them: for such stages I runs the whole backward and W is empty (the
schedule still runs, with the weight work moved into I).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["CompileOption", "compile_options", "compile_stage"]

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


def compile_stage(module: nn.Module, options: dict[str, Any] | None) -> bool:
    """Compile ``module`` in place; True when it was."""
    if options is None:
        return False
    module.compile(**options)
    return True
