"""torch.compile per stage, with the options given, keeping parameter names.

A stage's forward is compiled in place (``module.forward = torch.compile(module.forward)``;
``nn.Module.compile()`` leaves the call uncompiled on torch 2.13), so its parameters keep
their names and module hooks (FSDP2, TP styles) run around the compiled code. With the
``inductor`` (default) or ``aot_eager`` backend the backward is compiled in two halves,
input work and weight work (runtime/step/split_compile.py), so the zero-bubble schedules' W does
the weight-gradient work, on plain, tensor-parallel and FSDP2 stages alike. Other backends,
``mode=`` or ``options=`` get one fused backward: I runs it whole and W is empty.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.split_compile import SPLIT_BACKENDS, split_backend
from meshpipe.split.module import GraphStage

__all__ = ["CompileOption", "compile_options", "compile_stage"]

log = logging.getLogger(__name__)

_compiled = itertools.count()  # a name of its own for each compiled forward of the process

CompileOption = bool | str | Mapping[str, Any]


def compile_options(option: Any) -> dict[str, Any] | None:
    """The keyword arguments for ``torch.compile`` (plus meshpipe's own ``blocks`` flag),
    or None for no compilation. ``"blocks"`` is ``{"blocks": True}``."""
    if option is False or option is None:
        return None
    if option is True:
        return {}
    if option == "blocks":
        return {"blocks": True}
    if isinstance(option, Mapping) and all(isinstance(k, str) for k in option):
        if not isinstance(option.get("blocks", False), bool):
            raise PipelineError(
                f"compile's 'blocks' must be True or False, got {option['blocks']!r}"
            )
        return dict(option)
    raise PipelineError(
        "compile must be False, True, 'blocks' or a dict of torch.compile options (with "
        f"'blocks': True to compile each block of a stage on its own), got {option!r}"
    )


def stage_blocks(module: nn.Module, index: int) -> list[tuple[str, nn.Module]]:
    """The blocks of a stage compiled one by one: the transformer blocks a traced stage calls
    (``meshpipe_blocks``), or the children of a Sequential stage."""
    names: tuple[str, ...] = getattr(module, "meshpipe_blocks", ())
    if names:
        return [(n, module.get_submodule(n)) for n in names]
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return list(module.named_children())
    raise PipelineError(
        f"compile per block: stage {index} ({type(module).__name__}) has no blocks (neither a "
        "traced stage calling items of a ModuleList nor an nn.Sequential); compile the whole "
        "stage (compile=True) instead"
    )


def compile_stage(module: nn.Module, options: dict[str, Any] | None, index: int = 0) -> str:
    """Compile ``module``'s forward in place, or each of its blocks' (``blocks``):
    ``"split"`` (the backward in input and weight halves), ``"fused"`` (one backward node),
    or ``""`` when not compiled."""
    if options is None:
        return ""
    opts = dict(options)
    per_block = opts.pop("blocks", False)
    backend = opts.pop("backend", "inductor")
    splittable = (
        isinstance(backend, str) and backend in SPLIT_BACKENDS
        and not {"mode", "options"} & set(opts)
    )  # fmt: skip
    chosen = split_backend(backend) if splittable else backend
    if not splittable:
        log.info("stage compiled with one fused backward (backend %r, options %s)", backend, opts)
    if "dynamic" not in opts and holds_tp_dtensors(module):
        # torch 2.13: recompiling a stage of tp DTensors with symbolic sizes, as dynamo does
        # on the second sequence length, recurses until Python's limit in AOTAutograd
        # (pytorch#152954): compile each shape on its own (up to dynamo's recompile limit,
        # then that shape runs eager)
        opts["dynamic"] = False
        log.info("stage %d holds tp DTensors: compiled with static shapes", index)
    targets = stage_blocks(module, index) if per_block else [("", module)]
    for name, target in targets:
        for part in target.modules():
            if isinstance(part, GraphStage):
                part.prepare_code()
        entry = _own_code(
            target.forward, f"meshpipe_stage{index}_{name or 'forward'}_{next(_compiled)}"
        )
        target.forward = torch.compile(entry, backend=chosen, **opts)
    return "split" if splittable else "fused"


def holds_tp_dtensors(module: nn.Module) -> bool:
    """Whether ``module`` has a parameter or buffer laid out over a ``tp`` mesh axis."""
    from torch.distributed.tensor import DTensor

    for t in itertools.chain(module.parameters(), module.buffers()):
        if isinstance(t, DTensor) and "tp" in (t.device_mesh.mesh_dim_names or ()):
            return True
    return False


def _own_code(forward: Any, name: str) -> Any:
    """``forward`` called through a function with a code object of its own, named ``name``.
    dynamo keeps its compiled code and its recompile count (8 at most, then the code runs
    eager) per code object, and the shapes it has seen (a new one makes the next compile
    dynamic) per file, line, name and closure; every traced stage's forward is
    ``GraphStage.forward`` and every Sequential's ``nn.Sequential.forward``, so without a
    code object and a name of its own the stages of a process would share one count, and a
    stage whose inputs differ from another's would compile with dynamic shapes."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=name.replace(".", "_"))
    return call
