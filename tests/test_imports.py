"""The pure layers (schedule, sim, and the show/simulate CLI) never import torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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

    from meshpipe.runtime.compat import TESTED_TORCH, check_torch_version

    assert TESTED_TORCH[0] == (2, 11)
    with pytest.warns(RuntimeWarning, match=r"tested on torch 2\.11 .*this is torch 2\.6\.0"):
        assert check_torch_version("2.6.0+cu124") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tested versions, and the second call: no warning
        assert check_torch_version("2.6.0+cu124") is False
        assert check_torch_version("2.11.0+cu130") is True
        assert check_torch_version("2.13.0+cpu") is True
        assert check_torch_version("3.0.0a0") is True
