"""Row KernelSpec (backends/rows.py) -> C: one function, OpenMP over rows, a few passes per row.

    int64_t k(const float* restrict in0, float* restrict out0) {
      int64_t bad = 0;
      #pragma omp parallel for schedule(static) reduction(|:bad)
      for (int64_t k0 = 0; k0 < 512; k0++) {                 // the kept dims: one row each
        const int64_t bl0 = k0*64, bs0 = k0*64;                // where the row starts in each tensor
        float t5[64];                                          // a value two passes need, computed once
        float v3 = -__builtin_inff();                          // pass 1: rowmax
        for (int64_t q1 = 0; q1 < 64; q1++) { ...; t5[q1] = v5; if (v5 != v5 || v5 > v3) v3 = v5; }
        const float v7 = ...;                                  // row values, once a row
        for (int64_t q1 = 0; q1 < 64; q1++) { ...; out0[bs0 + q1] = v9; }   // the store pass
      }
      return bad;
    }

Rows of a few elements with only maxima, or no reduction, in them (max pooling's windows, forward
and backward) are rendered the other way round: each row unrolled, the innermost kept dim under
`omp simd`, so neighbouring rows run in vector lanes and no element takes a branch (a maximum
over random data mispredicts every other branch: eager's max pooling spends most of its time
there).

Sums run left to right in the row's type. A kernel with sums over all rows (colsum, allsum) splits
the rows into a fixed number of chunks: each chunk sums its rows into partials, which are added in
chunk order at the end (the same numbers for any number of threads).
"""

from __future__ import annotations

import itertools
import math

from ..expr import TRANSCENDENTAL
from ..lower import KernelSpec
from ..rows import ALL_ROWS, ROW_REDUCTIONS, RowRendering, needed
from .render import C_TYPES, PARALLEL_MIN_ELEMENTS, _literal, _zero_loads, expression, single_declarations

SCRATCH_BYTES = 1 << 15  # per thread: values kept for a later pass over the row (else recomputed)
CHUNKS = 32  # partial sums of kernels that sum over all rows
UNROLLED_ROW = 64  # elements of a row short enough to unroll and vectorize across rows
# GCC's partial redundancy elimination turns a row's selects into masks of masks that its vectorizer
# then refuses ("no vectype"); without it the rows of a window kernel vectorize (GCC 12)
ACROSS_ROWS_ATTRIBUTE = '__attribute__((optimize("no-tree-pre"))) '


def render_row_kernel(spec: KernelSpec, name: str) -> str:
    return _RowRenderer(spec).render(name)


