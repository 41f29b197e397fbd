"""Row KernelSpec (backends/rows.py) -> Triton: one program per row, the whole row in one block.

    @triton.jit
    def k(in0, in1, out0):
        r = tl.program_id(0)
        cols = tl.arange(0, 64)
        cmask = cols < 40
        k0 = r // 5
        k1 = r % 5
        q2 = cols
        v0 = tl.load(in0 + (k0 * 200 + k1 * 40) + q2, mask=cmask)
        ...prologue...
        v4 = row_max(tl.where(cmask, v3, -INF))               # rowmax, NaN tested apart
        ...
        tl.store(out0 + (k0 * 200 + k1 * 40) + q2, v7, mask=cmask)

Every element value is a row vector, every row value a scalar; expressions are in topological order,
so a reduction is emitted where it stands. Every input is loaded once per row. The GPU's `tl.max`
ignores NaN; eager's maximum propagates it, so each maximum also tests the row for NaN. A kernel
with sums over all rows (colsum, allsum) runs a fixed number of chunk programs, each looping over
its rows and storing its partial sums to a scratch buffer, then a second one-program kernel adds
the partials in chunk order and stores what follows from them (the same numbers for any GPU).
`row_max`, `row_min` and `row_sum` are `tl.max`, `tl.min` and `tl.sum` over the block on the GPU
and numpy stand-ins in the interpreter (jit.py); `tl.full` stands where `tl.zeros` would (the
latter is a @triton.jit function, which the interpreter cannot call once triton was imported
without it). A row of more than 8192 elements is walked in blocks of 2048, once per pass, with
per-lane partial results (its inputs are then loaded once per pass); with an argmax or a sum over
all rows such a group is not rendered and runs through aten.
"""

from __future__ import annotations

import math

from ..lower import KernelSpec
from ..rows import ALL_ROWS, RowRendering, needed
from .expressions import SIGNATURE_TYPES, TL_TYPES, NotRenderable, _literal, convert, expression

MAX_ROW_BLOCK = 8192  # longer rows are walked in blocks of LOOP_BLOCK, once per pass
LOOP_BLOCK = 2048
CHUNKS = 64  # programs of a kernel that sums over all rows


def render_row(spec: KernelSpec, single_signature, declarations, assemble, make):
    """The TritonKernel of a row spec (with its combining kernel when it sums over all rows);
    the helpers are render.py's."""
    return _RowRenderer(spec).render(single_signature, declarations, assemble, make)


