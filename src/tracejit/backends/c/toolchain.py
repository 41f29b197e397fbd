"""Building generated C into a shared library, cached on disk by content hash.

One translation unit per compiled graph; a gcc run costs a few tenths of a second, so the library
is kept under `$TRACEJIT_CACHE_DIR/c/` (default `~/.cache/tracejit/c/`) keyed by the hash of the
source, the compiler, its flags and the CPU, and a second process (or a later test) loads it
without compiling. Files are written under a temporary name and renamed, so concurrent builders
never see half a library.

Flags: `-O3 -march=native` for vectorization; `-fno-trapping-math -fno-math-errno` let the
compiler turn selects into blends and `sqrt` into an instruction (they change only assumptions
about FP exception flags and errno, and one result that render.py's `_cast` undoes: GCC's
`(float)(int)x -> truncf(x)`, -0.0 instead of +0.0); `-ffp-contract=off` keeps `a*b+c` two roundings,
as PyTorch computes it; `-fwrapv` gives integer overflow PyTorch's wrap-around meaning. No
`-ffast-math`: NaN, infinities and signed zeros behave as in eager PyTorch.

`-Wa,-muse-unaligned-vector-move` (GNU as 2.38 on, taken when the toolchain accepts it): the
assembler writes every aligned vector move (`vmovaps`, `vmovdqa*`) as its unaligned twin, which is as
fast on aligned data. GCC 12.2 with -O3 and AVX-512 (-march=native on this machine) placed a linear
chain's stack intermediate (`float t0[48]`, rows=2, widths 5-24-26-6) 16 bytes off the 32-byte
alignment its `vmovaps %ymm` accesses assume: a general-protection fault, SIGSEGV on the kernel's first
call (the test_linear_chain.py fuzz crash). Unaligned moves cannot fault on alignment, whatever the
compiler assumed about a stack slot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...record.source import warn_at_user_line

FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-ffp-contract=off", "-fwrapv",
         "-fPIC", "-shared", "-std=gnu11", "-w")
OPENMP = "-fopenmp"
# no alignment faults from a compiler's wrong alignment assumption (see above); optional: clang's
# integrated assembler and older GNU as reject it
UNALIGNED_MOVES = "-Wa,-muse-unaligned-vector-move"


class CompilerUnavailable(RuntimeError):
    """No working C compiler: fused CPU kernels fall back to aten."""


def cache_dir() -> Path:
    root = os.environ.get("TRACEJIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tracejit")
    return Path(root) / "c"


@functools.cache
def compiler() -> tuple[str, str, tuple[str, ...]]:
    """(path, identity, flags) of the C compiler: $CC, else cc, gcc or clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        flags = FLAGS + ((OPENMP,) if _accepts(path, (*FLAGS, OPENMP)) else ())
        flags += (UNALIGNED_MOVES,) if _accepts(path, (*flags, UNALIGNED_MOVES)) else ()
        if _accepts(path, flags):
            return path, version.splitlines()[0] if version else path, flags
    raise CompilerUnavailable(f"no working C compiler found (tried {', '.join(candidates)}); set CC to one")


def _accepts(path: str, flags: tuple[str, ...]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        Path(source).write_text("int tracejit_probe(int x) { return x + 1; }\n")
        try:
            result = subprocess.run([path, *flags, source, "-o", os.path.join(tmp, "probe.so")],
                                    capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return result.returncode == 0


# /proc/cpuinfo fields naming the CPU and its ISA extensions (x86: "model name", "flags"; Arm:
# "CPU implementer", "CPU part", "Features")
_CPU_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")


@functools.cache
def _cpu_identity() -> str:
    """-march=native makes a library CPU-specific: the CPU model *and its feature flags* are part of
    the cache key. The model name alone is not enough: a virtual machine may report a generic one
    ("AMD EPYC" for Zen 2, 3 and 4, with and without AVX-512), and a cache directory shared with or
    copied to another such host would then load libraries built for instructions it lacks (SIGILL)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name = line.split(":", 1)[0].strip()
                if name in _CPU_FIELDS:
                    found.setdefault(name, line.strip())  # the first processor's
    except OSError:
        pass
    if found:
        return "\n".join(found[name] for name in _CPU_FIELDS if name in found)
    return platform.processor() or platform.machine()


def build(source: str) -> ctypes.CDLL:
    """Compile `source` into a shared library (or reuse the cached one) and load it."""
    path, identity, flags = compiler()
    key = hashlib.sha256("\0".join((source, identity, " ".join(flags), _cpu_identity())).encode()).hexdigest()
    directory = cache_dir()
    library = directory / f"{key[:32]}.so"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            c_file = os.path.join(tmp, "kernels.c")
            Path(c_file).write_text(source)
            built = os.path.join(tmp, "kernels.so")
            result = subprocess.run([path, *flags, c_file, "-o", built, "-lm"], capture_output=True, text=True,
                                    timeout=600)
            if result.returncode != 0:
                raise RuntimeError(f"tracejit: the C compiler rejected a generated kernel (a tracejit bug):\n"
                                   f"{result.stderr[-4000:]}")
            Path(c_file).replace(directory / f"{key[:32]}.c")  # kept next to the library for debugging
            os.replace(built, library)
    return ctypes.CDLL(str(library))


_warned = False


def warn_unavailable(error: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        warn_at_user_line(f"tracejit: {error}; fused CPU kernels are disabled and groups run op by op through aten",
                          RuntimeWarning)