class _RowRenderer(RowRendering):
    def __init__(self, spec: KernelSpec):
        super().__init__(spec)
        self.allocated = len(spec.allocations)
        self.types = [e.dtype for e in spec.exprs]
        levels = self.plan.levels
        self.levels = levels
        self.chunked = any(e.op in ALL_ROWS for e in spec.exprs)
        self.cached: dict[int, int] = {}  # expr -> the loop that computes it into scratch t{i}
        self.scratch = 0
        self.in_tail = False
        self.flat = False  # a loop nest over the whole space (no reductions): every offset in full
        self.across_rows = self._short_rows_of_maxima()

    # -- addressing -------------------------------------------------------------------------------

    def _tensor(self, slot: int) -> tuple[str, list[int]]:
        loads = len(self.lane.loads)
        if slot < loads:
            return f"in{self.lane.loads[slot][0]}", self.strides[slot]
        target = self.lane.stores[slot - loads][0]
        pointer = f"out{target}" if target < self.allocated else f"in{self.spec.written_inputs[target - self.allocated]}"
        return pointer, self.strides[slot]

    def _base(self, slot: int) -> str:
        _, strides = self._tensor(slot)
        terms = [f"k{d}*{strides[d]}" for d in self.kept if strides[d]]
        return " + ".join(terms) or "0"

    def _element(self, slot: int) -> str:
        pointer, strides = self._tensor(slot)
        if self.flat:
            terms = [(f"q{d}" if self.is_reduced[d] else f"k{d}") + ("" if s == 1 else f"*{s}")
                     for d, s in enumerate(strides) if s]
            return f"{pointer}[{' + '.join(terms) or '0'}]"
        terms = [f"b{slot}"] + [f"q{d}" if strides[d] == 1 else f"q{d}*{strides[d]}" for d in self.red if strides[d]]
        return f"{pointer}[{' + '.join(terms)}]"

    def _row_element(self, slot: int) -> str:
        pointer, _ = self._tensor(slot)
        if self.flat and not self.in_tail:
            return self._element(slot)
        return f"{pointer}[0]" if self.in_tail else f"{pointer}[b{slot}]"

    # -- expressions ------------------------------------------------------------------------------

    def _name(self, index: int, loop: int | None) -> str:
        if loop is not None and index in self.cached and self.cached[index] != loop:
            return f"t{index}[j]"
        return f"v{index}"

    def _value(self, index: int, loop: int | None) -> str:
        expr = self.spec.exprs[index]
        if expr.op == "index":
            d = self.dim_of[expr.value]
            return f"((int64_t){'q' if self.is_reduced[d] else 'k'}{d})"
        if expr.op == "load":
            slot = expr.value
            return self._element(slot) if self.levels[index] == "E" else self._row_element(slot)
        names = [self._name(i, loop) for i in range(len(self.spec.exprs))]
        return expression(expr, names, lambda k: self._value_of_load(k), lambda k: f"s{k}", self.types)

    def _value_of_load(self, k: int) -> str:
        index = next(i for i, e in enumerate(self.spec.exprs) if e.op == "load" and e.value == k)
        return self._element(k) if self.levels[index] == "E" else self._row_element(k)

    def _statement(self, index: int, loop: int | None, const: bool = False) -> str:
        t = C_TYPES[self.types[index]]
        return f"{'const ' if const else ''}{t} v{index} = {self._value(index, loop)};"

    # -- loops over the row ---------------------------------------------------------------------------

    def _simd(self, reductions: list[int]) -> bool:
        """Whether a pass sums in vector lanes (`omp simd` reductions, ordered as the compiler
        vectorizes: eager's CPU sums are lane-wise too). Not for rowargmax, whose order is its
        result, nor for a sum that starts at -0.0 (OpenMP's lanes start at +0.0)."""
        def starts_negative(expr) -> bool:
            return expr.op == "rowsum" and expr.value is not None and math.copysign(1.0, expr.value) < 0

        return not any(self.spec.exprs[r].op == "rowargmax" or starts_negative(self.spec.exprs[r]) for r in reductions)

    def _short_rows_of_maxima(self) -> bool:
        """Whether rows are short and reduce only by maxima, if at all (max pooling's windows, forward
        and backward), so that each row is unrolled and rows run in vector lanes; a row's maxima
        are then taken left to right, as in the loop over it."""
        ops = {e.op for e in self.spec.exprs}
        return (not self.chunked and bool(self.kept) and bool(self.red) and self.cols <= UNROLLED_ROW
                and not ops & {"rowsum", "colsum", "allsum"})

    def _reads_no_row_value(self, found: list[int]) -> bool:
        """Whether the store pass's element values (`found`) and stores depend on no row value."""
        roots = found + [self.spec.store_exprs[k][0] for k in self.plan.stores["E"]]
        return all(self.levels[i] in ("E", "G") for i in needed(self.spec, roots))

    def _loop(self, body: list[str], simd: str | None = "") -> list[str]:
        """Nested loops over the reduced dims around `body`, with j the flat column index; the
        innermost one under `omp simd` (with `simd`'s reduction clauses) unless simd is None.
        Across rows: one block per element of the row instead, its indices constants."""
        if self.across_rows:
            lines = []
            for j, position in enumerate(itertools.product(*(range(self.sizes[d]) for d in self.red))):
                indices = [f"const int64_t q{d} = {q}; (void)q{d};" for d, q in zip(self.red, position)]
                lines += ["{", *(f"  {line}" for line in [*indices, f"const int64_t j = {j}; (void)j;", *body]), "}"]
            return lines
        if not self.red:
            return ["{", "  const int64_t j = 0; (void)j;", *(f"  {line}" for line in body), "}"]
        lines, indent = [], ""
        flat, step = [], 1
        for d in reversed(self.red):
            flat.insert(0, f"q{d}" if step == 1 else f"q{d}*{step}")
            step *= self.sizes[d]
        for d in self.red:
            if d == self.red[-1] and simd is not None:
                lines.append(f"{indent}#pragma omp simd {simd}".rstrip())
            lines.append(f"{indent}for (int64_t q{d} = 0; q{d} < {self.sizes[d]}; q{d}++) {{")
            indent += "  "
        lines += [indent + line for line in [f"const int64_t j = {' + '.join(flat)}; (void)j;", *body]]
        for _ in self.red:
            indent = indent[:-2]
            lines.append(f"{indent}}}")
        return lines

    def _element_roots(self) -> list[list[int]]:
        """Per loop (the passes, then the store pass): the element expressions it must evaluate."""
        roots = [[a for r in reductions for a in self.spec.exprs[r].args] for reductions in self.plan.passes]
        final = [self.spec.store_exprs[k][0] for k in self.plan.stores["E"]]
        final += [self.spec.exprs[i].args[0] for i, e in enumerate(self.spec.exprs) if e.op == "colsum"]
        return roots + [final]

    def _choose_cached(self, loops: list[list[int]]) -> list[list[int]]:
        """Element expressions of each loop, in order; a computed value a later loop needs again is
        kept in a scratch row by the loop that computes it (within SCRATCH_BYTES)."""
        computed_in: dict[int, int] = {}
        per_loop = []
        for number, roots in enumerate(loops):
            def stop(i: int, number: int = number) -> bool:
                if self.levels[i] != "E" or i in self.cached:
                    return True
                if i in computed_in and self._costly(i) and not self.across_rows:
                    size = self.cols * self.types[i].itemsize
                    if self.scratch + size <= SCRATCH_BYTES:
                        self.cached[i] = computed_in[i]
                        self.scratch += size
                        return True
                return False
            found = [i for i in needed(self.spec, [r for r in roots if self.levels[r] == "E"], stop)
                     if self.levels[i] == "E"]
            for i in found:
                if i not in self.cached:
                    computed_in.setdefault(i, number)
            per_loop.append(found)
        return per_loop

    def _costly(self, index: int) -> bool:
        """Whether an element value is worth a scratch row rather than computing it again: it takes
        a transcendental function, a division or a root, or more than a few operations."""
        ops = [self.spec.exprs[i].op for i in needed(self.spec, [index], lambda i: self.levels[i] != "E")
               if self.levels[i] == "E" and self.spec.exprs[i].op not in ("load", "index", "const", "cast")]
        return len(ops) > 3 or any(op in TRANSCENDENTAL or op in ("div", "sqrt", "rsqrt", "reciprocal") for op in ops)

    # -- the kernel ----------------------------------------------------------------------------------

    def render(self, name: str) -> str:
        if not self.plan.passes and not self.chunked and not self.plan.stores["R"] and not self.across_rows:
            return self._render_flat(name)
        spec = self.spec
        loops = self._element_roots()
        per_loop = self._choose_cached(loops)
        emitted: set[int] = set()
        body: list[str] = []

        def row_values(roots: list[int]) -> list[str]:
            """Statements for the row (and kernel-wide) values `roots` need that are not there yet."""
            lines = []
            for i in needed(spec, roots, lambda i: self.levels[i] not in ("R", "G") or i in emitted):
                if self.levels[i] in ("R", "G") and i not in emitted:
                    if spec.exprs[i].op in ROW_REDUCTIONS:
                        raise AssertionError(f"row reduction {i} used before its pass")
                    emitted.add(i)
                    lines.append(self._statement(i, None, const=True))
            return lines

        def loop_inputs(found: list[int]) -> list[int]:
            return [a for i in found for a in spec.exprs[i].args if self.levels[a] in ("R", "G")]

        t = {i: C_TYPES[self.types[i]] for i in range(len(spec.exprs))}
        final = len(self.plan.passes)
        # across rows, stores that read no row value join the last pass: a second walk over the
        # row's elements stops GCC from pairing the stores of neighbouring elements (8x slower)
        merged = self.across_rows and final > 0 and self._reads_no_row_value(per_loop[final])
        last_pass: list[str] = []
        for number, reductions in enumerate(self.plan.passes):
            found = per_loop[number]
            body += row_values(loop_inputs(found) + [a for r in reductions for a in spec.exprs[r].args
                                                     if self.levels[a] in ("R", "G")])
            inner = []
            for i in found:
                if self.cached.get(i, number) != number:
                    continue  # read from scratch
                inner.append(self._statement(i, number))
                if self.cached.get(i) == number:
                    inner.append(f"t{i}[j] = v{i};")
            simd = self._simd(reductions) and not self.across_rows
            clauses, after = [], []
            for r in reductions:
                expr = spec.exprs[r]
                value = self._name(expr.args[0], number)
                if expr.op == "rowsum":
                    body.append(f"{t[r]} v{r} = {_literal(expr.value, expr.dtype)};")
                    inner.append(f"v{r} += {value};")
                    clauses.append(f"reduction(+:v{r})")
                elif expr.op == "rowmax" and simd:
                    # the maximum in vector lanes, NaN noted apart (a vector max does not propagate it)
                    body += [f"{t[r]} v{r} = {_literal(-math.inf, expr.dtype)};", f"int n{r} = 0;"]
                    inner += [f"v{r} = {value} > v{r} ? {value} : v{r};", f"n{r} |= {value} != {value};"]
                    clauses += [f"reduction(max:v{r})", f"reduction(|:n{r})"]
                    after.append(f"if (n{r}) v{r} = {_literal(math.nan, expr.dtype)};")
                elif expr.op == "rowmax":
                    body.append(f"{t[r]} v{r} = {_literal(-math.inf, expr.dtype)};")
                    inner.append(f"v{r} = (({value} != {value}) | ({value} > v{r})) ? {value} : v{r};"
                                 if self.across_rows else f"if ({value} != {value} || {value} > v{r}) v{r} = {value};")
                else:  # rowargmax: eager max pooling's rule, the last NaN or the first maximum
                    vt = C_TYPES[spec.exprs[expr.args[0]].dtype]
                    body += [f"{vt} m{r} = {_literal(-math.inf, spec.exprs[expr.args[0]].dtype)};",
                             f"{t[r]} v{r} = 0;"]
                    chosen = self._name(expr.args[1], number)
                    if self.across_rows:  # selects, not branches: they vectorize
                        inner += [f"const bool c{r} = (j == 0) | ({value} > m{r}) | ({value} != {value});",
                                  f"m{r} = c{r} ? {value} : m{r};", f"v{r} = c{r} ? {chosen} : v{r};"]
                    else:
                        inner.append(f"if (j == 0 || {value} > m{r} || {value} != {value}) "
                                     f"{{ m{r} = {value}; v{r} = {chosen}; }}")
                emitted.add(r)
            if merged and number == final - 1:
                body += row_values(loop_inputs(per_loop[final]))
                last_pass, after_last = inner, after
                continue
            body += self._loop(inner, " ".join(clauses) if simd else None) + after
        found = per_loop[final]
        row_stores = self.plan.stores["R"]
        allsums = [i for i, e in enumerate(spec.exprs) if e.op == "allsum"]
        row_roots = ([spec.store_exprs[k][0] for k in row_stores] + [spec.exprs[i].args[0] for i in allsums]
                     + list(self.row.checks))
        if not merged:
            body += row_values(loop_inputs(found) + row_roots)
            for check in self.row.checks:
                body.append(f"bad |= !v{check};")
        inner = []
        computed_last = set(per_loop[final - 1]) if merged else set()
        for i in found:
            if self.cached.get(i, final) == final and i not in computed_last:
                inner.append(self._statement(i, final))
        loads = len(self.lane.loads)
        for k in self.plan.stores["E"]:
            ref, dtype = spec.store_exprs[k]
            inner.append(f"{self._element(loads + k)} = (({C_TYPES[dtype]}){self._name(ref, final)});")
        for i, e in enumerate(spec.exprs):
            if e.op == "colsum":
                inner.append(f"p{i}[j] += {self._name(e.args[0], final)};")
        if merged:
            body += self._loop(last_pass + inner) + after_last + row_values(row_roots)
            body += [f"bad |= !v{check};" for check in self.row.checks]
        elif inner:
            body += self._loop(inner)
        for k in row_stores:
            ref, dtype = spec.store_exprs[k]
            body.append(f"{self._row_element(loads + k)} = (({C_TYPES[dtype]})v{ref});")
        for i in allsums:
            body.append(f"a{i} += v{spec.exprs[i].args[0]};")

        scratch = [f"{t[i]} t{i}[{self.cols}];" for i in sorted(self.cached)]
        bases = [f"const int64_t b{s} = {self._base(s)}; (void)b{s};"
                 for s in range(loads + len(self.lane.stores))]
        lines = ["int64_t bad = 0;"]
        if self.chunked:
            lines += self._chunked(bases + scratch + body)
        else:
            lines += self._rows_loop(bases + scratch + body)
        return self._function(name, lines, body)

    def _function(self, name: str, lines: list[str], body: list[str]) -> str:
        """The kernel function: its lines, then the tail after all rows, returning the error flag."""
        self.in_tail = True
        tail = self._tail()
        lines = lines + tail + ["return bad;"]
        decls = single_declarations(self.spec)
        attribute = ACROSS_ROWS_ATTRIBUTE if self.across_rows else ""
        return (f"{attribute}int64_t {name}({', '.join(decls) or 'void'}) {{\n" + _zero_loads(body + tail)
                + "".join(f"  {line}\n" for line in lines) + "}\n")

    def _render_flat(self, name: str) -> str:
        """A row program without reductions (max pooling's backward): one loop nest over the whole
        space in the memory order of the first store, every value computed per element."""
        spec = self.spec
        loads = len(self.lane.loads)
        first = self.strides[loads + self.plan.stores["E"][0]] if self.plan.stores["E"] else None
        order = sorted(range(len(self.sizes)), key=lambda d: -abs(first[d]) if first else 0)
        self.flat = True
        roots = [spec.store_exprs[k][0] for k in self.plan.stores["E"]] + list(self.row.checks)
        body = [self._statement(i, None) for i in needed(spec, roots)]
        body += [f"bad |= !v{check};" for check in self.row.checks]
        for k in self.plan.stores["E"]:
            ref, dtype = spec.store_exprs[k]
            body.append(f"{self._element(loads + k)} = (({C_TYPES[dtype]})v{ref});")
        lines, indent = ["int64_t bad = 0;"], ""
        numel = math.prod(self.sizes)
        if order and numel >= PARALLEL_MIN_ELEMENTS and self.sizes[order[0]] > 1:
            collapse = 2 if len(order) > 1 and self.sizes[order[0]] < 16 else 1
            lines.append("#pragma omp parallel for schedule(static) reduction(|:bad)"
                         + (f" collapse({collapse})" if collapse > 1 else ""))
        for d in order:
            var = f"q{d}" if self.is_reduced[d] else f"k{d}"
            lines.append(f"{indent}for (int64_t {var} = 0; {var} < {self.sizes[d]}; {var}++) {{")
            indent += "  "
        lines += [indent + line for line in body]
        for _ in order:
            indent = indent[:-2]
            lines.append(f"{indent}}}")
        return self._function(name, lines, body)

    def _parallel(self) -> bool:
        return self.rows > 1 and self.rows * self.cols >= PARALLEL_MIN_ELEMENTS

    def _rows_loop(self, body: list[str]) -> list[str]:
        """Nested loops over the kept dims, the outer ones split across threads."""
        if not self.kept:
            return ["{", *(f"  {line}" for line in body), "}"]
        lines, indent = [], ""
        # across rows the innermost kept loop is the vector loop: threads split the ones outside it
        outer = len(self.kept) - 1 if self.across_rows else len(self.kept)
        if self._parallel() and outer:
            collapse = 2 if outer > 1 and self.sizes[self.kept[0]] < 16 else 1
            lines.append("#pragma omp parallel for schedule(static) reduction(|:bad)"
                         + (f" collapse({collapse})" if collapse > 1 else ""))
        for position, d in enumerate(self.kept):
            if self.across_rows and position == len(self.kept) - 1:
                parallel = "parallel for " if self._parallel() and not outer else ""
                lines.append(f"{indent}#pragma omp {parallel}simd reduction(|:bad)")
            lines.append(f"{indent}for (int64_t k{d} = 0; k{d} < {self.sizes[d]}; k{d}++) {{")
            indent += "  "
        lines += [indent + line for line in body]
        for _ in self.kept:
            indent = indent[:-2]
            lines.append(f"{indent}}}")
        return lines

    def _chunked(self, body: list[str]) -> list[str]:
        """Rows in CHUNKS fixed chunks; each sums its rows into partials p{i} (per column) and a{i}."""
        spec = self.spec
        chunks = min(self.rows, CHUNKS)
        colsums = [i for i, e in enumerate(spec.exprs) if e.op == "colsum"]
        allsums = [i for i, e in enumerate(spec.exprs) if e.op == "allsum"]
        t = {i: C_TYPES[spec.exprs[i].dtype] for i in colsums + allsums}
        lines = [f"{t[i]}* P{i} = ({t[i]}*)malloc(sizeof({t[i]}) * {chunks * self.cols});" for i in colsums]
        lines += [f"{t[i]} A{i}[{chunks}];" for i in allsums]
        if self._parallel():
            lines.append("#pragma omp parallel for schedule(static) reduction(|:bad)")
        lines.append(f"for (int64_t c = 0; c < {chunks}; c++) {{")
        inner = []
        for i in colsums:
            inner += [f"{t[i]}* restrict p{i} = P{i} + c * {self.cols};",
                      f"for (int64_t j = 0; j < {self.cols}; j++) p{i}[j] = {_init(spec.exprs[i])};"]
        inner += [f"{t[i]} a{i} = {_init(spec.exprs[i])};" for i in allsums]
        inner.append(f"for (int64_t r = c * {self.rows} / {chunks}; r < (c + 1) * {self.rows} / {chunks}; r++) {{")
        decompose = []
        for position, d in enumerate(self.kept):
            inner_size = math.prod(self.sizes[e] for e in self.kept[position + 1:])
            index = "r" if inner_size == 1 else f"r / {inner_size}"
            decompose.append(f"const int64_t k{d} = ({index}) % {self.sizes[d]};" if position else
                             f"const int64_t k{d} = {index};")
        inner += [f"  {line}" for line in decompose + body]
        inner.append("}")
        inner += [f"A{i}[c] = a{i};" for i in allsums]
        lines += [f"  {line}" for line in inner]
        lines.append("}")
        return lines

    def _tail(self) -> list[str]:
        """After all rows: the partials added in chunk order, the values known then, their stores."""
        spec = self.spec
        loads = len(self.lane.loads)
        stores = self.plan.stores["P"] + self.plan.stores["G"]
        if not stores:
            return []
        chunks = min(self.rows, CHUNKS)
        colsum_of = {i for i, e in enumerate(spec.exprs) if e.op == "colsum"}

        def per_column(i: int) -> bool:
            return any(j in colsum_of for j in needed(spec, [i]))

        lines: list[str] = []
        done: set[int] = set()

        def values(roots: list[int], loop: bool) -> list[str]:
            out = []
            for i in needed(spec, roots, lambda i: self.levels[i] in ("R", "E") or spec.exprs[i].op in ALL_ROWS):
                if i in done or self.levels[i] in ("R", "E") or (per_column(i) != loop and self.levels[i] == "P"):
                    continue
                e = spec.exprs[i]
                done.add(i)
                if e.op == "allsum":
                    out += [f"{C_TYPES[e.dtype]} v{i} = {_init(e)};",
                            f"for (int64_t c = 0; c < {chunks}; c++) v{i} += A{i}[c];"]
                elif e.op == "colsum":
                    out += [f"{C_TYPES[e.dtype]} v{i} = {_init(e)};",
                            f"for (int64_t c = 0; c < {chunks}; c++) v{i} += P{i}[c * {self.cols} + j];"]
                else:
                    out.append(self._statement(i, None, const=True))
            return out

        single = [k for k in stores if not per_column(spec.store_exprs[k][0])]
        column = [k for k in stores if per_column(spec.store_exprs[k][0])]
        lines += ["{"]
        lines += [f"  {line}" for line in values([spec.store_exprs[k][0] for k in single + column], False)]
        for k in single:
            ref, dtype = spec.store_exprs[k]
            pointer, _ = self._tensor(loads + k)
            lines.append(f"  {pointer}[0] = (({C_TYPES[dtype]})v{ref});")
        if column:
            inner = values([spec.store_exprs[k][0] for k in column], True)
            for k in column:
                ref, dtype = spec.store_exprs[k]
                pointer, strides = self._tensor(loads + k)
                terms = [f"q{d}*{strides[d]}" for d in self.red if strides[d]]
                inner.append(f"{pointer}[{' + '.join(terms) or '0'}] = (({C_TYPES[dtype]})v{ref});")
            lines += [f"  {line}" for line in self._loop(inner)]
        lines += ["}"]
        lines += [f"free(P{i});" for i in sorted(colsum_of)]
        return lines


def _init(expr) -> str:
    """The starting value of a sum (its `value`: 0.0, or -0.0 where a sum must keep -0.0)."""
    return _literal(0.0 if expr.value is None else expr.value, expr.dtype)


__all__ = ["render_row_kernel"]
