"""The pure layers (schedule, sim, and the show/simulate CLI) never import torch; the public
names mean one thing whatever the import order."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent(
    """
    import contextlib, io, sys
    import meshpipe, meshpipe.schedule, meshpipe.sim
    from meshpipe.sim import Cost, render_ascii, simulate
    from meshpipe.sim.meshes import stage_mesh_cost
    s = meshpipe.get_schedule("1f1b", num_ranks=4, num_microbatches=8)
    t = meshpipe.simulate(s, meshpipe.Cost(f=1.0, b=2.0))
    assert render_ascii(simulate(s, Cost(f=1, b=2)))
    assert t.makespan == 33
    assert meshpipe.stage_mesh_cost is stage_mesh_cost
    assert stage_mesh_cost(Cost(f=1, b=2), s, [{"dp": 2}, {}, {"tp": 2}, {}]).f == (0.5, 1, 0.5, 1)
    from meshpipe.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["show", "1f1b", "--ranks", "2", "--microbatches", "4"]) == 0
        assert main(["simulate", "gpipe", "--ranks", "2", "--microbatches", "4"]) == 0
        assert main(["compare", "1f1b", "gpipe", "--ranks", "2", "--microbatches", "4"]) == 0
        assert main(["simulate", "1f1b", "--ranks", "2", "--microbatches", "4",
                     "--stage-meshes", "dp=2;tp=2", "--mesh-efficiency", "0.8"]) == 0
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print("TORCH:", loaded)
    """
)


def test_pure_layers_do_not_import_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "TORCH: []" in proc.stdout, proc.stdout


def test_torch_older_than_tested_is_warned_about_once() -> None:
    import warnings

    import pytest

    from meshpipe.runtime.mesh.compat import TESTED_TORCH, check_torch_version

    assert TESTED_TORCH[0] == (2, 11)
    with pytest.warns(RuntimeWarning, match=r"tested on torch 2\.11 .*this is torch 2\.6\.0"):
        assert check_torch_version("2.6.0+cu124") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tested versions, and the second call: no warning
        assert check_torch_version("2.6.0+cu124") is False
        assert check_torch_version("2.11.0+cu130") is True
        assert check_torch_version("2.13.0+cpu") is True
        assert check_torch_version("3.0.0a0") is True


SPLIT_ORDERS = {
    # meshpipe.split first: the lazy attribute; then a Pipeline's import loads
    # meshpipe.split.whole, and the package is imported by name
    "attribute_first": """
        import types
        import meshpipe
        s = meshpipe.split
        assert isinstance(s, types.ModuleType), type(s)
        meshpipe.Pipeline
        assert meshpipe.split is s
        import meshpipe.split
        assert meshpipe.split is s
        from meshpipe import split
        assert split is s
    """,
    # the package imported first (as meshpipe.runtime does), then the attribute
    "import_first": """
        import types
        import meshpipe.split
        import meshpipe
        s = meshpipe.split
        assert isinstance(s, types.ModuleType), type(s)
        from meshpipe import split
        assert split is s
    """,
}

SPLIT_USE = """
    import torch
    from torch import nn
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    stages = meshpipe.split(net, points=["2"])
    assert len(stages) == 2
    x = torch.randn(3, 4)
    assert torch.equal(meshpipe.split.run_stages(stages, x), net(x))
    assert meshpipe.split.split is meshpipe.split.api.split
    assert "split" in meshpipe.__all__ and "split" in dir(meshpipe)
    print("SPLIT OK")
"""


@pytest.mark.parametrize("order", sorted(SPLIT_ORDERS))
def test_meshpipe_split_is_the_callable_package_in_any_import_order(order: str) -> None:
    """``meshpipe.split`` is one object whatever came first: callable as the function and
    holding the package's names (``meshpipe.split.run_stages``)."""
    code = textwrap.dedent(SPLIT_ORDERS[order]) + textwrap.dedent(SPLIT_USE)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "SPLIT OK" in proc.stdout
