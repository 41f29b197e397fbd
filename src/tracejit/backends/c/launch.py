"""Python launchers of compiled C kernels: generated code, one small function per kernel.

A launcher has the kernel calling convention of backends/kernels.py, `kernel(inputs, s, outs=None)`:
it checks that every tensor it addresses has the strides the kernel was specialized for (a
different layout runs the group through aten instead), allocates the outputs the caller did not
hand in, and calls the C function through ctypes on `data_ptr()`s and the dynamic scalars.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from ..launcher import prologue, returned
from ..lower import KernelSpec
from .render import multi_layout, single_parameters

_SCALAR_CTYPES = {float: ctypes.c_double, int: ctypes.c_int64}


def make_launcher(spec: KernelSpec, function: Any, fallback: Callable, name: str) -> Callable:
    namespace: dict[str, Any] = {"FALLBACK": fallback, "EMPTY": torch.empty_strided}
    if len(spec.lanes) == 1:
        # a row kernel returns nonzero when a row broke a check (a target out of range): aten then
        # runs the group and raises eager's error
        function.restype = ctypes.c_int64 if spec.row is not None else None
        function.argtypes = [_SCALAR_CTYPES[spec.scalar_types[i]] if kind == "scalar" else ctypes.c_void_p
                             for kind, i in single_parameters(spec)]
        call = _single_call(spec)
    else:
        function.restype = None
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        call = _multi_call(spec, namespace)
    namespace["FN"] = function
    lines = [f"def {name}(inputs, s, outs=None):"]
    lines += [f"    {line}" for line in prologue(spec, namespace) + call + [returned(spec)]]
    exec(compile("\n".join(lines) + "\n", f"<tracejit C launcher {name}>", "exec"), namespace)
    launcher = namespace[name]
    launcher.spec = spec
    return launcher




def _single_call(spec: KernelSpec) -> list[str]:
    lane = spec.lanes[0]
    args = []
    for kind, index in single_parameters(spec):
        if kind == "input":
            args.append(f"x{index}.data_ptr()")
        elif kind == "target":
            args.append(f"o{index}.data_ptr()")
        else:
            args.append(f"s[{lane.scalars[index]}]")
    if spec.row is not None and spec.row.checks:
        return [f"if FN({', '.join(args)}): return FALLBACK(inputs, s, outs)"]
    return [f"FN({', '.join(args)})"]


def _multi_call(spec: KernelSpec, namespace: dict) -> list[str]:
    multi_layout(spec)  # raises for layouts the renderer cannot walk
    allocated = len(spec.allocations)
    pointers = []
    for lane in spec.lanes:
        pointers += [f"x{i}.data_ptr()" for i, _ in lane.loads]
        for target, _ in lane.stores:
            pointers.append(f"o{target}.data_ptr()" if target < allocated
                            else f"x{spec.written_inputs[target - allocated]}.data_ptr()")
    namespace["PTRS"] = ctypes.c_void_p * len(pointers)
    per_lane = max(len(spec.scalar_types), 1)
    floats = [f"s[{lane.scalars[k]}]" if t is float else "0.0" for lane in spec.lanes
              for k, t in enumerate(spec.scalar_types)] or ["0.0"]
    ints = [f"s[{lane.scalars[k]}]" if t is int else "0" for lane in spec.lanes
            for k, t in enumerate(spec.scalar_types)] or ["0"]
    namespace["DOUBLES"] = ctypes.c_double * max(len(floats), per_lane)
    namespace["INTS"] = ctypes.c_int64 * max(len(ints), per_lane)
    return [f"FN(PTRS({', '.join(pointers)}), DOUBLES({', '.join(floats)}), INTS({', '.join(ints)}))"]
