"""Split points: check the user's, and find the trunk of blocks that automatic points come from."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence

from torch import nn

from meshpipe.errors import SplitError

__all__ = ["check_points", "trunk_blocks", "declared_trunk", "check_num_stages"]

log = logging.getLogger(__name__)


def check_points(model: nn.Module, points: Sequence[str]) -> list[str]:
    """The points as a list, each naming a distinct, non-nested submodule of ``model``."""
    if isinstance(points, str):
        raise SplitError(f"points must be a list of submodule names, got the string {points!r}")
    names = dict(model.named_modules())
    out: list[str] = []
    for p in points:
        if not isinstance(p, str) or not p:
            raise SplitError(f"a split point must be a submodule name (a non-empty str), got {p!r}")
        if p not in names:
            near = difflib.get_close_matches(p, list(names), n=3)
            hint = f"; did you mean {near}?" if near else ""
            raise SplitError(
                f"split point {p!r} names no submodule of {type(model).__name__}{hint}"
            )
        if p in out:
            raise SplitError(f"split point {p!r} is given twice")
        out.append(p)
    for a in out:
        for b in out:
            if b.startswith(a + "."):
                raise SplitError(f"split point {b!r} is inside split point {a!r}; points nest")
    return out


def declared_trunk(model: nn.Module) -> str | None:
    """The block list a Hugging Face model declares as its pipeline trunk: the entry of
    ``config.base_model_pp_plan`` that is a ModuleList (``"layers"``), under the base model
    (``model.model.layers`` for a ``*ForCausalLM``); None when the model declares none."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = prefix if isinstance(prefix, str) and prefix and hasattr(model, prefix) else ""
    names = dict(model.named_modules())
    for key in plan:
        path = f"{base}.{key}" if base else str(key)
        found = names.get(path)
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 1:
            return path
    log.warning(
        "%s declares base_model_pp_plan %s but none of its entries is a list of blocks "
        "under %r; choosing the trunk by size",
        type(model).__name__, list(plan), base,
    )  # fmt: skip
    return None


def trunk_blocks(model: nn.Module) -> list[str]:
    """The model's repeated blocks, in order: an nn.Sequential's children; the block list a
    Hugging Face model declares in ``base_model_pp_plan``; else the items of the ModuleList
    (or nested Sequential) holding the most parameters."""
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()]
    declared = declared_trunk(model)
    if declared is not None:
        log.info("splitting along %s, the trunk the model's base_model_pp_plan declares", declared)
        return [f"{declared}.{name}" for name, _ in model.get_submodule(declared).named_children()]
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, name, m)
    if best is None:
        raise SplitError(
            f"{type(model).__name__} has no nn.Sequential or nn.ModuleList of blocks to choose "
            "split points from; pass points=[...] naming the submodules that begin each stage, "
            "or a list of stage modules"
        )
    _, prefix, container = best
    return [f"{prefix}.{name}" if prefix else name for name, _ in container.named_children()]


def check_num_stages(num_stages: object, num_blocks: int, where: str) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise SplitError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > num_blocks:
        raise SplitError(
            f"{num_stages} stages asked for but {where} has only {num_blocks} splittable blocks; "
            "use fewer stages, pass points=[...] inside the blocks, or a list of stage modules"
        )
    return num_stages
