"""Executing an op without computing it: placeholders shaped by a fake run of the op.

Symbolic recording runs no kernel. For each op it derives the outputs' shapes, strides and dtypes
by running the op on fake copies of its inputs (`FakeTensorMode`: meta kernels, no data, no
random draws), and hands the host *placeholders*: ordinary tensors over freshly allocated storage
that nothing writes until the recorded program runs (on CPU an untouched allocation costs address
space, not memory). They are real tensor objects on purpose: autograd saves them, optimizers keep
them as state, the user holds them -- and once the program has run they hold real values.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch._decomp import decomposition_table
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import SymbolicTraceError
from .calls import returns_input_itself
from .modes import torch_reads_unseen
from .source import user_location
from .symbolic_shapes import SymbolicSizes, has_symbolic_metadata


class _QuietDuringFakeRuns(logging.Filter):
    """Drop fake mode's error log of an exception raised in one of our fake runs.

    The exception itself reaches the user; a logged traceback on top of it is noise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.running = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.running, "active", False)


_quiet = _QuietDuringFakeRuns()
logging.getLogger(FakeTensorMode.__module__).addFilter(_quiet)


class DataDependentResult(SymbolicTraceError):
    """The op's result depends on tensor values (`allclose`, `equal`), so no fake run can produce it."""


