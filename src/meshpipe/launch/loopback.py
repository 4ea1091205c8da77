"""Rendezvous for a job on one machine, reachable from this machine only: a TCPStore served on
127.0.0.1 (torch's own store servers listen on every interface, whatever host they are given),
and the elastic agent's rendezvous handler that shares it with the ranks."""

from __future__ import annotations

import contextlib
import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["LOOPBACK", "BACKEND", "loopback_store", "loopback_interface", "register"]

LOOPBACK = "127.0.0.1"
BACKEND = "meshpipe-loopback"  # the rendezvous backend name launch() asks the agent for
_STORE_TIMEOUT_S = 300.0  # how long the agent's own store reads may wait


def loopback_store(timeout: float = _STORE_TIMEOUT_S) -> TCPStore:
    """A TCPStore server listening on 127.0.0.1 only, on a port the system picks
    (``store.port``): the socket is bound here and handed to the store, which owns it."""
    from torch._C._distributed_c10d import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(1024)
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    # from here the store owns the descriptor, and closes it even when it fails to start
    return TCPStore(
        LOOPBACK,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), for
    GLOO_SOCKET_IFNAME: gloo otherwise listens on the address the hostname resolves to."""
    with contextlib.suppress(OSError, AttributeError):
        names = {name for _index, name in socket.if_nameindex()}
        for name in ("lo", "lo0"):
            if name in names:
                return name
    return None


def _handler_class() -> type[RendezvousHandler]:
    """The handler class, made on first use (it subclasses torch's, imported only then)."""
    from torch._C._distributed_c10d import PrefixStore, Store
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class LoopbackRendezvous(RendezvousHandler):
        """One node, this machine: the agent's store on 127.0.0.1, shared with its ranks
        (their MASTER_ADDR/MASTER_PORT), a fresh key prefix for the agent every round."""

        def __init__(self, run_id: str) -> None:
            self._run_id = run_id
            self._store: TCPStore | None = None
            self._round = 0
            self._closed = False

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            if self._closed:
                raise RendezvousClosedError(f"rendezvous {self._run_id} is closed")
            if self._store is None:
                self._store = loopback_store()
            self._round += 1
            agent: Store = PrefixStore(f"meshpipe.agent.{self._round}/", self._store)
            return RendezvousInfo(agent, 0, 1, RendezvousStoreInfo(LOOPBACK, int(self._store.port)))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._closed = True
            self._store = None
            return True

    return LoopbackRendezvous


_CLASS: list[type[RendezvousHandler]] = []


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if not _CLASS:
        _CLASS.append(_handler_class())
    return _CLASS[0](params.run_id)  # type: ignore[call-arg]


def register() -> None:
    """Make BACKEND known to torch's rendezvous registry (again: a no-op)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)
