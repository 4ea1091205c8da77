"""``tp_plan="auto"``: the tensor-parallel plan a Hugging Face model declares, as torch's
parallel styles keyed by the model's own module names (see docs/parallel.md)."""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    SequenceParallel,
)

from meshpipe.errors import PipelineError
from meshpipe.parallel.mla import MlaKvAProj
from meshpipe.parallel.moe_tp import ExpertsTP
from meshpipe.parallel.replicated import ReplicatedGradSum
from meshpipe.parallel.rowwise import OwnedRowwise

__all__ = ["auto_ep_plan", "auto_tp_plan", "CONFIG_STYLES", "HF_STYLES"]

EP_EXPERTS = "ep_dispatch_experts"  # the style transformers gives an experts module
TP_EXPERTS = "moe_tp_experts"  # its style under tp: the weights' entries name their styles
# an experts weight's style in the plan: (its part, the experts' layout; moe_tp.py)
_EXPERT_WEIGHTS = {
    "packed_colwise": ("packed", "out_in"),
    "rowwise": ("rowwise", "out_in"),
    "packed_rowwise": ("packed", "in_out"),
    "colwise": ("rowwise", "in_out"),
}

# transformers' style names -> torch's parallel styles (their meaning for nn.Linear)
HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    # rowwise: OwnedRowwise, torch's RowwiseParallel whose output may be changed in place
    "rowwise": OwnedRowwise,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": OwnedRowwise,
    # a whole input (after a gathered colwise layer) cut on its last dim first (a slice)
    "rowwise_split_input": lambda: OwnedRowwise(input_layouts=Replicate()),
    # an embedding sharded over the vocabulary: the token ids whole on every tp rank
    "embedding_rowwise": lambda: OwnedRowwise(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    # per-head norms after a colwise projection (Qwen 3, Gemma 3): parallel/replicated.py
    "replicated_with_grad_allreduce": ReplicatedGradSum,
}

# styles that read the model's config
CONFIG_STYLES: dict[str, Callable[[Any], ParallelStyle]] = {
    # MLA's compressed key/value projection (DeepSeek-V2/V3): parallel/mla.py
    "mla_kv_a_proj": lambda config: MlaKvAProj(int(config.qk_rope_head_dim)),
}


