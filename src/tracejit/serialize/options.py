"""The options of `traced.dump()`, validated before anything is computed. docs/format.md gives
each one's meaning."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

FLOAT16_MAXERR_EPS = 8  # default maxerr of a float16 dump, in float16 epsilons of its outputs' scale
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}\Z")  # no '=' ':' ';': names appear in input specs


@dataclass(frozen=True)
class DumpOptions:
    arg_names: Sequence[str] | None = None
    output_names: Sequence[str] | None = None
    append: bool = False
    keep_var_name: int = 1
    keep_opr_name: bool = False
    keep_param_name: bool = False
    optimize_for_inference: bool = True
    user_info: Any = None
    enable_metadata: bool = True
    input_data: Any = None
    repeat: int = 1
    no_assert: bool = False
    maxerr: float | None = None  # None: default_maxerr() of the dump's precision and reference outputs
    enable_io16xc32: bool = False
    enable_ioc16: bool = False

    def __post_init__(self) -> None:
        for name in ("append", "keep_opr_name", "keep_param_name", "optimize_for_inference", "enable_metadata",
                     "no_assert", "enable_io16xc32", "enable_ioc16"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"dump(): {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("arg_names", "output_names"):
            _check_names(name, getattr(self, name))
        if isinstance(self.keep_var_name, bool):  # MegEngine code passes True/False for 1/0
            object.__setattr__(self, "keep_var_name", int(self.keep_var_name))
        if self.keep_var_name not in (0, 1, 2):
            raise ValueError(f"dump(): keep_var_name must be 0, 1 or 2 (or False, True), got {self.keep_var_name!r}")
        if self.keep_var_name == 0 and self.output_names is not None:
            raise ValueError("dump(): keep_var_name=0 drops output names, so output_names would be lost; "
                             "use keep_var_name=1 or leave output_names out")
        if not isinstance(self.repeat, int) or isinstance(self.repeat, bool) or self.repeat < 1:
            raise ValueError(f"dump(): repeat must be an int >= 1, got {self.repeat!r}")
        if self.maxerr is not None and (not isinstance(self.maxerr, (int, float)) or isinstance(self.maxerr, bool)
                                        or not 0 <= self.maxerr < math.inf):
            raise ValueError(f"dump(): maxerr must be a finite number >= 0, got {self.maxerr!r}")
        if self.enable_io16xc32 and self.enable_ioc16:
            raise ValueError("dump(): enable_io16xc32 and enable_ioc16 exclude each other (float32 or float16 "
                             "computation); pick one")
        if (self.no_assert or self.repeat != 1) and self.input_data is None:
            which = "no_assert" if self.no_assert else "repeat"
            raise ValueError(f"dump(): {which} applies to the test cases of input_data, which was not given")
        try:
            json.dumps(self.user_info, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"dump(): user_info must be JSON-compatible (dict, list, str, int, finite float, bool, "
                            f"None): {error}") from None

    def default_maxerr(self, references: list | None) -> float:
        """The test cases' maxerr when none is given: 1e-4 for a graph dumped as traced. A float16 dump
        rounds its inputs, weights and results to float16, whose steps near 1.0 (eps, ~1e-3) are
        larger than that: there it is FLOAT16_MAXERR_EPS epsilons of float16, relative to the largest
        reference output (at least 1)."""
        if not (self.enable_io16xc32 or self.enable_ioc16):
            return 1e-4
        scale = max([1.0] + [float(r.detach().abs().double().nan_to_num(0, 0, 0).max()) for r in references or []
                             if r.numel() and (r.dtype.is_floating_point or r.dtype.is_complex)])
        return FLOAT16_MAXERR_EPS * torch.finfo(torch.float16).eps * scale


def _check_names(option: str, names: Any) -> None:
    if names is None:
        return
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"dump(): {option} must be a list of names, got {type(names).__name__}")
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"dump(): {option}: {name!r} is not a valid name (letters, digits, '_' and '.', "
                             f"not starting with a digit)")
    if len(set(names)) != len(names):
        raise ValueError(f"dump(): {option} must be distinct, got {list(names)}")
