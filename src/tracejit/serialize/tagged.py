"""Op arguments as JSON, each non-JSON value in an explicit tagged form, and back.

An op's `statics` (see record/record.py) mix plain Python values with sentinels (`TENSOR`,
`ScalarSlot`, `KwargStatic`) and torch objects (dtypes, devices, layouts, memory formats).
JSON has no room for most of them, and a loader must never guess, so every value that is not
an int, a finite float, a bool, a string or None is written as an object with a `"$"` tag:

    {"$": "tensor"}                         the next tensor input
    {"$": "scalar", "type": "float"}        the next dynamic scalar (a float or an int)
    {"$": "kwarg", "name": "dim", "value": 1}
    {"$": "list", "items": [...]}           a tuple or list of arguments
    {"$": "float", "value": "inf"}          inf, -inf, nan
    {"$": "dtype", "name": "float32"}
    {"$": "device", "type": "cpu", "index": null}
    {"$": "layout", "name": "strided"}
    {"$": "memory_format", "name": "channels_last"}

Decoding accepts exactly these forms (known names only) and raises `TaggedValueError` for
anything else; nothing in a file is ever evaluated or imported.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..record.record import TENSOR, KwargStatic, ScalarSlot

MAX_DEPTH = 8  # op arguments nest lists at most a level or two deep

# Every dtype torch and safetensors (the weights) share, and complex128, which only values between
# ops can have (safetensors has no 128-bit complex: see WEIGHT_DTYPES).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8",
                 "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
                 "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
}
WEIGHT_DTYPES = frozenset(dtype for dtype in DTYPES.values() if dtype is not torch.complex128)
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {name: getattr(torch, name)
                  for name in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")}
DEVICE_TYPES = ("cpu", "cuda")
SCALAR_TYPES = {"float": float, "int": int}


class TaggedValueError(ValueError):
    """A value that has no tagged form (dump) or a malformed tagged form (load)."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise TaggedValueError(f"dtype {dtype} has no portable form (supported: {', '.join(DTYPES)})")
    return name


def parse_dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise TaggedValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def device_form(device: torch.device) -> dict:
    if device.type not in DEVICE_TYPES:
        raise TaggedValueError(f"device {device} has no portable form (supported: {', '.join(DEVICE_TYPES)})")
    return {"$": "device", "type": device.type, "index": device.index}


def parse_device(form: Any) -> torch.device:
    if not isinstance(form, dict) or form.keys() != {"$", "type", "index"} or form["$"] != "device":
        raise TaggedValueError(f"malformed device {_short(form)}")
    kind, index = form["type"], form["index"]
    if kind not in DEVICE_TYPES or not (index is None or (_is_int(index) and 0 <= index < 64)):
        raise TaggedValueError(f"unknown device {_short(form)} (device types: {', '.join(DEVICE_TYPES)})")
    return torch.device(kind, index) if index is not None else torch.device(kind)


# -- encoding -----------------------------------------------------------------------------------


def encode_statics(statics: tuple) -> list:
    return [encode_value(item) for item in statics]


