"""What one host-free step runs, per system: ops dispatched, fused kernels, views made once.

    python benchmarks/kernels.py                         # transformer_train and cnn_train
    python benchmarks/kernels.py --only mlp_train_small  # other rows

Counts come from the program each `without_host` system serves after a few calls: `aten ops` are
the CALL nodes a call dispatches (views of external tensors hoisted out of the call and views made
once when the program is built are counted apart), `kernels` the fused groups (elementwise groups
and row kernels), `row kernels` those of `jit_fuse_reduce`.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import protocol, systems, workloads
from tracejit.ir import Op

SYSTEMS = ("tj-host-free", "tj-c", "tj-c-reduce", "tj-c-graph-opt")


def step_counts(system: systems.System, workload: workloads.Workload, calls: int = 4) -> dict[str, int]:
    case = workload.build()
    call = system.prepare(workload, case)
    for _ in range(calls):
        call()
    traced = next(c.cell_contents for c in call.__closure__ if hasattr(c.cell_contents, "_entries"))
    graph = traced._entries()[0].serving_program.graph
    nodes = [n for n in graph.nodes if n.op in (Op.CALL, Op.FUSED)]
    fused = [n for n in nodes if n.op is Op.FUSED]
    return {
        "nodes run per call": sum(not n.hoisted and not n.static_view for n in nodes),
        "aten ops": sum(n.op is Op.CALL and not n.hoisted and not n.static_view for n in nodes),
        "kernels": len(fused),
        "row kernels": sum(n.name.startswith("row") for n in fused),
        "views made once": sum(n.static_view for n in nodes),
        "hoisted views": sum(n.hoisted for n in nodes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="transformer_train,cnn_train")
    args = parser.parse_args(argv)
    protocol.configure_threads()
    torch.manual_seed(0)
    for workload in workloads.select(args.only):
        print(f"### {workload.name}\n")
        rows = [(key, step_counts(systems.SYSTEMS[key], workload)) for key in SYSTEMS]
        columns = list(rows[0][1])
        print("| system | " + " | ".join(columns) + " |")
        print("|---|" + "---:|" * len(columns))
        for key, counts in rows:
            print(f"| {systems.SYSTEMS[key].label} | " + " | ".join(str(counts[c]) for c in columns) + " |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
