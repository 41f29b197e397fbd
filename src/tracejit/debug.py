"""Debugging switches read from the environment, at the edge: passes and backends take plain values.

- `TRACEJIT_FUSION_FUEL=n`: form at most n fused groups per graph, to bisect a suspected
  miscompile (n=0 turns fusion off while keeping everything else).
- `TRACEJIT_DUMP_DIR=path`: write every compiled graph after each pass and every kernel source,
  as `path/<function>/<n>_<program>/<k>_<pass>.py` and `.../kernels/<kernel>.<ext>`.
- `TRACEJIT_VERIFY=1`: check every compiled graph after each pass (ir/verify.py); a broken graph
  raises GraphVerificationError naming the pass. The test suite sets it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

_compilations = itertools.count()


def fusion_fuel() -> int | None:
    value = os.environ.get("TRACEJIT_FUSION_FUEL")
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"TRACEJIT_FUSION_FUEL must be an integer, got {value!r}") from None


def bucket_bytes() -> int:
    """TRACEJIT_BUCKET_MB: the size of the all-reduce buckets (passes/bucket_collectives.py), in
    MiB; 0 turns bucketing off. Default 25, as DDP's."""
    value = os.environ.get("TRACEJIT_BUCKET_MB")
    if value is None or value == "":
        return 25 * 2**20
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"TRACEJIT_BUCKET_MB must be a number of MiB (0: no bucketing), got {value!r}") from None
    return int(megabytes * 2**20)


def collective_spin_seconds() -> float:
    """TRACEJIT_DIST_SPIN_MS: how long a wait for a collective over host tensors polls before it
    blocks (record/ranks.py), in milliseconds; 0 turns polling off. Default 5."""
    value = os.environ.get("TRACEJIT_DIST_SPIN_MS")
    if value is None or value == "":
        return 0.005
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if not milliseconds >= 0:
        raise ValueError(f"TRACEJIT_DIST_SPIN_MS must be a number of milliseconds >= 0 (0: no polling), "
                         f"got {value!r}")
    return milliseconds / 1000


def verify_passes() -> bool:
    value = os.environ.get("TRACEJIT_VERIFY", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"TRACEJIT_VERIFY must be 0 or 1, got {value!r}")
    return value == "1"


def dump_compilation(function_name: str, program: str, history: list, kernels: dict[Any, Any]) -> Path | None:
    """Write the graphs and kernel sources of one compilation when TRACEJIT_DUMP_DIR is set."""
    root = os.environ.get("TRACEJIT_DUMP_DIR")
    if not root:
        return None
    directory = Path(root) / function_name / f"{next(_compilations):03d}_{program}"
    (directory / "kernels").mkdir(parents=True, exist_ok=True)
    for k, (name, graph, *_rest) in enumerate(history):
        (directory / f"{k:02d}_{name}.py").write_text(str(graph) + "\n")
    for kernel in kernels.values():
        source = getattr(kernel, "source", None)
        if source:
            suffix = ".py" if "@triton.jit" in source else ".c"
            (directory / "kernels" / f"{kernel.__name__}{suffix}").write_text(source)
    return directory
