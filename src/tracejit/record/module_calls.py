"""The torch-level calls a torch.nn module's forward made, and the modules' state when it began.

While the API tracer notes a call, global forward hooks mark where each module call begins and
ends among the torch-level calls. For the module classes below (torch.nn's own, whose forward
is a function of their attributes, parameters and buffers, the input and the call's context),
checked replay at the API level answers the whole module call when that state is unchanged
(runtime/stand_ins.py): the module Python of a small model costs as much as its ops.
"""

from __future__ import annotations

import types
import weakref
from _thread import get_ident
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from .ddp_calls import DdpNote, ddp_refusal, is_ddp
from .own_hooks import own, remove_own

# torch.nn's modules whose forward reads nothing but the module's own attributes, parameters,
# buffers and submodules (no global flags, no Python callables kept as attributes)
STANDALONE = frozenset({
    nn.Linear, nn.Bilinear, nn.Identity, nn.Flatten, nn.Unflatten, nn.Embedding,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh,
    nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Softmax, nn.LogSoftmax, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Sequential,
    # their forward also reads the grad mode, autocast and torch.backends.mha's fast-path flag, and
    # whether a torch function mode is on: a checked call runs under one (the fast path is off, as
    # when the call was recorded), and the rest is the call context's; the activation they keep is a
    # function compared by identity, as every module setting is
    nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
    nn.TransformerDecoder, nn.modules.linear.NonDynamicallyQuantizableLinear, nn.ModuleList,
})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# the methods of these classes their forward may call (their own and their torch.nn bases'): a
# library patching one on the class (LoRA, another attention kernel, `nn.Conv2d._conv_forward`)
# changes what a call computes (the stand-in's check compares them with torch's own,
# runtime/stand_ins.py)
_NOT_CALLED_BY_FORWARD = frozenset({"extra_repr", "reset_parameters", "reset_running_stats", "_reset_parameters",
                                    "_load_from_state_dict", "_save_to_state_dict", "_init_weights"})


def _forward_methods(cls: type) -> dict[str, object]:
    found: dict[str, object] = {}
    for base in cls.__mro__:
        if base is nn.Module or not issubclass(base, nn.Module):
            break
        for name, value in vars(base).items():
            if (isinstance(value, types.FunctionType) and name not in found and name not in _NOT_CALLED_BY_FORWARD
                    and not (name.startswith("__") and name.endswith("__"))):
                found[name] = value
    return found


CLASS_METHODS = {cls: _forward_methods(cls) for cls in STANDALONE}
# held separately (parameters, buffers, submodules) or only for state_dict()
_NOT_FORWARD_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


@dataclass
class ModuleState:
    """One module of a subtree: its attributes, with tensors and modules by identity."""

    module: weakref.ref
    attributes: dict[str, Any]  # name -> value, except the hook dicts
    parameters: dict[str, Any]
    buffers: dict[str, Any]
    children: dict[str, weakref.ref]
    keys: frozenset = frozenset()  # of its __dict__: one set since may shadow a method of the class


@dataclass
class ModuleCall:
    module: weakref.ref
    start: int  # the index of the first torch-level call of the module's forward
    end: int = -1  # one past its last
    args: Any = None  # templates (record/api.py): tensors as references
    kwargs: Any = None
    result: Any = None
    snapshot: list[ModuleState] = field(default_factory=list)  # the module first, then its submodules
    refused: str | None = None
    ddp: DdpNote | None = None  # a DistributedDataParallel call (record/ddp_calls.py)


def global_hook_dicts() -> tuple[dict, ...]:
    """The dicts of hooks registered for every module, which run user code around each forward
    (torch.nn adds to and removes from them, never replaces them)."""
    return (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks,
            module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks)



