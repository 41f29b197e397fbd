"""Test inputs from specs, and how far outputs are from reference outputs.

A spec fills one input: `#rand(min,max)` (uniform in [min, max); integers with `randint`;
booleans with probability 1/2), `#rand(min,max,d0,d1,...)` (the same, naming the shape, which
must be the traced one), or the path of a `.npy` file (loaded without pickle, cast within its
kind: float to float, int to int). `name:spec;name:spec` fills several inputs; a single spec
without a name fills every input (a `.npy` file only a graph with one input).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..record.record import TensorMeta
from .schema import extent, may_overlap

_RAND = re.compile(r"#rand\((.*)\)\Z")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_SEED = 0  # test inputs are the same on every dump of the same graph


def fresh_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of a test case's inputs for one run: a graph that writes into its inputs (`x.mul_(2)`)
    must not change the stored case (its reference was computed from the inputs as they are)."""
    return {name: tensor.clone() for name, tensor in inputs.items()}


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:  # cast to a real dtype it would lose its imaginary part
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _random(arguments: str, name: str, meta: TensorMeta, generator: torch.Generator) -> torch.Tensor:
    try:
        numbers = [float(a) for a in arguments.split(",")]
    except ValueError:
        raise ValueError(f"input {name!r}: expected #rand(min,max[,d0,d1,...]) with numbers, got "
                         f"#rand({arguments})") from None
    if len(numbers) < 2 or not numbers[0] < numbers[1]:
        raise ValueError(f"input {name!r}: #rand needs min < max, got #rand({arguments})")
    low, high = numbers[:2]
    if len(numbers) > 2 and tuple(numbers[2:]) != meta.shape:
        shape = [int(d) if d.is_integer() else d for d in numbers[2:]]
        raise ValueError(f"input {name!r}: #rand shape {shape} is not the traced shape {list(meta.shape)}")
    kind = _kind(meta.dtype)
    # an input traced with elements sharing memory (expanded) gets random memory in that layout:
    # its values repeat as the traced ones did, as a loaded graph needs (loaded.py)
    overlapping = may_overlap(meta.shape, meta.stride)
    shape = (extent(meta.shape, meta.stride),) if overlapping else meta.shape
    if kind == "bool":
        data = torch.rand(shape, generator=generator) < 0.5
    elif kind == "int":
        data = _random_integers(arguments, name, meta.dtype, low, high, shape, generator)
    else:
        data = torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low
        if kind == "complex":  # real and imaginary parts each uniform in [min, max)
            data = torch.complex(data, torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low)
        data = data.to(meta.dtype)
    return data.as_strided(meta.shape, meta.stride).contiguous() if overlapping else data


def _random_integers(arguments: str, name: str, dtype: torch.dtype, low: float, high: float,
                     shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """`randint(int(min), int(max))`; a spec it cannot draw from is a ValueError naming the input."""
    spec, dtype_name = f"#rand({arguments})", str(dtype).removeprefix("torch.")
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"input {name!r}: {spec} needs finite bounds for the {dtype_name} input")
    first, end = int(low), int(high)
    if not first < end:
        raise ValueError(f"input {name!r}: {spec} holds no integer for the {dtype_name} input: it draws from "
                         f"int(min) = {first} to int(max) = {end}, exclusive")
    info = torch.iinfo(dtype)
    if first < info.min or end - 1 > info.max:
        raise ValueError(f"input {name!r}: {spec} reaches outside the values of the {dtype_name} input "
                         f"({info.min} to {info.max})")
    try:
        return torch.randint(first, end, shape, generator=generator, dtype=dtype)
    except (RuntimeError, OverflowError) as error:  # any other complaint of randint's
        raise ValueError(f"input {name!r}: {spec} for the {dtype_name} input: {str(error).splitlines()[0]}") from None


def _from_array(value: Any, name: str, meta: TensorMeta, repeat: int) -> torch.Tensor:
    if isinstance(value, (np.ndarray, np.generic)):
        value = np.asarray(value)
        try:  # not np.ascontiguousarray, which makes a 0-d array 1-d
            value = torch.from_numpy(value if value.flags.c_contiguous else value.copy(order="C"))
        except TypeError:
            raise ValueError(f"input {name!r}: numpy dtype {value.dtype} has no torch counterpart") from None
    tensor = value.detach().repeat_interleave(repeat, dim=0) if repeat > 1 else value.detach()
    if _kind(tensor.dtype) != _kind(meta.dtype):
        raise ValueError(f"input {name!r}: got {str(tensor.dtype).removeprefix('torch.')} data for a "
                         f"{str(meta.dtype).removeprefix('torch.')} input")
    if tuple(tensor.shape) != meta.shape:
        hint = f" (after repeat={repeat})" if repeat > 1 else ""
        raise ValueError(f"input {name!r}: data of shape {list(tensor.shape)}{hint} for an input traced with "
                         f"shape {list(meta.shape)}")
    return tensor.to(device=meta.device, dtype=meta.dtype).contiguous()


