"""Who failed first: the culprit of a failed call, claimed in the job's store by the first
process that knows it, and named in every process's error.

A process whose step raised its own error claims itself (before it tells any peer, so a
peer that hears of the failure finds the claim). A process whose wait timed out claims
the process it waited for, following the published waits (runtime/failures/waiting.py) to one
that was in no wait of its own: the frozen one, not a peer that waits on it too. The
first claim of a call wins (``compare_set`` on ``meshpipe/culprit/{call}``); every other
failed process reads it (waiting a moment for it when its own error is a consequence:
a peer that closed its connection, a failure notice, the closing collective's count)
and names it: meshpipe's errors in their message, others in a note
(``BaseException.add_note``); the claim is also ``exc.meshpipe_culprit`` and
``Pipeline.status()["culprit"]``, which the launcher's root-cause line reads.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import CommTimeoutError, MeshpipeError, RemoteStageError, is_refusal
from meshpipe.runtime.failures import waiting
from meshpipe.runtime.failures.waits import translate
from meshpipe.runtime.mesh.topology import Topology

__all__ = ["Blame", "culprit_text", "positions"]

log = logging.getLogger(__name__)

_KEY = "meshpipe/culprit"
E = TypeVar("E", bound=BaseException | None)
_READ_S = 4.0  # how long a consequence waits for the claim of its cause (a loaded host: 2 s missed)
_POLL_S = 0.02


def positions(topo: Topology, mesh: DeviceMesh | Sequence[DeviceMesh]) -> dict[int, str]:
    """Mesh coordinates of every global rank of the pipeline, as ``pp=1, dp=1`` (axes of
    size 1 left out, pp always shown)."""
    out: dict[int, str] = {}
    if topo.stage_meshes or not isinstance(mesh, DeviceMesh):
        lay = topo.layout
        for proc, g in enumerate(lay.ranks):
            pp, d, t = lay.place(proc)
            dp, tp = lay.shape(pp)
            parts = [f"pp={pp}"] + [f"dp={d}"] * (dp > 1) + [f"tp={t}"] * (tp > 1)
            out[g] = ", ".join(parts)
        return out
    names = tuple(mesh.mesh_dim_names or ())
    grid = mesh.mesh
    shape = tuple(grid.shape)
    flat = grid.flatten().tolist()
    for i, idx in enumerate(itertools.product(*(range(n) for n in shape))):
        parts = [
            f"{name}={c}"
            for name, c, n in zip(names, idx, shape, strict=True)
            if n > 1 or name == "pp"
        ]
        out[int(flat[i])] = ", ".join(parts) or "pp=0"
    return out


def culprit_text(claim: dict[str, Any]) -> str:
    """What a claim says, e.g. ``global rank 3 (pp=1, dp=1) failed first: RuntimeError: ...``
    or ``global rank 3 (pp=1, dp=1) is stuck: global rank 1 (pp=0, dp=1) waited 5.0s ...``."""
    who = " and ".join(_name(r, w) for r, w in zip(claim["ranks"], claim["where"], strict=True))
    if claim["kind"] == "failed":
        return f"{who} failed first: {claim['error']}"
    verb = "are" if len(claim["ranks"]) > 1 else "is"
    return (
        f"{who} {verb} stuck: {_name(claim['by'], claim['by_where'])} waited "
        f"{claim['waited']:.1f}s for it, and it was in no meshpipe wait itself (frozen, or "
        "busy elsewhere)"
    )


def _name(rank: int, where: str | None) -> str:
    return f"global rank {rank}" + (f" ({where})" if where else "")


def _note(e: BaseException, text: str) -> None:
    """A note shown under ``e``'s traceback (Python 3.11's add_note; a list before)."""
    add = getattr(e, "add_note", None)
    if add is not None:
        add(text)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), text]  # type: ignore[attr-defined]


def _kind(e: BaseException) -> str:
    """Whether ``e`` is this process's "own" error, a "timeout", or a "consequence" of a
    peer's failure."""
    if isinstance(e, RemoteStageError):
        return "consequence"
    if isinstance(e, CommTimeoutError):
        return "timeout"
    t = translate(e, "")
    if isinstance(t, RemoteStageError):
        return "consequence"
    return "timeout" if isinstance(t, CommTimeoutError) else "own"