def encode_value(value: Any) -> Any:
    if value is TENSOR:
        return {"$": "tensor"}
    if isinstance(value, ScalarSlot):
        if value.type not in SCALAR_TYPES.values():
            raise TaggedValueError(f"a dynamic scalar of type {value.type.__name__} has no portable form")
        return {"$": "scalar", "type": value.type.__name__}
    if isinstance(value, KwargStatic):
        return {"$": "kwarg", "name": value.name, "value": encode_value(value.value)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return encode_number(value)
    if isinstance(value, (tuple, list)):
        return {"$": "list", "items": [encode_value(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"$": "dtype", "name": dtype_name(value)}
    if isinstance(value, torch.device):
        return device_form(value)
    if isinstance(value, torch.layout):
        return {"$": "layout", "name": _known_name(value, LAYOUTS, "layout")}
    if isinstance(value, torch.memory_format):
        return {"$": "memory_format", "name": _known_name(value, MEMORY_FORMATS, "memory format")}
    raise TaggedValueError(f"an argument of type {type(value).__name__} ({_short(value)}) has no portable form")


def encode_number(value: float) -> Any:
    if isinstance(value, int) or math.isfinite(value):
        return value
    return {"$": "float", "value": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _known_name(value: Any, table: dict[str, Any], what: str) -> str:
    for name, known in table.items():
        if known is value:
            return name
    raise TaggedValueError(f"{what} {value} has no portable form (supported: {', '.join(table)})")


# -- decoding -----------------------------------------------------------------------------------


def decode_statics(forms: Any) -> tuple:
    if not isinstance(forms, list):
        raise TaggedValueError(f"op arguments must be a list, got {_short(forms)}")
    statics = []
    for form in forms:
        if isinstance(form, dict) and form.get("$") == "kwarg":
            if form.keys() != {"$", "name", "value"} or not isinstance(form["name"], str):
                raise TaggedValueError(f"malformed keyword argument {_short(form)}")
            statics.append(KwargStatic(form["name"], decode_value(form["value"], 1)))
        else:
            statics.append(decode_value(form, 0))
    return tuple(statics)


def decode_value(form: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise TaggedValueError(f"op arguments nest deeper than {MAX_DEPTH} levels")
    if form is None or isinstance(form, (bool, str)):
        return form
    if _is_int(form):
        return form
    if isinstance(form, float):
        return form
    if not isinstance(form, dict) or not isinstance(form.get("$"), str):
        raise TaggedValueError(f"untagged value {_short(form)}")
    tag = form["$"]
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise TaggedValueError(f"unknown tag {tag!r} in {_short(form)}")
    return decoder(form, depth)


def decode_number(form: Any) -> int | float:
    if isinstance(form, (int, float)):  # bools included: they are ints
        return form
    if isinstance(form, dict) and form.get("$") == "float":
        return _decode_float(form, 0)
    raise TaggedValueError(f"expected a number, got {_short(form)}")


def _decode_list(form: dict, depth: int) -> tuple:
    _expect_keys(form, {"$", "items"})
    if not isinstance(form["items"], list):
        raise TaggedValueError(f"malformed list {_short(form)}")
    return tuple(decode_value(item, depth + 1) for item in form["items"])


def _decode_float(form: dict, depth: int) -> float:
    _expect_keys(form, {"$", "value"})
    if form["value"] not in ("inf", "-inf", "nan"):
        raise TaggedValueError(f"malformed float {_short(form)}")
    return float(form["value"])


def _decode_scalar(form: dict, depth: int) -> ScalarSlot:
    _expect_keys(form, {"$", "type"})
    if form["type"] not in SCALAR_TYPES:
        raise TaggedValueError(f"unknown scalar type in {_short(form)}")
    return ScalarSlot(SCALAR_TYPES[form["type"]])


def _decode_tensor(form: dict, depth: int) -> Any:
    _expect_keys(form, {"$"})
    return TENSOR


def _decode_named(table: dict[str, Any], what: str):
    def decode(form: dict, depth: int) -> Any:
        _expect_keys(form, {"$", "name"})
        if not isinstance(form["name"], str) or form["name"] not in table:
            raise TaggedValueError(f"unknown {what} {_short(form['name'])} (known: {', '.join(table)})")
        return table[form["name"]]

    return decode


def _decode_kwarg_misplaced(form: dict, depth: int) -> Any:
    raise TaggedValueError("a keyword argument may only appear at the top level of an op's arguments")


_DECODERS = {
    "tensor": _decode_tensor,
    "scalar": _decode_scalar,
    "list": _decode_list,
    "float": _decode_float,
    "dtype": _decode_named(DTYPES, "dtype"),
    "layout": _decode_named(LAYOUTS, "layout"),
    "memory_format": _decode_named(MEMORY_FORMATS, "memory format"),
    "device": lambda form, depth: parse_device(form),
    "kwarg": _decode_kwarg_misplaced,
}


def _expect_keys(form: dict, keys: set[str]) -> None:
    if form.keys() != keys:
        raise TaggedValueError(f"malformed {form.get('$')!r} value {_short(form)}: expected keys {sorted(keys)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