def tensor_from_spec(spec: Any, name: str, meta: TensorMeta, repeat: int = 1,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """One input's test data from a spec string, a tensor or a numpy array."""
    if isinstance(spec, (torch.Tensor, np.ndarray, np.generic)):
        return _from_array(spec, name, meta, repeat)
    if not isinstance(spec, str):
        raise TypeError(f"input {name!r}: expected a spec string, a tensor or an array, got {type(spec).__name__}")
    spec = spec.strip()
    match = _RAND.match(spec)
    if match:
        return _random(match.group(1), name, meta, generator or torch.Generator().manual_seed(_SEED)).to(meta.device)
    if spec.endswith(".npy"):
        try:
            array = np.load(os.path.expanduser(spec), allow_pickle=False)
        except (OSError, ValueError) as error:
            raise ValueError(f"input {name!r}: cannot read {spec}: {error}") from None
        return _from_array(array, name, meta, repeat)
    raise ValueError(f"input {name!r}: unknown spec {spec!r}; expected #rand(min,max[,shape...]) or a .npy file")


def parse_case(data: Any, inputs: dict[str, TensorMeta], repeat: int = 1,
               defaults: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """One test case: input name -> tensor, from a spec string or a dict name -> spec/tensor/array."""
    generator = torch.Generator().manual_seed(_SEED)
    if isinstance(data, str):
        data = split_spec(data, list(inputs))
    if not isinstance(data, dict):
        raise TypeError(f"expected a spec string or a dict of input name -> data, got {type(data).__name__}")
    unknown = sorted(set(data) - set(inputs))
    if unknown:
        raise ValueError(f"unknown input {unknown[0]!r}; inputs: {', '.join(inputs)}")
    data = {**(defaults or {}), **data}
    missing = [name for name in inputs if name not in data]
    if missing:
        raise ValueError(f"no data for input {missing[0]!r}; give name:spec for each of {', '.join(inputs)}")
    return {name: tensor_from_spec(data[name], name, meta, repeat, generator) for name, meta in inputs.items()}


def split_spec(spec: str, names: list[str]) -> dict[str, str]:
    """`name:spec;name:spec` -> {name: spec}; a spec without names applies to every input."""
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    named = {}
    for part in parts:
        name, colon, rest = part.partition(":")
        if colon and name.strip() in names:
            named[name.strip()] = rest.strip()
        elif colon and _NAME.match(name.strip()) and not os.path.exists(part):
            raise ValueError(f"no input named {name.strip()!r} (inputs: {', '.join(names)})")
        elif len(parts) == 1 and (_RAND.match(part) or len(names) == 1):
            return {n: part for n in names}
        else:
            raise ValueError(f"cannot tell which input {part!r} is for: write name:spec (inputs: {', '.join(names)})")
    return named


def max_error(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    """The largest absolute difference over all outputs (equal infinities and NaNs count as equal)."""
    worst = 0.0
    for out, ref in zip(outputs, references):
        if out.shape != ref.shape:
            return float("inf")
        a, b = out.detach().cpu(), ref.detach().cpu()
        if a.is_complex() or b.is_complex():  # both parts count: the largest difference in either
            a = torch.view_as_real(a.resolve_conj().resolve_neg().to(torch.complex128))
            b = torch.view_as_real(b.resolve_conj().resolve_neg().to(torch.complex128))
        a, b = a.double(), b.double()
        same = (a == b) | (a.isnan() & b.isnan())
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
        if diff.numel():
            worst = max(worst, float(diff.max().nan_to_num(nan=float("inf"))))
    return worst


@dataclass
class CaseResult:
    index: int
    max_error: float | None  # None: the case has no reference outputs (dumped with no_assert=True)
    maxerr: float
    seconds: float

    @property
    def passed(self) -> bool:
        return self.max_error is None or self.max_error <= self.maxerr
