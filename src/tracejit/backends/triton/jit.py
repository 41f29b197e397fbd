"""Rendered source -> a Triton kernel object, for the GPU or for Triton's interpreter.

The generated source is executed as a module of its own, registered with `linecache` so that
Triton (which reads a kernel's source through `inspect`) finds it. The names a kernel uses besides
`tl` are bound per mode: on the GPU `libdevice` is CUDA's libdevice and the half-type conversions
(`f32_to_bf16`, `bf16_to_f32`, `f32_to_f16`, `f16_to_f32`) are one-instruction casts; under
`TRITON_INTERPRET=1` they are the stand-ins of `interpret.py`, because the interpreter cannot call
libdevice, nor tl.max/tl.min/tl.sum once triton was imported without it (`row_max`, `row_min`,
`row_sum` of row kernels), and mishandles bfloat16 (it truncates instead of rounding, and loses subnormals).
The source text is the same in both modes: what the interpreter proves is what the GPU compiles.

Kernel objects are cached by (source, mode); Triton compiles a kernel lazily on its first launch
and keeps the binary (in memory and in its on-disk cache), so identical groups of different traces
share one compilation.
"""

from __future__ import annotations

import linecache
import threading

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def _f32_to_bf16(x):
    return x.to(tl.bfloat16)


def _f32_to_f16(x):
    return x.to(tl.float16)


def _half_to_f32(x):
    return x.to(tl.float32)


def _row_max(x):
    return tl.max(x, 0)


def _row_min(x):
    return tl.min(x, 0)


def _row_sum(x):
    return tl.sum(x, 0)


_GPU_NAMES = {
    "row_max": JITFunction(_row_max),
    "row_min": JITFunction(_row_min),
    "row_sum": JITFunction(_row_sum),
    "libdevice": libdevice,
    "f32_to_bf16": JITFunction(_f32_to_bf16),
    "f32_to_f16": JITFunction(_f32_to_f16),
    "bf16_to_f32": JITFunction(_half_to_f32),
    "f16_to_f32": JITFunction(_half_to_f32),
}
_CONSTANTS = {"INF": tl.constexpr(float("inf")), "NAN": tl.constexpr(float("nan"))}
_CACHE: dict[tuple[str, bool], object] = {}
_LOCK = threading.Lock()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1), read when asked."""
    return bool(triton.knobs.runtime.interpret)


class _Jit:
    """Stands for `triton` in a kernel's module: `@triton.jit(...)` builds the kernel of our mode."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def jit(self, fn=None, **options):
        def build(function):
            if self.interpret:
                kernel = InterpretedFunction(function, **options)
                kernel.rewrite()  # reads the source now, while linecache surely holds it
                return kernel
            return JITFunction(function, **options)
        return build(fn) if fn is not None else build


def kernel_function(name: str, source: str, interpret: bool):
    """The Triton kernel `name` defined by `source`, built once per (source, mode)."""
    key = (source, interpret)
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            found = _CACHE[key] = _execute(name, source, interpret)
    return found


def _execute(name: str, source: str, interpret: bool):
    filename = f"<tracejit triton {name}{' interpreted' if interpret else ''}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": f"tracejit_triton_{name}", "tl": tl, "triton": _Jit(interpret), **_CONSTANTS}
    if interpret:
        from .interpret import INTERPRETER_NAMES

        namespace.update(INTERPRETER_NAMES)
    else:
        namespace.update(_GPU_NAMES)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]
