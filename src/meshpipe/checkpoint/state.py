"""Flat state dicts keyed by original names: model tensors, and optimizer state per parameter.

DCP keys: ``model.<fqn>`` for parameters and buffers, ``optim.state.<fqn>.<name>`` for the
optimizer's tensor state of parameter ``<fqn>``. The optimizer's integer parameter ids
differ between layouts, so they never reach the checkpoint; hyperparameters and non-tensor
state go to JSON (``OptimJson``), grouped by the parameters' names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.checkpoint.extra import decode, encode
from meshpipe.checkpoint.strided import is_strided, request_for, resharded
from meshpipe.checkpoint.target import is_dtensor, shape_of

__all__ = [
    "MODEL",
    "OPTIM",
    "model_state",
    "checkpoint_shapes",
    "compare",
    "optimizer_state",
    "merge_optim_json",
    "optimizer_request",
    "optimizer_load",
]

MODEL = "model."
OPTIM = "optim.state."
Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]


def model_state(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of this process's modules, by original name."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for key, value in module.state_dict().items():
            if isinstance(value, torch.Tensor):
                out.setdefault(key, value)
    return out


def checkpoint_shapes(metadata: Metadata, prefix: str, path: str) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor key under ``prefix`` in DCP's metadata (prefix removed)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"{path}: key {key!r} holds pickled bytes, not a tensor; meshpipe checkpoints "
                "hold tensors only and it will not unpickle data",
                path=path,
            )
        out[key[len(prefix) :]] = tuple(int(n) for n in md.size)
    return out


def compare(
    local: dict[str, torch.Tensor], saved: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[Mismatch]]:
    """Keys this process needs that are not saved, and saved keys of a different shape."""
    missing = sorted(k for k in local if k not in saved)
    mismatched = sorted(
        (k, saved[k], shape_of(v))
        for k, v in local.items()
        if k in saved and saved[k] != shape_of(v)
    )
    return missing, mismatched


def _names(named_params: Iterable[tuple[str, nn.Parameter]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in named_params:
        names.setdefault(id(p), name)
    return names


def _group_params(
    optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, nn.Parameter]]
) -> list[list[tuple[str, torch.Tensor]]]:
    names = _names(named_params)
    groups: list[list[tuple[str, torch.Tensor]]] = []
    for i, group in enumerate(optimizer.param_groups):
        named = []
        for j, p in enumerate(group["params"]):
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer's param_groups[{i}]['params'][{j}] (shape "
                    f"{shape_of(p)}) is not a parameter of the model being saved or loaded"
                )
            named.append((names[id(p)], p))
        groups.append(named)
    return groups


def optimizer_state(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, nn.Parameter]],
    aliases: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """DCP tensors and the JSON part (class, hyperparameters, non-tensor state, and the
    other names of parameters held under several: ``aliases``) by name."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for group, named in zip(optimizer.param_groups, _group_params(optimizer, named_params)):
        hparams = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {
                "hparams": encode(hparams, f"optimizer param_groups[{len(groups)}]"),
                "params": [n for n, _ in named],
            }
        )
        for name, p in named:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(key, str) or "." in key:
                    raise CheckpointError(
                        f"optimizer state key {key!r} of {name!r} is not a plain name"
                    )
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM}{name}.{key}"] = value
                else:
                    scalars.setdefault(name, {})[key] = encode(value, f"optimizer state[{name!r}]")
    record = {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}
    return tensors, {**record, "aliases": dict(aliases or {})}


