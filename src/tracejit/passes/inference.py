"""The inference pipeline: the passes `dump(optimize_for_inference=True)` runs before writing.

A dumped graph keeps no Python state (no `.grad`, no optimizer state): only its outputs matter,
so dead code elimination removes whatever served training (backward ops, saved statistics).
Elementwise grouping, Linear+ReLU fusion and memory planning are left to load time, where the
local backend's `pipeline()` runs on the loaded graph.
"""

from __future__ import annotations

from . import Pass
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold_batchnorm import fold_batchnorm
from .fold_constants import fold_constants
from .noop import remove_noop_views

# (minimum opt_level, pass), in order; run_pipeline runs them at any level.
INFERENCE_PIPELINE: list[tuple[int, Pass]] = [
    # Step 1: aliases nobody needs (detach, alias) become the value they alias.
    (0, remove_noop_views),
    # Step 2: ops on weights alone (the transpose of a Linear weight) are computed once, at dump time.
    (0, fold_constants),
    # Step 3: eval-mode BatchNorm after a convolution or Linear joins its weights.
    (0, fold_batchnorm),
    # Step 4: identical pure ops on identical inputs run once.
    (0, eliminate_common_subexpressions),
    # Step 5: everything the outputs do not need disappears, the folded weights' originals included.
    (0, eliminate_dead_code),
]