def storage_key(tensor: torch.Tensor) -> StorageWeakRef | None:
    """A weak, hashable key of the tensor's storage (shared by all its views); None without one."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


@dataclass(frozen=True)
class Placeholder:
    """The storage allocated for one op output, and the output's geometry inside it.

    Held weakly: the placeholder is alive exactly as long as something outside the recorder
    (a returned tensor, `.grad`, optimizer state, a tensor autograd saved, a view) holds its storage.
    """

    storage: StorageWeakRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(tensor: torch.Tensor) -> Placeholder:
        return Placeholder(StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(),
                           tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    def target(self) -> torch.Tensor | None:
        """A tensor over the placeholder's storage with the output's geometry; None once nothing holds it.

        Dispatches ops: call it outside the traced call's modes.
        """
        if self.storage.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        if storage is None:
            return None
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        return empty.set_(storage, self.offset, self.shape, self.stride)


class PlaceholderExecutor:
    """Runs ops on fake copies of their inputs and answers with real placeholder tensors.

    Every tensor the executor hands out keeps its fake twin, so a later op converts only tensors
    from outside the recording (converting a real tensor costs milliseconds, a lookup nothing).
    """

    def __init__(self, sizes: SymbolicSizes | None = None) -> None:
        # symbolic_shape: the fake mode of the recording's ShapeEnv, whose fakes the host holds
        self._sizes = sizes
        self._mode: FakeTensorMode | None = sizes.mode if sizes is not None else None
        self._fakes = WeakIdKeyDictionary()  # real tensor -> its fake twin

    def forget_metadata(self) -> None:
        """Drop the fake twins: code outside the recording may have changed tensors' metadata."""
        if self._sizes is None:
            self._mode = None
        self._fakes = WeakIdKeyDictionary()

    def _hands_out_fake(self, fake: torch.Tensor) -> bool:
        """symbolic_shape: an output whose sizes are symbols stays a fake tensor for the host (its
        Python code sees the SymInts); outputs of fixed size get placeholders as usual."""
        return self._sizes is not None and has_symbolic_metadata(fake)

    def run(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
        """The op's result with placeholders for new outputs and the real inputs for aliased ones.

        Returns (result, the placeholders allocated for it).
        """
        fake_result, real_of_fake = self._run_fake(func, args, kwargs)
        if self._views_an_input(fake_result, real_of_fake, args, kwargs):
            return self.run_view(func, args, kwargs), []
        allocated: dict[int, torch.Tensor] = {}

        def to_real(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            original = real_of_fake.get(id(value))
            if original is not None:  # an in-place or out= op returns the tensor it wrote
                if original.shape != value.shape:
                    raise SymbolicTraceError(
                        f"tracejit: symbolic recording cannot run {func} at {user_location()}: it "
                        f"resizes its output {list(original.shape)} -> {list(value.shape)}, and "
                        f"symbolic=True fills each output's storage only after the call. Pass an output "
                        f"of the right shape, or trace with symbolic=False."
                    )
                return original
            layout = None
            if self._hands_out_fake(value):
                layout = self._sizes.pinned_layout(value)
                if layout is None:
                    return value
            if id(value) not in allocated:
                allocated[id(value)] = placeholder = _allocate_like(value, layout)
                self._fakes[placeholder] = value
            return allocated[id(value)]

        return tree_map(to_real, fake_result), list(allocated.values())

    def _views_an_input(self, fake_result: Any, real_of_fake: dict, args: tuple, kwargs: dict) -> bool:
        """An output in an input's memory from an op whose schema promises a new tensor
        (`broadcast_tensors`, `meshgrid`, `atleast_2d` of a vector under torch.inference_mode()):
        a view, which must be made for real as run_view makes one, not given memory of its own."""
        outputs = [t for t in tree_leaves(fake_result) if isinstance(t, torch.Tensor) and id(t) not in real_of_fake]
        if not outputs:
            return False
        inputs = {fake.untyped_storage()._cdata for fake in (
            t if isinstance(t, FakeTensor) else self._fakes.get(t) for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)) if fake is not None}
        return any(t.untyped_storage()._cdata in inputs for t in outputs)

    def run_view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a view op for real (it computes only metadata) and on the fakes, pairing the outputs."""
        fake_result, _ = self._run_fake(func, args, kwargs)
        if self._sizes is not None and (_any_fake((args, kwargs)) or any(
                self._hands_out_fake(t) and self._sizes.pinned_layout(t) is None for t in tree_leaves(fake_result))):
            return fake_result  # a view of a fake, or of symbolic size: the fake world only
        if self._sizes is not None:  # the layout is pinned, but the arguments may still hold symbols
            args, kwargs = self._sizes.concrete((args, kwargs))
        result = func(*args, **kwargs)
        for real, fake in zip(tree_leaves(result), tree_leaves(fake_result)):
            if isinstance(real, torch.Tensor) and isinstance(fake, torch.Tensor):
                self._fakes[real] = fake
        return result

    def change_metadata(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Apply an op that changes only metadata in place (`unsqueeze_`, `t_`) to fake and real tensor."""
        fake_result, _ = self._run_fake(func, args, kwargs)
        if self._sizes is not None and _any_fake((args, kwargs)):
            return fake_result  # the host's tensor is the fake itself: changed once, by the fake run
        return func(*args, **kwargs)

    def _run_fake(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, dict[int, torch.Tensor]]:
        if self._mode is None:
            # No fallback kernels: an op without a meta implementation must fail here rather than
            # run its real kernel on dummy data.
            self._mode = FakeTensorMode(allow_fallback_kernels=False)
        mode, fakes = self._mode, self._fakes
        if mode.cache_enabled and torch.is_inference_mode_enabled():
            # torch's fake-tensor cache (one for all modes in the process) makes a hit's outputs
            # anew from their metadata: an op returning a view its schema does not declare under
            # inference mode (broadcast_tensors) would come back in memory of its own on a hit
            # after another recording ran it (see _views_an_input)
            mode.cache_enabled = False
        real_of_fake: dict[int, torch.Tensor] = {}

        sizes = self._sizes

        def to_fake(tensor: torch.Tensor) -> torch.Tensor:
            if sizes is not None and isinstance(tensor, FakeTensor):
                real_of_fake[id(tensor)] = tensor
                return tensor  # handed out by this recording: it is its own fake
            fake = fakes.get(tensor)
            if fake is None:
                with torch_reads_unseen():
                    fakes[tensor] = fake = mode.from_tensor(tensor) if sizes is None else sizes.static_fake(tensor)
            real_of_fake[id(fake)] = tensor
            return fake

        # Torch-function handling off: the fake run is our business, not the host's (no host-read hooks).
        with torch._C.DisableTorchFunction():
            fake_args, fake_kwargs = tree_map_only(torch.Tensor, to_fake, (args, kwargs))
            _quiet.running.active = True
            try:
                with mode:
                    # under symbolic sizes, an op whose meta kernel reads int sizes would pin them all
                    run = _SIZE_READING_METAS.get(func, func) if sizes is not None else func
                    if run is not func and not (_pads_somewhere(args) or fake_args[0].is_contiguous()):
                        run = func  # crops a strided input: ATen keeps its layout, the decomposition does not
                    if returns_input_itself(func):
                        # ATen's own kernel, which returns its input itself where the real run does:
                        # fake mode (and func.decompose) take torch._decomp's `dropout`, which copies it
                        run = functools.partial(func._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)
                    return _masked_outputs(func, args, kwargs, run(*fake_args, **fake_kwargs)), real_of_fake
            except (DynamicOutputShapeException, DataDependentOutputException, UnsupportedOperatorException,
                    RuntimeError, ArithmeticError) as error:
                explained = _explain(func, error, self._sizes)
                if explained is error:
                    raise
                raise explained from error
            finally:
                _quiet.running.active = False


def _size_reading_metas() -> dict:
    """Ops whose fake run reads every input size as an int (their C++ shape code), which pins each
    symbol to the recorded size (`F.pad` in a step of varying sequence length recorded a new trace
    per length), with the decomposition that derives their output layout from the symbols; the
    record keeps the op itself."""
    aten = torch.ops.aten
    ops = (aten.constant_pad_nd.default,)  # F.unfold, torch.linspace: still pinned (docs/symbolic.md)
    return {op: decomposition_table[op] for op in ops if op in decomposition_table}


_SIZE_READING_METAS = _size_reading_metas()


def _pads_somewhere(args: tuple) -> bool:
    """`constant_pad_nd(x, pad)` with some amount above 0: ATen then allocates its output in the
    input's suggested memory format, as the decomposition does (with none, it clones a narrowed
    view, keeping the layout, which the decomposition does only if every amount is below 0)."""
    pad = args[1] if len(args) > 1 else ()
    return any(not isinstance(amount, int) or amount > 0 for amount in pad)


def _masked_outputs(func: Any, args: tuple, kwargs: dict, result: Any) -> Any:
    """The backward ops that take an `output_mask` (`native_batch_norm_backward`,
    `native_layer_norm_backward`, `convolution_backward`...) return None where it is False; their
    meta kernels return a tensor there, which the record would keep as a value no real run makes."""
    schema = getattr(func, "_schema", None)
    if schema is None or not isinstance(result, tuple):
        return result
    position = next((i for i, a in enumerate(schema.arguments) if a.name == "output_mask"), None)
    if position is None:
        return result
    mask = kwargs.get("output_mask", args[position] if position < len(args) else None)
    if not isinstance(mask, (list, tuple)) or len(mask) != len(result):
        return result
    return tuple(value if wanted else None for value, wanted in zip(result, mask, strict=True))


def _any_fake(tree: Any) -> bool:
    return any(isinstance(t, FakeTensor) for t in tree_leaves(tree))


def _allocate_like(fake: torch.Tensor, layout: tuple | None = None) -> torch.Tensor:
    """A placeholder with the fake's layout, or `layout` (sizes, strides, offset: a symbolic-size
    fake's, fixed by the guards)."""
    shape, stride, offset = layout if layout is not None else (fake.shape, fake.stride(), fake.storage_offset())
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=fake.dtype, device=fake.device)
    # An output that starts inside its storage: allocate the whole storage, then place the output in it.
    if layout is None:
        nbytes = fake.untyped_storage().nbytes()
    else:
        extent = 0 if 0 in shape else sum((size - 1) * step for size, step in zip(shape, stride)) + 1
        nbytes = (offset + extent) * fake.element_size()
    storage = torch.empty(nbytes, dtype=torch.uint8, device=fake.device).untyped_storage()
    empty = torch.empty(0, dtype=fake.dtype, device=fake.device)
    return empty.set_(storage, offset, shape, stride)