def _refusal(module: nn.Module) -> str | None:
    for sub in module.modules():
        if type(sub) not in STANDALONE:
            return f"{type(sub).__qualname__} is not one of torch.nn's modules the API level answers whole"
        if "forward" in sub.__dict__:
            return "its forward was replaced"
        shadowing = next((k for k, v in sub.__dict__.items() if callable(v) and not isinstance(v, nn.Module)
                          and k != "activation" and hasattr(type(sub), k)), None)
        if shadowing is not None:
            return f"its method {shadowing} was replaced on the instance"
        methods = CLASS_METHODS.get(type(sub), {})
        if any(getattr(type(sub), name, None) is not function for name, function in methods.items()):
            return f"a method of {type(sub).__qualname__} was replaced on the class"
        activation = sub.__dict__.get("activation")
        if callable(activation) and not isinstance(activation, nn.Module) and not _torch_function(activation):
            # Python the forward calls, which may read anything (a global slope)
            return f"its activation {getattr(activation, '__qualname__', activation)!r} is not one of torch's"
        if any(getattr(sub, name) for name in _HOOKS):
            return "it has hooks"
    return None


def _torch_function(function: object) -> bool:
    """One of torch's own functions (F.relu, F.gelu, torch.tanh), not a function of the user's."""
    module = getattr(function, "__module__", None) or getattr(getattr(function, "__self__", None), "__name__", "")
    return isinstance(module, str) and (module == "torch" or module.startswith(("torch.", "torch._C")))


def _state(module: nn.Module) -> ModuleState:
    attributes = {k: v for k, v in module.__dict__.items()
                  if k not in _NOT_FORWARD_STATE and "hooks" not in k}
    return ModuleState(weakref.ref(module), attributes, dict(module._parameters), dict(module._buffers),
                       {k: weakref.ref(v) for k, v in module._modules.items() if v is not None}, frozenset(module.__dict__))


class ModuleCalls:
    """Global forward hooks that follow module calls while the API tracer notes a call."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.open: list[ModuleCall | None] = []  # None: a call inside one that may be answered, or a user's module
        self.found: list[ModuleCall] = []
        self.handles: list = []
        self.thread = get_ident()  # the hooks are process-wide: another thread's module calls are not this call's

    def install(self) -> None:
        self.thread = get_ident()
        self.handles = [own(nn.modules.module.register_module_forward_pre_hook(self._begin)),
                        own(nn.modules.module.register_module_forward_hook(self._end, with_kwargs=True))]

    def remove(self) -> None:
        for handle in self.handles:
            remove_own(handle)
        self.handles = []

    def _begin(self, module: nn.Module, args: tuple) -> None:
        if get_ident() != self.thread:
            return
        if any(call is not None for call in self.open):
            self.open.append(None)  # inside a module call that may be answered whole
            return
        if is_ddp(module):  # answered whole or not at all: its forward drives the reducer
            call = ModuleCall(weakref.ref(module), len(self.tracer.trace.calls), ddp=DdpNote(torch.is_grad_enabled()))
            call.refused = ddp_refusal(module, _refusal)
            call.snapshot = [] if call.refused else [_state(sub) for sub in module.modules()]
            self.open.append(call)
            return
        if _refusal(module) is not None:  # a user's module runs; its torch.nn submodules may be answered
            self.open.append(None)
            return
        call = ModuleCall(weakref.ref(module), len(self.tracer.trace.calls))
        call.snapshot = [_state(sub) for sub in module.modules()]
        self.open.append(call)

    def _end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.open or get_ident() != self.thread:
            return
        call = self.open.pop()
        if call is None or call.module() is not module:
            return
        call.end = len(self.tracer.trace.calls)
        if call.ddp is not None:
            call.ddp.forward_sync_after = module.__dict__.get("require_forward_param_sync")
        try:
            call.args = self.tracer._template(args)
            call.kwargs = {k: self.tracer._template(v) for k, v in kwargs.items()}
            call.result = self.tracer._template(output)
        except Exception:  # noqa: BLE001 - a value the templates cannot hold: the call runs for real
            call.refused = call.refused or "its arguments or result cannot be followed"
        self.found.append(call)

