"""The demo's command-line options, shared by ``meshpipe demo`` and the ranks it starts.

Parsed once in the CLI (to refuse bad values before any process starts) and again on
every rank from the same arguments. Imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DemoOptions",
    "add_demo_args",
    "parse_mesh",
    "resolve",
    "to_argv",
    "DEFAULT_OUT",
    "START_ENV",
]

DEFAULT_OUT = "meshpipe-demo"
START_ENV = "MESHPIPE_DEMO_T0"  # time.time() when the user's command started
_AXES = ("pp", "dp")


@dataclass(frozen=True)
class DemoOptions:
    """Everything one demo run needs, checked: the mesh's degrees multiply to ``ranks``."""

    ranks: int
    pp: int
    dp: int
    schedule: str
    steps: int
    microbatches: int
    batch_size: int  # sequences per data-parallel replica per step
    out: str
    timeout: float
    lr: float
    seed: int
    layers: int  # 0: as many as needed, at least 4
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    share_gpu: bool = False  # cuda: several ranks on one GPU (NCCL over sockets, a trial)
    save: str | None = None  # checkpoint directory written after the last step
    resume: str | None = None  # checkpoint directory to continue from

    @property
    def mesh_text(self) -> str:
        return f"pp={self.pp},dp={self.dp}"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def add_demo_args(p: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``p``."""
    p.add_argument("--ranks", type=_positive, default=None, help="processes to start (default 4)")
    p.add_argument(
        "--mesh",
        default=None,
        help="mesh degrees, e.g. pp=2,dp=2 (default: pp=2 and dp=ranks/2, or pp=ranks)",
    )
    p.add_argument("--schedule", default="zbv", help="pipeline schedule (default zbv)")
    p.add_argument("--steps", type=_positive, default=60, help="optimizer steps (default 60)")
    p.add_argument("--microbatches", type=_positive, default=4, help="microbatches per step")
    p.add_argument(
        "--batch-size", type=_positive, default=16, help="sequences per dp replica per step"
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a rank may wait on a peer")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--layers", type=int, default=0, help="transformer blocks (default 4)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: NCCL, one GPU per rank; auto (default): cuda when there are as many GPUs "
        "as ranks, else cpu",
    )
    p.add_argument(
        "--share-gpu",
        action="store_true",
        help="with --device cuda: let several ranks share a GPU (NCCL joins them over "
        "sockets: far slower than GPU links; to try the demo on a machine with fewer GPUs "
        "than ranks, never to measure)",
    )
    p.add_argument("--save", metavar="DIR", default=None, help="save a checkpoint at the end")
    p.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="continue from a checkpoint up to --steps (any mesh; same --layers)",
    )


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=2,dp=2"`` -> ``{"pp": 2, "dp": 2}``; axes left out are 1. ValueError names the part."""
    out = {axis: 1 for axis in _AXES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in _AXES:
            raise ValueError(f"mesh part {part!r}: expected pp=N or dp=N")
        try:
            degree = int(value)
        except ValueError:
            raise ValueError(f"mesh part {part!r}: {value!r} is not a whole number") from None
        if degree < 1:
            raise ValueError(f"mesh part {part!r}: the degree must be >= 1")
        out[name] = degree
    return out


def _default_mesh(ranks: int) -> dict[str, int]:
    if ranks >= 4 and ranks % 2 == 0:
        return {"pp": 2, "dp": ranks // 2}
    return {"pp": ranks, "dp": 1}


def resolve(args: argparse.Namespace) -> DemoOptions:
    """Checked options from parsed arguments; ValueError says which value is wrong."""
    if args.mesh is None:
        ranks = 4 if args.ranks is None else args.ranks
        mesh = _default_mesh(ranks)
    else:
        mesh = parse_mesh(args.mesh)
        product = mesh["pp"] * mesh["dp"]
        ranks = product if args.ranks is None else args.ranks
        if product != ranks:
            raise ValueError(
                f"--mesh {args.mesh} needs {product} ranks but --ranks is {ranks}; the product "
                "of the degrees must equal the number of ranks"
            )
    if mesh["pp"] < 2:
        raise ValueError(f"the demo needs a pipeline: pp must be >= 2, got pp={mesh['pp']}")
    if args.batch_size < args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is smaller than --microbatches "
            f"{args.microbatches}; each microbatch needs at least one sequence"
        )
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.layers < 0:
        raise ValueError(f"--layers must be >= 0, got {args.layers}")
    share = bool(getattr(args, "share_gpu", False))
    device = _device(getattr(args, "device", "auto"), ranks, share)
    return DemoOptions(
        ranks=ranks,
        pp=mesh["pp"],
        dp=mesh["dp"],
        schedule=args.schedule.lower().strip(),
        steps=args.steps,
        microbatches=args.microbatches,
        batch_size=args.batch_size,
        out=args.out,
        timeout=float(args.timeout),
        lr=float(args.lr),
        seed=args.seed,
        layers=args.layers,
        device=device,
        share_gpu=share,
        save=args.save,
        resume=args.resume,
    )


def _device(choice: str, ranks: int, share: bool = False) -> str:
    """The device the ranks train on: NCCL needs a GPU of its own per rank (``share``: one
    GPU is enough, several ranks on it)."""
    if share and choice != "cuda":
        raise ValueError("--share-gpu goes with --device cuda")
    if choice == "cpu":
        return "cpu"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if share and gpus < 1:
        raise ValueError("--device cuda --share-gpu needs a GPU; this machine has none")
    if choice == "cuda" and gpus < ranks and not share:
        raise ValueError(
            f"--device cuda needs one GPU per rank: {ranks} ranks but {gpus} GPU(s); pass "
            f"--ranks {max(gpus, 2)} with a matching --mesh, --share-gpu (a trial, slow), "
            "or --device cpu"
        )
    return "cuda" if gpus >= ranks or share else "cpu"


def to_argv(opts: DemoOptions) -> list[str]:
    """Arguments that make every rank parse back exactly ``opts``."""
    pairs: Sequence[tuple[str, object]] = (
        ("--ranks", opts.ranks),
        ("--mesh", opts.mesh_text),
        ("--schedule", opts.schedule),
        ("--steps", opts.steps),
        ("--microbatches", opts.microbatches),
        ("--batch-size", opts.batch_size),
        ("--out", opts.out),
        ("--timeout", repr(opts.timeout)),
        ("--lr", repr(opts.lr)),
        ("--seed", opts.seed),
        ("--layers", opts.layers),
        ("--device", opts.device),
    )
    optional = [(flag, v) for flag, v in (("--save", opts.save), ("--resume", opts.resume)) if v]
    flags = ["--share-gpu"] if opts.share_gpu else []
    return [str(x) for pair in [*pairs, *optional] for x in pair] + flags
