"""Recording a call: dispatch-mode recorder, handle table, op sequence, source locations."""

from .record import ExcludedBlock, Flag, HostRead, Kind, OpRecord, OutputSpec, Record, TensorInfo, TensorMeta
from .recorder import Recorder

__all__ = [
    "ExcludedBlock", "Flag", "HostRead", "Kind", "OpRecord", "OutputSpec", "Record", "Recorder",
    "TensorInfo", "TensorMeta",
]