def merge_optim_json(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON record from every process's: groups with equal hyperparameters are merged."""
    classes = sorted({p["class"] for p in parts})
    if len(classes) != 1:
        raise CheckpointError(f"processes hold different optimizer classes: {classes}")
    merged: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    scalars: dict[str, Any] = {}
    for part in parts:
        for group in part["param_groups"]:
            sig = json.dumps(group["hparams"], sort_keys=True)
            entry = merged.setdefault(sig, {"hparams": group["hparams"], "params": []})
            for name in group["params"]:
                if name not in seen:
                    seen.add(name)
                    entry["params"].append(name)
        for name, values in part["scalars"].items():
            scalars.setdefault(name, values)
    aliases = {a: n for part in parts for a, n in part.get("aliases", {}).items()}
    return {
        "class": classes[0], "param_groups": list(merged.values()), "scalars": scalars,
        "aliases": aliases,
    }  # fmt: skip


def optimizer_names(
    named_params: Iterable[tuple[str, nn.Parameter]],
    aliases: Mapping[str, str],
    saved: dict[str, Any],
) -> dict[str, str]:
    """Each parameter's name here -> the name the checkpoint holds its optimizer state under.

    A tied weight is one parameter under two names (a head and the embedding). Where one
    process held both (the two stages on one rank, or the unsplit model), its state was
    saved under the first name only; a layout where a process holds the second name alone
    finds it through the aliases the saving and the loading sides recorded."""
    known = {name for g in saved["param_groups"] for name in g["params"]}
    linked: dict[str, set[str]] = {}
    for a, b in [*saved.get("aliases", {}).items(), *aliases.items()]:
        group = linked.get(a, {a}) | linked.get(b, {b})
        for n in group:
            linked[n] = group
    out: dict[str, str] = {}
    for name, _p in named_params:
        if name not in known:
            found = sorted(linked.get(name, set()) & known)
            if found:
                out[name] = found[0]
    return out


def _allocate(md: TensorStorageMetadata, param: torch.Tensor) -> torch.Tensor:
    size = tuple(int(n) for n in md.size)
    dtype = md.properties.dtype
    if size == shape_of(param):
        # same shape as the parameter: same device and, for a DTensor, the same sharding
        return request_for(param, dtype)
    device = param.device if size and not is_dtensor(param) else torch.device("cpu")
    return torch.empty(size, dtype=dtype, device=device)


def optimizer_request(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, nn.Parameter]],
    metadata: Metadata,
    saved: dict[str, Any],
    saved_as: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors for DCP to fill with this optimizer's state, and the names it lacks
    (``saved_as``: a name here -> the name it was saved under, where they differ)."""
    saved_as = saved_as or {}
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint holds {saved['class']} state but the optimizer is a "
            f"{type(optimizer).__name__}"
        )
    known = {name for g in saved["param_groups"] for name in g["params"]}
    by_param: dict[str, list[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(OPTIM):
            name = key[len(OPTIM) :].rpartition(".")[0]
            by_param.setdefault(name, []).append(key)
    request: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for named in _group_params(optimizer, named_params):
        for here, p in named:
            name = saved_as.get(here, here)
            if name not in known:
                missing.append(f"optim.param_groups.{name}")
            for key in by_param.get(name, []):
                md = metadata.state_dict_metadata[key]
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(
                        f"checkpoint key {key!r} holds pickled bytes, not a tensor"
                    )
                request[key] = _allocate(md, p)
    return request, sorted(missing)


Copies = list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, value) to copy at commit


def _set_hparams(group: dict[str, Any], names: list[str], saved: dict[str, Any]) -> Copies:
    """Put saved hyperparameters in ``group`` (a copy); tensors in it are copied at commit."""
    sigs = {name: saved[name] for name in names if name in saved}
    distinct = {json.dumps(v, sort_keys=True) for v in sigs.values()}
    if len(distinct) > 1:
        raise CheckpointError(
            f"one optimizer param group holds {names}, which were saved with different "
            "hyperparameters; group the parameters as when saving"
        )
    copies: Copies = []
    if not sigs:
        return copies
    values = decode(next(iter(sigs.values())))
    if not isinstance(values, dict):
        raise CheckpointError(f"the saved hyperparameters of {names} are not an object")
    for key, value in values.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            if current.shape != value.shape:
                raise CheckpointError(
                    f"hyperparameter {key!r} of {names} was saved with shape "
                    f"{tuple(value.shape)}; the optimizer's has {tuple(current.shape)}"
                )
            copies.append((current, value))
        else:
            group[key] = value
    return copies


def optimizer_load(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, nn.Parameter]],
    loaded: dict[str, torch.Tensor],
    saved: dict[str, Any],
    saved_as: Mapping[str, str] | None = None,
) -> Callable[[], None]:
    """Prepare loaded state and saved hyperparameters for ``optimizer``, changing nothing.

    Returns the commit: a call that puts them in place (via the optimizer's load_state_dict).
    Every check that can fail runs here, before the commit.
    """
    hparams = {name: g["hparams"] for g in saved["param_groups"] for name in g["params"]}
    scalars = saved["scalars"]
    by_name: dict[str, dict[str, Any]] = {}
    for key, tensor in loaded.items():
        name, _, state_key = key[len(OPTIM) :].rpartition(".")
        by_name.setdefault(name, {})[state_key] = tensor
    native = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    copies: Copies = []
    # whole values DCP loads for strided parameters' state, cut to this rank's slice at
    # commit (DCP fills them after this returns): (entry, state key, parameter)
    strided: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    index = 0
    renamed = saved_as or {}
    for group, here in zip(native["param_groups"], _group_params(optimizer, named_params)):
        named = [(renamed.get(n, n), p) for n, p in here]
        copies += _set_hparams(group, [n for n, _ in named], hparams)
        for name, param in named:
            entry: dict[str, Any] = dict(by_name.get(name, {}))
            if is_strided(param):
                strided.extend((entry, k, param) for k in entry)
            values = decode(scalars.get(name, {}))
            if not isinstance(values, dict):
                raise CheckpointError(f"the saved optimizer state of {name!r} is not an object")
            entry.update(values)
            if entry:
                state[index] = entry
            index += 1
    to_load = {"state": state, "param_groups": native["param_groups"]}

    def commit() -> None:
        with torch.no_grad():
            for current, value in copies:
                current.copy_(value)
        for entry, key, param in strided:
            if shape_of(entry[key]) == shape_of(param):
                entry[key] = resharded(entry[key], param)
        optimizer.load_state_dict(to_load)

    return commit


def raise_gathered(infos: list[dict[str, Any]], what: str, path: str) -> None:
    """Raise the same CheckpointError on every process if any process reported an error."""
    ranks: dict[str, list[int]] = {}  # the same error from several processes is said once
    for r, info in enumerate(infos):
        if info["error"] is not None:
            ranks.setdefault(info["error"], []).append(r)
    if ranks:
        text = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
            for e, rs in ranks.items()
        )
        raise CheckpointError(f"cannot {what}: {text}", path=path)


def check_match(path: str, infos: list[dict[str, Any]], saved: Iterable[str], strict: bool) -> None:
    """Raise CheckpointError naming missing, unexpected and mismatched keys over all processes.

    ``infos``: every process's ``keys`` (what it holds), ``missing`` and ``mismatched``.
    """
    everyone = {k for i in infos for k in i["keys"]}
    missing = sorted({k for i in infos for k in i["missing"]})
    mismatched: list[Mismatch] = sorted(
        {(k, tuple(a), tuple(b)) for i in infos for k, a, b in i["mismatched"]}
    )
    unexpected = sorted(k for k in saved if k not in everyone)
    if not mismatched and not (strict and (missing or unexpected)):
        return
    parts = [
        f"{label} {keys[:20]}{' ...' if len(keys) > 20 else ''}"
        for label, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mismatched (key, checkpoint shape, model shape)", mismatched),
        )
        if keys
    ]
    raise CheckpointError(
        f"{path} does not match the model: " + "; ".join(parts),
        path=path,
        missing=missing,
        unexpected=unexpected,
        mismatched=mismatched,
    )