class _RowRenderer(RowRendering):
    def __init__(self, spec: KernelSpec):
        super().__init__(spec)
        self.levels = self.plan.levels
        self.block = 1 << max(self.cols - 1, 0).bit_length()
        # a row longer than one block: each pass walks it in blocks, loading its inputs again
        self.looped = self.block > MAX_ROW_BLOCK
        if self.looped:
            self.block = LOOP_BLOCK
            if any(e.op in ("rowargmax", "colsum", "allsum") for e in spec.exprs):
                raise NotRenderable(f"rows of {self.cols} elements with an argmax or a sum over all rows")
        self.allocated = len(spec.allocations)
        self.types = [e.dtype for e in spec.exprs]
        self.chunked = any(e.op in ALL_ROWS for e in spec.exprs)
        spans = [sum((size - 1) * abs(s) for size, s in zip(self.sizes, strides)) for strides in self.strides]
        self.wide = max([self.rows * self.cols, *spans]) + self.block >= 2**31
        sums = {spec.exprs[i].dtype for i, e in enumerate(spec.exprs) if e.op in ALL_ROWS}
        if len(sums) > 1:
            raise NotRenderable("sums over all rows of different types")
        self.sum_type = sums.pop() if sums else None

    # -- addressing -------------------------------------------------------------------------------

    def _pointer(self, slot: int) -> str:
        loads = len(self.lane.loads)
        if slot < loads:
            return f"in{self.lane.loads[slot][0]}"
        target = self.lane.stores[slot - loads][0]
        return f"out{target}" if target < self.allocated else f"in{self.spec.written_inputs[target - self.allocated]}"

    def _address(self, slot: int, along: bool) -> str:
        strides = self.strides[slot]
        terms = [f"k{d} * {strides[d]}" for d in self.kept if strides[d]]
        if along:
            terms += [f"q{d}" if strides[d] == 1 else f"q{d} * {strides[d]}" for d in self.red if strides[d]]
        pointer = self._pointer(slot)
        return f"{pointer} + ({' + '.join(terms)})" if terms else pointer

    def _head(self, row: str) -> list[str]:
        """The kept indices of row `row` (the program's, or the chunk loop's)."""
        lines = []
        for position, d in enumerate(self.kept):
            inner = math.prod(self.sizes[e] for e in self.kept[position + 1:])
            index = row if inner == 1 else f"({row} // {inner})"
            lines.append(f"k{d} = {index} % {self.sizes[d]}" if position else f"k{d} = {index}")
        return lines

    # -- expressions --------------------------------------------------------------------------------

    def _statements(self, order: list[int], vector: list[bool]) -> list[str]:
        lines = []
        spec = self.spec
        for index in order:
            expr = spec.exprs[index]
            level = self.levels[index]
            out = f"v{index}"
            if expr.op == "load":
                along = level == "E"
                vector[index] = along
                where = self._address(expr.value, along)
                lines.append(f"{out} = tl.load({where}{', mask=cmask' if along else ''})")
            elif expr.op == "scalar":
                lines.append(f"{out} = tl.full([], s{expr.value}, {TL_TYPES[expr.dtype]})")
            elif expr.op == "index":
                d = self.dim_of[expr.value]
                along = self.is_reduced[d]
                vector[index] = along
                lines.append(f"{out} = {'q' if along else 'k'}{d}.to(tl.int64)")
            elif expr.op in ("rowsum", "rowmax", "rowargmax"):
                lines += self._reduction(index, vector)
            elif expr.op in ALL_ROWS:
                continue  # accumulated by the chunk loop, known to the combining kernel
            else:
                vector[index] = any(vector[a] for a in expr.args)
                args = [f"v{a}" for a in expr.args]
                lines.append(f"{out} = {expression(expr, args, [self.types[a] for a in expr.args])}")
        return lines

    def _reduction(self, index: int, vector: list[bool]) -> list[str]:
        expr = self.spec.exprs[index]
        t = TL_TYPES[expr.dtype]
        x = f"v{expr.args[0]}"
        out = f"v{index}"
        if expr.op == "rowsum":
            init = _literal(0.0 if expr.value is None else expr.value, expr.dtype)
            # init + sum: 0.0 + (-0.0) is 0.0 as eager's sum from zero; -0.0 + x is x
            return [f"{out} = {init} + row_sum(tl.where(cmask, {x}, {init}))"]
        nan = (f"{out}_n = row_max(tl.where(cmask & ({x} != {x}), 1, 0))")
        if expr.op == "rowmax":
            return [f"{out}_m = row_max(tl.where(cmask, {x}, tl.full([], -INF, {t})))", nan,
                    f"{out} = tl.where({out}_n > 0, tl.full([], NAN, {t}), {out}_m)"]
        # rowargmax: the last NaN, else the first maximum (eager max pooling's rule)
        source = TL_TYPES[self.types[expr.args[0]]]
        payload = f"v{expr.args[1]}"
        if not vector[expr.args[1]]:
            payload = f"({payload} + tl.full([{self.block}], 0, {TL_TYPES[expr.dtype]}))"
        lines = [f"{out}_m = row_max(tl.where(cmask, {x}, tl.full([], -INF, {source})))",
                 f"{out}_last = row_max(tl.where(cmask & ({x} != {x}), cols, -1))",
                 f"{out}_first = row_min(tl.where(cmask & ({x} == {out}_m), cols, {self.block}))",
                 f"{out}_at = tl.where({out}_last >= 0, {out}_last, {out}_first)"]
        if not expr.dtype.is_floating_point:  # the payload at one element, 0 elsewhere
            return [*lines, f"{out} = row_sum(tl.where(cols == {out}_at, {payload}, 0))"]
        # A float payload at one element taken as the maximum over it and -inf elsewhere: a sum with
        # -0.0 fills gave +0.0 for a -0.0 payload where the reduction starts from +0.0 (the
        # interpreter's); its NaN noted apart, as the GPU's maximum ignores NaN.
        t = TL_TYPES[expr.dtype]
        return [*lines, f"{out}_v = row_max(tl.where(cols == {out}_at, {payload}, tl.full([], -INF, {t})))",
                f"{out}_p = row_max(tl.where((cols == {out}_at) & ({payload} != {payload}), 1, 0))",
                f"{out} = tl.where({out}_p > 0, tl.full([], NAN, {t}), {out}_v)"]

    def _order(self, roots: list[int], stop=lambda i: False) -> list[int]:
        return needed(self.spec, roots, stop)

    # -- the kernels ---------------------------------------------------------------------------------

    def render(self, single_signature, declarations, assemble, make):
        spec = self.spec
        parameters, signature = single_signature(spec)
        parameters = list(parameters)
        if self.chunked:
            signature["part"] = "*" + SIGNATURE_TYPES[self.sum_type]
            parameters.append(("scratch", 0))
        declared, scalars = declarations(signature)
        warps = max(1, min(8, self.block // 256))
        head = self._columns("tl.arange(0, {block})")
        if self.looped:
            lines = [f"r = {'tl.program_id(0).to(tl.int64)' if self.wide else 'tl.program_id(0)'}",
                     *self._head("r"), *self._looped_body()]
            name, source = assemble(spec, declared, scalars, lines)
            return make(name, source, signature, tuple(parameters), self.rows, warps)
        row_roots = [spec.store_exprs[k][0] for k in self.plan.stores["E"] + self.plan.stores["R"]]
        sums = [i for i, e in enumerate(spec.exprs) if e.op in ALL_ROWS]
        row_roots += [spec.exprs[i].args[0] for i in sums]
        vector = [False] * len(spec.exprs)
        body = self._statements(self._order(row_roots, lambda i: self.levels[i] == "P"), vector)
        loads = len(self.lane.loads)
        for k in self.plan.stores["E"]:
            ref, dtype = spec.store_exprs[k]
            value = convert(f"v{ref}", self.types[ref], dtype)
            body.append(f"tl.store({self._address(loads + k, True)}, {value}, mask=cmask)")
        for k in self.plan.stores["R"]:
            ref, dtype = spec.store_exprs[k]
            body.append(f"tl.store({self._address(loads + k, False)}, {convert(f'v{ref}', self.types[ref], dtype)})")
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        if not self.chunked:
            lines = [f"r = {pid}", *head, *self._head("r"), *body]
            name, source = assemble(spec, declared, scalars, lines)
            return make(name, source, signature, tuple(parameters), self.rows, warps)
        chunks = min(self.rows, CHUNKS)
        width = self._partial_layout(sums)
        t = TL_TYPES[self.sum_type]
        lines = [f"c = {pid}", *head,
                 *[f"a{i} = tl.full([{self.block}], 0.0, {t})" if spec.exprs[i].op == "colsum"
                   else f"a{i} = tl.full([], 0.0, {t})" for i in sums],
                 f"for r in range(c * {self.rows} // {chunks}, (c + 1) * {self.rows} // {chunks}):"]
        loop = [*self._head("r"), *body]
        for i in sums:
            value = f"v{spec.exprs[i].args[0]}"
            loop.append(f"a{i} = a{i} + tl.where(cmask, {value}, 0.0)" if spec.exprs[i].op == "colsum"
                        else f"a{i} = a{i} + {value}")
        lines += [f"    {line}" for line in loop]
        for i in sums:
            offset = f"c * {width} + {self.offsets[i]}"
            lines.append(f"tl.store(part + {offset} + cols, a{i}, mask=cmask)" if spec.exprs[i].op == "colsum"
                         else f"tl.store(part + {offset}, a{i})")
        name, source = assemble(spec, declared, scalars, lines)
        combine = self._combine(declared, scalars, head, sums, chunks, width, assemble)
        combined = make(*combine, signature, tuple(parameters), 1, warps)
        return make(name, source, signature, tuple(parameters), chunks, warps,
                    combine=combined, scratch=(chunks * width, self.sum_type))

    def _block_head(self) -> list[str]:
        """The columns of the block at `start` and their reduced indices (a looped row)."""
        return self._columns("start + tl.arange(0, {block})")

    def _columns(self, first: str) -> list[str]:
        """`cols` (from the expression `first`), its mask, and the index of each reduced dim."""
        lines = [f"cols = {first.format(block=self.block)}", f"cmask = cols < {self.cols}"]
        rest = "cols"
        for position, d in enumerate(reversed(self.red)):
            last = position == len(self.red) - 1
            lines.append(f"q{d} = {rest}" if last else f"q{d} = {rest} % {self.sizes[d]}")
            if not last:
                lines.append(f"c{d} = {rest} // {self.sizes[d]}")
                rest = f"c{d}"
        return lines

    def _looped_body(self) -> list[str]:
        """One row longer than a block: each pass over it runs block by block with per-lane partial
        results (a sum, or a maximum and a NaN flag), added up (compared) after the loop; the row
        values follow; a last loop stores the element values."""
        spec = self.spec
        emitted: set[int] = set()
        vector = [False] * len(spec.exprs)
        lines: list[str] = []

        def row_values(roots: list[int]) -> list[str]:
            out = []
            for i in needed(spec, roots, lambda i: self.levels[i] not in ("R", "G") or i in emitted):
                if self.levels[i] in ("R", "G") and i not in emitted:
                    emitted.add(i)
                    out += self._statements([i], vector)
            return out

        def element_values(roots: list[int]) -> tuple[list[int], list[int]]:
            found = [i for i in needed(spec, roots, lambda i: self.levels[i] != "E") if self.levels[i] == "E"]
            inputs = [a for i in found for a in spec.exprs[i].args if self.levels[a] in ("R", "G")]
            return found, inputs + [r for r in roots if self.levels[r] in ("R", "G")]

        loop = f"for start in range(0, {self.cols}, {self.block}):"
        for reductions in self.plan.passes:
            found, inputs = element_values([a for r in reductions for a in spec.exprs[r].args])
            lines += row_values(inputs)
            body = [*self._block_head(), *self._statements(found, vector)]
            after = []
            for r in reductions:
                expr = spec.exprs[r]
                t = TL_TYPES[expr.dtype]
                x = f"v{expr.args[0]}"
                if expr.op == "rowsum":
                    init = _literal(0.0 if expr.value is None else expr.value, expr.dtype)
                    lines.append(f"p{r} = tl.full([{self.block}], 0.0, {t}) + {init}")
                    body.append(f"p{r} = p{r} + tl.where(cmask, {x}, {init})")
                    after.append(f"v{r} = {init} + row_sum(p{r})")
                else:  # rowmax, NaN noted apart (the GPU's maximum ignores it)
                    lines += [f"p{r} = tl.full([{self.block}], -INF, {t})", f"n{r} = tl.full([{self.block}], 0, tl.int32)"]
                    body += [f"p{r} = tl.maximum(p{r}, tl.where(cmask, {x}, tl.full([], -INF, {t})))",
                             f"n{r} = tl.maximum(n{r}, tl.where(cmask & ({x} != {x}), 1, 0))"]
                    after.append(f"v{r} = tl.where(row_max(n{r}) > 0, tl.full([], NAN, {t}), row_max(p{r}))")
                emitted.add(r)
            lines += [loop, *(f"    {line}" for line in body), *after]
        loads = len(self.lane.loads)
        stores = self.plan.stores["E"]
        found, inputs = element_values([spec.store_exprs[k][0] for k in stores])
        lines += row_values(inputs + [spec.store_exprs[k][0] for k in self.plan.stores["R"]])
        if stores:
            body = [*self._block_head(), *self._statements(found, vector)]
            for k in stores:
                ref, dtype = spec.store_exprs[k]
                value = convert(f"v{ref}", self.types[ref], dtype)
                body.append(f"tl.store({self._address(loads + k, True)}, {value}, mask=cmask)")
            lines += [loop, *(f"    {line}" for line in body)]
        for k in self.plan.stores["R"]:
            ref, dtype = spec.store_exprs[k]
            lines.append(f"tl.store({self._address(loads + k, False)}, {convert(f'v{ref}', self.types[ref], dtype)})")
        return lines

    def _partial_layout(self, sums: list[int]) -> int:
        """Where each sum's partials sit in a chunk's row of the scratch buffer; the row's width."""
        self.offsets: dict[int, int] = {}
        width = 0
        for i in sums:
            self.offsets[i] = width
            width += self.cols if self.spec.exprs[i].op == "colsum" else 1
        return width

    def _combine(self, declared, scalars, head, sums, chunks, width, assemble) -> tuple[str, str]:
        """The one-program kernel that adds the chunks' partials and stores what follows from them."""
        spec = self.spec
        t = TL_TYPES[self.sum_type]
        lines = list(head)
        for i in sums:
            e = spec.exprs[i]
            init = _literal(0.0 if e.value is None else e.value, e.dtype)
            if e.op == "colsum":
                lines += [f"v{i} = tl.full([{self.block}], 0.0, {t}) + {init}", f"for c in range({chunks}):",
                          f"    v{i} = v{i} + tl.load(part + c * {width} + {self.offsets[i]} + cols, mask=cmask)"]
            else:
                lines += [f"v{i} = {init}", f"for c in range({chunks}):",
                          f"    v{i} = v{i} + tl.load(part + c * {width} + {self.offsets[i]})"]
        stores = self.plan.stores["P"] + self.plan.stores["G"]
        roots = [spec.store_exprs[k][0] for k in stores]
        vector = [spec.exprs[i].op == "colsum" if i in sums else False for i in range(len(spec.exprs))]
        order = [i for i in self._order(roots, lambda i: i in sums) if i not in sums]
        if any(self.levels[i] in ("R", "E") for i in order):
            raise NotRenderable("a value known after all rows that reads one row")
        lines += self._statements(order, vector)
        loads = len(self.lane.loads)
        for k in stores:
            ref, dtype = spec.store_exprs[k]
            value = convert(f"v{ref}", self.types[ref], dtype)
            strides = self.strides[loads + k]
            terms = [f"q{d}" if strides[d] == 1 else f"q{d} * {strides[d]}" for d in self.red if strides[d]]
            if vector[ref]:
                lines.append(f"tl.store({self._pointer(loads + k)} + ({' + '.join(terms) or '0'}), {value}, mask=cmask)")
            else:
                lines.append(f"tl.store({self._pointer(loads + k)}, {value})")
        return assemble(spec, declared, scalars, lines, suffix="combine")


__all__ = ["render_row"]
