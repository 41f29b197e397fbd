"""Bounds a loaded file must stay within, checked before anything is allocated or run.

They are far above any graph tracejit dumps for a single machine and far below what would let
a hostile file exhaust memory or time: a file that exceeds one is refused with `LoadError`.
"""

MAX_TOTAL_BYTES = 1 << 36  # all members together, uncompressed (64 GiB)
MAX_GRAPH_JSON_BYTES = 1 << 28  # graph.json uncompressed (256 MiB)
MAX_COMPRESSION_RATIO = 200  # uncompressed / compressed size of a member larger than RATIO_CHECK_BYTES
RATIO_CHECK_BYTES = 1 << 20
MAX_NDIM = 32
MAX_NUMEL = 1 << 36  # elements of any one tensor or value
MAX_OPS = 1 << 20
MAX_VALUES = 1 << 22
MAX_GRAPHS = 1024
MAX_NAME_LENGTH = 512
MAX_TESTCASES = 1024