def _explain(func: Any, error: Exception, sizes: SymbolicSizes | None = None) -> Exception:
    """Turn the fake run's "needs data" failures into a SymbolicTraceError; leave user errors alone
    (but with the call's sizes where torch named symbols)."""
    symbolic_sizes = sizes is not None
    where = f"{func} at {user_location()}"
    option, instead = (("symbolic_shape=True", "symbolic_shape=None (the default: such calls record their sizes)")
                       if symbolic_sizes else ("symbolic=True", "symbolic=False"))
    if isinstance(error, ArithmeticError) or (isinstance(error, RuntimeError) and SYMBOLIC_LIMITS.search(str(error))):
        # torch's Python decomposition or a kernel's size handling, not the op itself: eager computes it
        # (mse_loss's backward divides by the numel of an empty batch in Python; F.pad by a computed amount)
        return SymbolicTraceError(
            f"tracejit: {option} cannot record {where}: torch cannot derive its outputs without data at these "
            f"sizes ({type(error).__name__}: {error}). Trace this function with {instead}.")
    if isinstance(error, RuntimeError) and TORCH_INTERNAL.search(str(error)):
        # torch's own fake run broke (arange with a SymFloat step): no user error, eager computes it
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        source = user_location()
        code = f" ({source.code})" if source.code else ""
        return SymbolicTraceError(
            f"tracejit: {option} cannot record {func} at {source}{code}: torch failed an internal check while deriving its "
            f"outputs without data ({type(error).__name__}: {first}). Trace this function with {instead}.")
    if isinstance(error, DynamicOutputShapeException):
        reason = ("the shape of its output depends on the values of its inputs (like nonzero, masked_select "
                  "or indexing with a boolean mask)")
    elif isinstance(error, DataDependentOutputException):
        return DataDependentResult(
            f"tracejit: symbolic recording cannot run {where}: its result depends on the values of its "
            f"inputs, and symbolic=True computes no values while recording. Trace this function with "
            f"symbolic=False, or move the op out of the traced function."
        )
    elif isinstance(error, UnsupportedOperatorException) or "no fake impl" in str(error):
        reason = ("it has no fake (meta) implementation to derive its outputs from; register one with "
                  "torch.library.register_fake")
    else:
        # An error eager execution would raise as well (shapes that do not broadcast, a bad dtype).
        if sizes is not None and len(error.args) == 1 and isinstance(error.args[0], str):
            error.args = (sizes.with_values(error.args[0]),)  # eager's message says sizes, not s77
        if hasattr(error, "add_note"):
            error.add_note(f"tracejit: raised by {where} while {option} derived its outputs without data")
        return error
    return SymbolicTraceError(
        f"tracejit: symbolic recording cannot run {where}: {reason}, and {option} computes no "
        f"values while recording. Trace this function with {instead}, or move the op out of the "
        f"traced function."
    )


# What torch says when a kernel needs concrete sizes where the recording has symbols
SYMBOLIC_LIMITS = re.compile(r"SymInt|SymFloat|symbolic|concrete int")
# What torch says when its own code fails a check (TORCH_INTERNAL_ASSERT): a torch bug, never the user's error
TORCH_INTERNAL = re.compile(r"INTERNAL ASSERT FAILED")