def _declared(model: nn.Module, kind: str = "tp") -> dict[str, str]:
    """The model's declared plan, keys made full module names: the base model's plan (from
    its config, under ``base_model_prefix``, or the name the head holds its base model by)
    and the head's own (``_tp_plan``); ``kind`` "ep": ``base_model_ep_plan``."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = dict(getattr(config, f"base_model_{kind}_plan", None) or {})
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    if prefix and not isinstance(getattr(model, prefix, None), nn.Module):
        # the head names its base model otherwise (Llama 4's says language_model and holds
        # it as model): the child that is itself a transformers model
        prefix = next((n for n, c in model.named_children() if _is_hf_model(c)), prefix)
    has_prefix = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for key, style in base.items():
        plan[f"{prefix}.{key}" if has_prefix else key] = style
    for key, style in dict(getattr(type(model), f"_{kind}_plan", None) or {}).items():
        plan.setdefault(key, style)
    return plan


def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(type(module), "base_model_prefix")


def auto_tp_plan(model: Any) -> dict[str, ParallelStyle]:
    """The plan ``model`` declares, translated; PipelineError if it declares none or uses a
    style meshpipe cannot translate (named, with the styles it can)."""
    if not isinstance(model, nn.Module) or isinstance(model, (list, tuple, nn.ModuleList)):
        raise PipelineError(
            "tp_plan='auto' reads the plan a whole Hugging Face model declares; pass the "
            "whole model (not a list of stages), or an explicit tp_plan={...}"
        )
    declared = _declared(model)
    if not declared:
        raise PipelineError(
            f"{type(model).__name__} declares no tensor-parallel plan (its config has no "
            "base_model_tp_plan); pass tp_plan={pattern: ParallelStyle} (docs/parallel.md "
            "shows one for GPT-2)"
        )
    names = [n for n, _ in model.named_modules() if n]
    experts = _experts_styles(model, declared, names)
    plan: dict[str, ParallelStyle] = dict(experts)
    for key, style in declared.items():
        if TP_EXPERTS in (style, declared.get(key.rpartition(".")[0])):
            continue  # an experts module, or one of its weights (ExpertsTP)
        if not any(fnmatchcase(n, key) for n in names):
            if any(fnmatchcase(n, key) for n, _ in model.named_parameters()):
                raise PipelineError(
                    f"{type(model).__name__}'s tp plan gives the parameter {key!r} the style "
                    f"{style!r}; tp_plan='auto' splits parameters of experts modules only "
                    "(meshpipe.parallel.ExpertsTP); pass an explicit tp_plan={...}"
                )
            continue  # the plan names layers this configuration lacks (dense MLPs of a MoE)
        plan[key] = _style(model, key, str(style))
    return plan


def _style(model: nn.Module, key: str, style: str) -> ParallelStyle:
    """torch's parallel style for transformers' ``style``, or PipelineError naming it."""
    make = HF_STYLES.get(style)
    if make is not None:
        return make()
    with_config = CONFIG_STYLES.get(style)
    config = getattr(model, "config", None)
    if with_config is not None:
        try:
            return with_config(config)
        except (AttributeError, TypeError, ValueError) as e:
            raise PipelineError(
                f"{type(model).__name__}'s tp plan gives {key!r} the style {style!r}, which "
                f"reads the model's config, and it could not: {type(e).__name__}: {e}"
            ) from e
    known = sorted([*HF_STYLES, *CONFIG_STYLES])
    raise PipelineError(
        f"{type(model).__name__}'s tp plan gives {key!r} the style {style!r}, which "
        f"tp_plan='auto' cannot translate (it knows {known}); pass an explicit tp_plan={{...}}"
    )


def _experts_styles(
    model: nn.Module, declared: dict[str, str], names: list[str]
) -> dict[str, ParallelStyle]:
    """One ExpertsTP per experts module of the plan (style ``moe_tp_experts``), from the
    styles the plan gives its weights (``<module>.<weight>``: packed_colwise and rowwise, or
    Llama 4's packed_rowwise and colwise)."""
    out: dict[str, ParallelStyle] = {}
    for key, style in declared.items():
        if style != TP_EXPERTS or not any(fnmatchcase(n, key) for n in names):
            continue  # not an experts module, or one this model's layers lack
        kinds: dict[str, list[str]] = {"packed": [], "rowwise": []}
        layouts: dict[str, str] = {}  # layout -> a weight that has it
        for sub, weight_style in declared.items():
            if not sub.startswith(f"{key}.") or "." in sub[len(key) + 1 :]:
                continue
            kind = _EXPERT_WEIGHTS.get(str(weight_style))
            if kind is None:
                raise PipelineError(
                    f"{type(model).__name__}'s tp plan gives the experts weight {sub!r} the "
                    f"style {weight_style!r}; tp_plan='auto' splits experts weights "
                    f"{sorted(_EXPERT_WEIGHTS)} only (meshpipe.parallel.ExpertsTP); pass an "
                    "explicit tp_plan={...} or use ep"
                )
            kinds[kind[0]].append(sub[len(key) + 1 :])
            layouts.setdefault(kind[1], f"{sub}: {weight_style}")
        if len(layouts) > 1:
            raise PipelineError(
                f"{type(model).__name__}'s tp plan mixes the experts layouts of "
                f"{sorted(layouts.values())} in {key!r}: packed_colwise goes with rowwise "
                "(weights as nn.Linear's), packed_rowwise with colwise (Llama 4's); pass an "
                "explicit tp_plan={...}"
            )
        layout = next(iter(layouts), "out_in")
        out[key] = ExpertsTP(packed=kinds["packed"], rowwise=kinds["rowwise"], layout=layout)
    return out


def auto_ep_plan(model: Any) -> list[str]:
    """``ep_plan="auto"``: the experts modules a Hugging Face MoE model's config declares in
    ``base_model_ep_plan`` (the keys of style ``ep_dispatch_experts``, full module names),
    as patterns for meshpipe's ep; PipelineError if it declares none."""
    if not isinstance(model, nn.Module) or isinstance(model, (list, tuple, nn.ModuleList)):
        raise PipelineError(
            "ep_plan='auto' reads the plan a whole Hugging Face model declares; pass the "
            "whole model (not a list of stages), or ep_plan=[...] naming the experts modules"
        )
    plan = [key for key, style in _declared(model, "ep").items() if style == EP_EXPERTS]
    if not plan:
        raise PipelineError(
            f"{type(model).__name__} declares no experts modules (its config has no "
            f"base_model_ep_plan entry of style {EP_EXPERTS!r}); pass ep_plan=[...] naming "
            "the modules holding the stacked expert weights (docs/axes.md)"
        )
    return plan
