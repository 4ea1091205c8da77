"""A job on one machine listens on loopback only: every listening TCP socket held by the
processes of a `meshpipe launch` job, or of a `run_on_ranks` call (the caller, its fork
server and its ranks), is on 127.0.0.0/8 or ::1 (torch's own store servers would listen on
every interface). Sockets are read from /proc/net/tcp{,6} (state 0A, LISTEN), matched to
the processes by the inodes of their descriptors."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from meshpipe.testing import run_on_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LAUNCH = [sys.executable, "-m", "meshpipe.cli", "launch"]

# Each rank joins the process group and a pipeline's groups, says so, and waits to be told
# to finish (bounded), so that the test sees every socket of a running job.
JOB = """
import os, sys, time
import torch
import meshpipe

mesh = meshpipe.init_mesh(pp=2)
pipe = meshpipe.Pipeline(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                         mesh, "1f1b", 2, torch.nn.functional.mse_loss)
x = torch.ones(4, 4)
pipe.step(x, target=x)
folder = sys.argv[1]
with open(os.path.join(folder, "ready-" + os.environ["RANK"]), "w") as fh:
    fh.write(os.environ["MASTER_PORT"])
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s hex address: 32-bit words, each in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(text[i : i + 8])[::-1] for i in range(0, len(text), 8))
    return ipaddress.ip_address(raw)


def _is_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
    found, todo = [root], [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parents.items() if p == pid]
        found += kids
        todo += kids
    return found


def listening(root: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``root``'s process tree."""
    owner: dict[str, int] = {}
    for pid in _tree(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:[") : -1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            rows = [line.split() for line in fh.readlines()[1:]]
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            if state == "0A" and inode in owner:
                addr, port = local.split(":")
                out.append((owner[inode], str(_address(addr)), int(port, 16)))
    return out


def _exposed(sockets: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    return [s for s in sockets if not _is_loopback(ipaddress.ip_address(s[1]))]


def test_proc_addresses_are_read_right() -> None:
    assert str(_address("0100007F")) == "127.0.0.1"
    assert str(_address("00000000000000000000000001000000")) == "::1"
    assert str(_address("00000000")) == "0.0.0.0"
    assert not _is_loopback(_address("00000000000000000000000000000000"))  # "::", everywhere
    assert _is_loopback(_address("0000000000000000FFFF00000100007F"))  # ::ffff:127.0.0.1


@pytest.mark.timeout(240)
def test_a_launched_job_listens_on_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        ready = [tmp_path / f"ready-{r}" for r in (0, 1)]
        while not all(p.exists() and p.read_text() for p in ready):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start in time"
            time.sleep(0.1)
        sockets = listening(proc.pid)
        (tmp_path / "go").write_text("")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert _exposed(sockets) == [], sockets
    store_port = int(ready[0].read_text())
    # the store the ranks met at is the launcher's own, and was seen (on loopback)
    assert (proc.pid, "127.0.0.1", store_port) in sockets, (store_port, sockets)


def _rank(caller: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import meshpipe

    mesh = meshpipe.init_mesh(pp=2)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 2, torch.nn.functional.mse_loss)
    x = torch.ones(4, 4)
    pipe.step(x, target=x)
    sockets = listening(caller) if dist.get_rank() == 0 else []
    dist.barrier()  # every rank alive while rank 0 looks
    return {"sockets": sockets, "port": int(os.environ["MASTER_PORT"])}


@pytest.mark.timeout(240)
def test_run_on_ranks_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    results = run_on_ranks(_rank, 2, os.getpid(), timeout=180)
    sockets = results[0]["sockets"]
    assert _exposed(sockets) == [], sockets
    ports = {port for _pid, _addr, port in sockets}
    assert results[0]["port"] in ports, (results[0]["port"], sockets)  # the store was seen
