"""Symbolic input sizes (`symbolic_shape`): recording with torch's ShapeEnv, and the guards it leaves.

A symbolic-shape recording hands the function *fake* inputs whose sizes are symbols
(`FakeTensorMode(shape_env=ShapeEnv())`, `from_tensor(..., symbolic_context=...)`, as
`make_fx(tracing_mode="symbolic")` does), so every size the function computes in Python
(`x.shape[0] * 2`, a `view(batch, tokens, heads, -1)`) is a `torch.SymInt`: an expression of the
input symbols, and that is what the record keeps. Whatever the recorded code relied on about the
sizes -- two sizes being equal, a size not being 0 or 1, divisibility for a view, a Python branch
on a size -- the ShapeEnv records as a guard; `ShapeGuards` checks them on a later call and binds
the symbols from its input sizes.

Sizes 0 and 1 are never symbols (torch specializes them: broadcasting differs), and two inputs of
equal size get two symbols (`duck_shape=False`): equality must come from the code, not from chance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    free_symbols,
)
from torch.utils._pytree import tree_map_only
from torch.utils._sympy.value_ranges import ValueRanges

_SYMBOLIC_NUMBERS = (torch.SymInt, torch.SymFloat, torch.SymBool)


def has_symbolic_metadata(value: Any) -> bool:
    """A fake tensor whose sizes, strides or offset involve a symbol (a real tensor never does)."""
    return isinstance(value, FakeTensor) and bool(free_symbols(value))


def is_symbolic_number(value: Any) -> bool:
    return isinstance(value, _SYMBOLIC_NUMBERS)


# No size exceeds this: a tensor's sizes are int64.
_LARGEST_SIZE = torch.iinfo(torch.int64).max
# The guard of that bound, which every tensor meets: left out of the guards (see SymbolicSizes.guards)
_SIZE_BOUND = re.compile(rf"(?:^| and )(\S+) <= {_LARGEST_SIZE}$")


class _BoundedShapeEnv(ShapeEnv):
    """A ShapeEnv whose size symbols are known to be at most INT64_MAX, as every size is.

    torch's indexing skips a slice that covers its whole dim (`pad[:, None, :]`, the `:` of
    `x[:, :2]`) when it knows `size <= stop`, and `:` stops at INT64_MAX. Eager code knows it at
    concrete sizes; with symbols unbounded above (torch's default) the recording could not and
    recorded an `aten.slice` that eager never dispatches: every checked call diverged from it."""

    def _default_value_range(self, do_not_specialize_zero_one: bool = False) -> ValueRanges:
        default = super()._default_value_range(do_not_specialize_zero_one)
        return ValueRanges(default.lower, min(default.upper, _LARGEST_SIZE))


class SymbolicSizes:
    """The ShapeEnv and fake mode of one recording, and its fake inputs.

    `dynamic` says per input which dims are symbols (positional inputs, then tensor keywords by
    name, as the input signature orders them); the others are recorded at their size.
    """

    def __init__(self) -> None:
        self.env = _BoundedShapeEnv(duck_shape=False)
        # No fallback kernels: an op without a meta implementation must fail rather than run on dummy data.
        self.mode = FakeTensorMode(shape_env=self.env, allow_fallback_kernels=False)
        self.names: list[str] = []
        self.fakes: list[FakeTensor] = []

    def fake_input(self, name: str, tensor: torch.Tensor, dynamic: tuple[bool, ...]) -> FakeTensor:
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])
        with torch._C.DisableTorchFunction():
            fake = self.mode.from_tensor(tensor, source=LocalSource(name), symbolic_context=context)
        self.names.append(name)
        self.fakes.append(fake)
        return fake

    def with_values(self, text: str) -> str:
        """`text` with each symbol of this recording replaced by the size it stands for in the call
        (torch's errors on symbolic sizes name symbols: "tensor a (s77) must match ... b (s17)")."""
        values = {str(symbol): value for symbol, value in self._values().items()}
        if not values:
            return text
        names = re.compile(r"\b(" + "|".join(sorted(map(re.escape, values), key=len, reverse=True)) + r")\b")
        return names.sub(lambda match: str(values[match.group(1)]), text)

    def _values(self) -> dict:
        known = getattr(self.env, "backed_var_to_val", None)  # torch 2.13's name; var_to_val before it
        return self.env.var_to_val if known is None else known

    def pinned_layout(self, fake: FakeTensor) -> tuple[tuple, tuple, int] | None:
        """The sizes, strides and offset of `fake` if the guards so far fix every one of them (a
        Linear's weight gradient after a flatten: `4*(s0//2)*(s53//2)` columns, which the forward's
        matmul guarded equal to 64), else None. Every call the guards admit makes it that layout."""
        values = self._values()

        def pinned(value: Any) -> int | None:
            if not isinstance(value, torch.SymInt):
                return value
            expr = value.node.expr
            now = expr.xreplace(values)
            if not now.is_Integer:  # a symbol without a value: a data-dependent size
                return None
            now = int(now)
            return now if self.env._maybe_evaluate_static(sympy.Eq(expr, now)) == sympy.true else None

        layout = [pinned(v) for v in (*fake.shape, *fake.stride(), fake.storage_offset())]
        if any(v is None for v in layout):
            return None
        rank = fake.dim()
        return tuple(layout[:rank]), tuple(layout[rank:2 * rank]), layout[-1]

    def concrete(self, tree: Any) -> Any:
        """`tree` with each symbolic number replaced by its value in this call: for a real op that
        refuses symbols (a view whose output layout the guards pin: `expand(t, [s77//2, 8])` where
        s77//2 == 1), never for the fake run, whose outputs must stay symbolic."""
        values = self._values()

        def value(number: Any) -> Any:
            now = number.node.expr.xreplace(values)
            if isinstance(number, torch.SymBool):
                return bool(now) if now in (sympy.true, sympy.false) else number
            if not now.is_number:  # a symbol without a value: leave it to torch
                return number
            return int(now) if isinstance(number, torch.SymInt) else float(now)

        return tree_map_only((torch.SymInt, torch.SymFloat, torch.SymBool), value, tree)

    def static_fake(self, tensor: torch.Tensor) -> FakeTensor:
        """A tensor from outside the inputs (a parameter, optimizer state): its sizes are fixed."""
        return self.mode.from_tensor(tensor, static_shapes=True)

    def guards(self) -> ShapeGuards:
        """What the recording relied on about the inputs' sizes, strides and offsets, and where each
        symbol comes from; call once the recording is complete."""
        sources = [LocalSource(name) for name in self.names]
        texts = [_SIZE_BOUND.sub("", text) for text in self.env.produce_guards(self.fakes, sources, ignore_static=False)]
        texts = [text for text in texts if text]
        bindings = []
        for i, fake in enumerate(self.fakes):
            for what, values in (("size", fake.shape), ("stride", fake.stride()),
                                 ("offset", (fake.storage_offset(),))):
                for dim, value in enumerate(values):
                    if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
                        bindings.append((i, what, dim, value.node.expr))
        bound: dict[sympy.Symbol, tuple] = {}
        for source in bindings:  # the first place a symbol appears binds it; the guards equate the others
            bound.setdefault(source[3], source)
        return ShapeGuards(tuple(self.names), tuple(texts), tuple(bound.values()),
                           tuple(tuple(f.shape) for f in self.fakes))


@dataclass(frozen=True)
class ShapeGuards:
    """The guards of a symbolic-shape trace over its inputs, and how its symbols are bound."""

    names: tuple[str, ...]  # the inputs, in signature order
    texts: tuple[str, ...]  # Python guard expressions over L['name'] (torch's produce_guards)
    sources: tuple[tuple[int, str, int, sympy.Symbol], ...]  # (input, size|stride|offset, dim, symbol)
    shapes: tuple[tuple, ...]  # the inputs' symbolic shapes, for messages

    def __post_init__(self) -> None:
        code = compile(" and ".join(f"({t})" for t in self.texts) or "True", "<tracejit shape guards>", "eval")
        object.__setattr__(self, "_code", code)

    def hold(self, tensors: list[torch.Tensor]) -> bool:
        if len(tensors) != len(self.names):
            return False
        return bool(eval(self._code, SYMPY_INTERP, {"L": dict(zip(self.names, tensors))}))

    def broken(self, tensors: list[torch.Tensor]) -> list[str]:
        """Each guard these inputs break, readably, with the sizes that break it."""
        scope = {"L": dict(zip(self.names, tensors))}
        lines = []
        for text in self.texts:
            if not eval(text, SYMPY_INTERP, scope):
                used = [i for i, name in enumerate(self.names) if f"L['{name}']" in text]
                sizes = ", ".join(f"{self.names[i]} {list(tensors[i].shape)}" for i in used)
                lines.append(f"{readable(text)} (with {sizes})")
        return lines

    def binding(self, tensors: list[torch.Tensor]) -> dict[sympy.Symbol, int]:
        """The value of every symbol for these inputs (which satisfy the guards)."""
        values = {}
        for i, what, dim, symbol in self.sources:
            tensor = tensors[i]
            value = (tensor.shape[dim] if what == "size" else tensor.stride(dim) if what == "stride"
                     else tensor.storage_offset())
            values[symbol] = value
        return values

    def describe(self) -> str:
        shapes = ", ".join(f"{name}: {_shape_text(shape)}" for name, shape in zip(self.names, self.shapes))
        return f"({shapes})"


def readable(guard: str) -> str:
    """`L['x'].size()[0] == L['y'].size()[0]` -> `x.size()[0] == y.size()[0]`."""
    return guard.replace("L['", "").replace("']", "")


def _shape_text(shape: tuple) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def tensor_inputs(args: tuple, kwargs: dict, arg_names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The tensor inputs in signature order (positional, then keywords by name), with names."""
    return [(arg_names[i], a) for i, a in enumerate(args)] + sorted(
        (name, v) for name, v in kwargs.items() if isinstance(v, torch.Tensor))
