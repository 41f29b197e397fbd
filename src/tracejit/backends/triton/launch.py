"""Python launchers of Triton kernels: generated code, one small function per kernel.

A launcher has the kernel calling convention of backends/kernels.py, `kernel(inputs, s, outs=None)`,
like the C launchers: it checks that every tensor it addresses has the strides the kernel was
specialized for (a different layout runs the group through aten instead), allocates the outputs
the caller did not hand in, and launches the kernel on the tensors and the dynamic scalars.

A multi-lane kernel reads its pointers and scalars from a per-call int64 table (pointers and int
scalars, then float scalars as float64 bits: `array` packs both without a Python loop per value),
copied to the device in one transfer when it changed (`LaneTable`), and its static (lane, start,
end) work table, made once.

On a CUDA device the launch runs under that device (Triton launches on the current one), and a
kernel Triton fails to build for that GPU sends its group to aten, with one warning.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...record.source import warn_at_user_line
from ..launcher import prologue, returned
from ..lower import KernelSpec
from .render import OPTIONS, TritonKernel


def make_launcher(spec: KernelSpec, kernel: TritonKernel, function: Any, fallback: Callable,
                  interpret: bool) -> Callable:
    from .jit import kernel_function

    namespace: dict[str, Any] = {"FALLBACK": fallback, "EMPTY": torch.empty_strided, "BROKEN": False}
    launch = _launch_lines(spec, kernel, function, namespace,
                           lambda k: kernel_function(k.name, k.source, interpret))
    if launch and spec.device.type == "cuda":
        namespace["DEVICE"] = torch.cuda.device(spec.device)
        launch = ["with DEVICE:", *(f"    {line}" for line in launch)]
    if launch and interpret:
        # the interpreter computes with numpy, which warns where IEEE arithmetic quietly gives inf or NaN
        namespace["QUIET"] = np.errstate
        launch = ["with QUIET(all='ignore'):", *(f"    {line}" for line in launch)]
    elif launch:
        launch = _give_up_on_build_errors(kernel, namespace, launch)
    lines = [f"def {kernel.name}(inputs, s, outs=None):"]
    if not interpret:
        lines.append("    if BROKEN: return FALLBACK(inputs, s, outs)")
    lines += [f"    {line}" for line in prologue(spec, namespace) + launch + [returned(spec)]]
    exec(compile("\n".join(lines) + "\n", f"<tracejit triton launcher {kernel.name}>", "exec"), namespace)
    launcher = namespace[kernel.name]
    launcher.spec = spec
    launcher.kernel = kernel
    launcher.source = kernel.source
    return launcher


def _give_up_on_build_errors(kernel: TritonKernel, namespace: dict, launch: list[str]) -> list[str]:
    """A kernel Triton cannot build for this GPU (the first launch compiles it) warns once, and its
    group runs through aten from then on. The interpreter builds nothing: its errors are real."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    def give_up(error: Exception, inputs, s, outs):
        warn_at_user_line(f"tracejit: Triton could not build kernel {kernel.name} for this GPU "
                          f"({type(error).__name__}: {error}); its group runs through aten", UserWarning)
        namespace["BROKEN"] = True
        return namespace["FALLBACK"](inputs, s, outs)

    namespace.update(BUILD_ERRORS=(CompilationError, OutOfResources, PTXASError), GIVE_UP=give_up)
    return ["try:", *(f"    {line}" for line in launch),
            "except BUILD_ERRORS as error:", "    return GIVE_UP(error, inputs, s, outs)"]




def _launch_lines(spec: KernelSpec, kernel: TritonKernel, function: Any, namespace: dict,
                  combine_function: Callable = lambda kernel: None) -> list[str]:
    if kernel.grid == 0:
        return []  # nothing to compute: every lane is empty
    namespace["KERNEL"] = function[(kernel.grid,)]
    options = ", ".join(f"{k}={v!r}" for k, v in {"num_warps": kernel.num_warps, **OPTIONS}.items())
    if kernel.work:
        return [*_table_lines(spec, kernel, namespace), f"KERNEL(WORK, table, {options})"]
    lane = spec.lanes[0]
    args = []
    for kind, index in kernel.parameters:
        if kind == "input":
            args.append(f"x{index}")
        elif kind == "target":
            args.append(f"o{index}")
        elif kind == "scratch":
            args.append("part")
        else:
            convert = "float" if spec.scalar_types[index] is float else "int"
            args.append(f"{convert}(s[{lane.scalars[index]}])")
    if kernel.combine is None:
        return [f"KERNEL({', '.join(args)}, {options})"]
    # a row kernel summing over all rows: chunk partials into a scratch buffer, then their sum
    namespace["COMBINE"] = combine_function(kernel.combine)[(1,)]
    namespace["PART"] = (kernel.scratch[0],), kernel.scratch[1], spec.device
    return ["part = EMPTY(PART[0], (1,), dtype=PART[1], device=PART[2])",
            f"KERNEL({', '.join(args)}, {options})", f"COMBINE({', '.join(args)}, {options})"]


def _table_lines(spec: KernelSpec, kernel: TritonKernel, namespace: dict) -> list[str]:
    """Build the per-call table: every lane's pointers and int scalars, then its float scalars."""
    work = [value for item in kernel.work for value in item]
    namespace["WORK"] = torch.tensor(work, dtype=torch.int64, device=spec.device)
    namespace["INTS"] = lambda values: array.array("q", values).tobytes()
    namespace["FLOATS"] = lambda values: array.array("d", values).tobytes()
    namespace["TABLE"] = LaneTable(spec.device)
    allocated = len(spec.allocations)
    ints, floats = [], []
    for lane in spec.lanes:
        ints += [f"x{i}.data_ptr()" for i, _ in lane.loads]
        ints += [f"o{t}.data_ptr()" if t < allocated else f"x{spec.written_inputs[t - allocated]}.data_ptr()"
                 for t, _ in lane.stores]
        ints += [f"s[{lane.scalars[k]}]" for k, t in enumerate(spec.scalar_types) if t is not float]
        floats += [f"s[{lane.scalars[k]}]" for k, t in enumerate(spec.scalar_types) if t is float]
    data = f"INTS(({', '.join(ints)},))"
    if floats:
        data += f" + FLOATS(({', '.join(floats)},))"
    return [f"table = TABLE({data})"]


class LaneTable:
    """The per-call table on the kernel's device. A call whose table has the same bytes as the last
    one (same tensors, same scalars: SGD at a constant learning rate) reuses it without a copy; a CUDA
    table goes through pinned memory, so the copy does not stall the host."""

    def __init__(self, device: torch.device):
        self.device = device
        self.data: bytes | None = None
        self.tensor: torch.Tensor | None = None

    def __call__(self, data: bytes) -> torch.Tensor:
        if data != self.data:
            host = torch.frombuffer(bytearray(data), dtype=torch.int64)
            if self.device.type == "cuda":
                host = host.pin_memory().to(self.device, non_blocking=True)
            self.tensor, self.data = host, data
        return self.tensor