class Blame:
    """A Pipeline's part in naming the culprit of a failed call (see the module doc)."""

    def __init__(
        self, topo: Topology, mesh: DeviceMesh | Sequence[DeviceMesh], timeout: float
    ) -> None:
        self._topo, self._mesh, self._timeout = topo, mesh, timeout
        self._where: dict[int, str] | None = None
        self._call = 0
        self.claim: dict[str, Any] | None = None  # the current call's culprit, once known

    def begin(self) -> None:
        """A new call: the same count on every process (the store's keys are per call)."""
        self._call = waiting.next_call()
        self.claim = None

    def where(self, rank: int) -> str | None:
        if self._where is None:
            try:
                self._where = positions(self._topo, self._mesh)
            except Exception:  # noqa: BLE001 - names without coordinates then
                self._where = {}
        return self._where.get(rank)

    # -- claiming -------------------------------------------------------------------
    def claim_first(self, e: BaseException) -> None:
        """Claim the culprit this process knows of: itself for its own error, the process
        it (transitively) waited for after a timeout. Call before telling any peer."""
        if self.claim is not None or is_refusal(e):
            return
        try:
            kind = _kind(e)
            mine = None
            if kind == "own":
                mine = self._own(e)
            elif kind == "timeout":
                mine = self._stuck(e)
            if mine is not None:
                self._put(mine)
        except Exception:  # noqa: BLE001 - the error itself must still be raised
            log.debug("could not claim the culprit", exc_info=True)

    def _me(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _own(self, e: BaseException) -> dict[str, Any]:
        me = self._me()
        text = f"{type(e).__name__}: {e}"
        return self._made([me], "failed", text[:400], me, 0.0)

    def _made(
        self, ranks: list[int], kind: str, error: str, by: int, waited: float
    ) -> dict[str, Any]:
        claim = {
            "rank": ranks[0],
            "ranks": ranks,
            "where": [self.where(r) for r in ranks],
            "kind": kind,
            "error": error,
            "by": by,
            "by_where": self.where(by),
            "waited": waited,
            "call": self._call,
            "time": time.time(),
        }
        claim["text"] = culprit_text(claim)  # for readers without this module (the launcher)
        return claim

    def _stuck(self, e: BaseException) -> dict[str, Any] | None:
        """The claim of a timed-out process: the processes at the end of the chain of
        published waits that starts at the one it waited for."""
        me = self._me()
        world = [r for r in range(dist.get_world_size()) if r != me]
        peer = getattr(e, "peer", None)
        ranks = self._topo.layout.ranks
        awaited = ranks[peer] if isinstance(peer, int) and 0 <= peer < len(ranks) else None
        if awaited is None:
            awaited = waiting.last_awaited()
        start = [awaited] if awaited is not None else world
        records: dict[int, dict[str, Any] | None] = {}
        stuck: list[int] = []
        seen, todo = {me}, list(start)
        while todo:
            g = todo.pop(0)
            if g in seen:
                continue
            seen.add(g)
            if g not in records:
                records[g] = waiting.read_records(self._call, [g]).get(g)
            rec = records[g]
            if rec is None:
                stuck.append(g)
            else:
                nxt = rec.get("awaited")
                todo.extend([nxt] if isinstance(nxt, int) else world)
        if not stuck:  # everyone waits: a cycle (ranks running different code)
            if awaited is None:
                return None
            stuck = [awaited]
        return self._made(sorted(stuck), "stuck", str(e)[:300], me, self._timeout)

    def _put(self, mine: dict[str, Any]) -> None:
        store = waiting.job_store()
        if store is None:
            self.claim = mine
            return
        body = json.dumps(mine)
        got = store.compare_set(f"{_KEY}/{self._call}", "", body)
        self.claim = json.loads(got.decode() if isinstance(got, bytes) else got)

    def _read(self, patience: float) -> None:
        """The call's claim, waiting up to ``patience`` seconds for one."""
        store = waiting.job_store()
        if store is None:
            return
        key = f"{_KEY}/{self._call}"
        deadline = time.monotonic() + patience
        try:
            while True:
                if store.check([key]):
                    self.claim = json.loads(store.get(key).decode())
                    return
                if time.monotonic() >= deadline:
                    return
                time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - the store may be gone with its host
            log.debug("could not read the culprit", exc_info=True)

    # -- naming ---------------------------------------------------------------------
    def named(self, e: E) -> E:
        """``e`` naming the call's culprit (read from the store, waiting a moment when
        ``e`` is a consequence of another process's failure); returns ``e`` (None: None)."""
        if e is not None:
            self._name(e)
        return e

    def _name(self, e: BaseException) -> None:
        if hasattr(e, "meshpipe_culprit") or is_refusal(e):
            return
        if self.claim is None:
            self.claim_first(e)
        if self.claim is None:
            self._read(min(self._timeout, _READ_S) if _kind(e) == "consequence" else 0.0)
        claim = self.claim
        if claim is None:
            return
        try:
            e.meshpipe_culprit = claim  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__
            return
        text = culprit_text(claim)
        me = self._me()
        if claim["kind"] == "failed" and claim["rank"] == me and _kind(e) == "own":
            _note(e, f"meshpipe: this process, {_name(me, self.where(me))}, failed first")
        elif isinstance(e, MeshpipeError) and e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]}; the cause: {text}", *e.args[1:])
        else:
            _note(e, f"meshpipe: the cause: {text}")

    def failed(self, e: BaseException) -> BaseException:
        """Claim what this process knows, then name the culprit in ``e`` (for failures
        outside the step's actions, where no peer is told of them)."""
        self.claim_first(e)
        return self.named(e)
