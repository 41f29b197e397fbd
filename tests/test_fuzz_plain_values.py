"""Fuzzing the comparison that guards plain values without the host (record/names.py): a later
value passes `same_value` against the copy of an earlier one exactly when the two would build the
same program: the same types, floats bit for bit, sets in the same iteration order, numpy arrays
with the same dtype, shape and bytes."""

import math
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tracejit.record.names import plain_copy, plain_value, same_value

_ATOMS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1.5, math.nan, math.inf]),
                   st.text(max_size=2), st.builds(complex, st.sampled_from([0.0, -0.0, 1.0]), st.sampled_from([0.0, 2.0])))
_SETS = st.one_of(st.sets(st.integers(-20, 20), max_size=5), st.frozensets(st.integers(-20, 20), max_size=5),
                  st.sets(st.sampled_from([1, 1.0, 2, 2.0, 9, 17]), max_size=3))
_SHAPED = st.one_of(st.builds(range, st.integers(-2, 3), st.integers(-2, 3), st.sampled_from([1, 2, -1])),
                    st.builds(slice, st.sampled_from([None, 0, 1]), st.sampled_from([None, 2, 3]), st.sampled_from([None, 1, 2])),
                    st.builds(lambda values, dtype: np.array(values, dtype=dtype),
                              st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.5]), max_size=4),
                              st.sampled_from([np.float32, np.float64, np.int64])))
_VALUES = st.recursive(st.one_of(_ATOMS, _SETS, _SHAPED),
                       lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                                               st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)),
                       max_leaves=6)


def _canonical(value):
    """What decides the program a value builds: types, float bits, iteration order, array bytes."""
    if isinstance(value, float):
        return float, struct.pack("<d", value)
    if isinstance(value, complex):
        return complex, struct.pack("<dd", value.real, value.imag)
    if isinstance(value, np.ndarray):
        return np.ndarray, value.dtype.str, value.shape, value.tobytes()
    if isinstance(value, (range, slice)):
        return type(value), _canonical(value.start), _canonical(value.stop), _canonical(value.step)
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value), tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((k, _canonical(v)) for k, v in value.items())
    return type(value), value


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_VALUES, _VALUES)
def test_same_value_against_a_copy_means_the_same_program(first, later):
    if not plain_value(first):
        return
    copy = plain_copy(first)
    assert same_value(first, copy)  # a value is the same as its copy, sets in their order included
    assert same_value(later, copy) == (_canonical(later) == _canonical(first))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.sets(st.integers(-1000, 1000), min_size=2, max_size=6))
def test_a_set_rebuilt_in_another_order_is_another_value(values):
    first = set(values)
    reordered = set(sorted(values, reverse=True))
    copy = plain_copy(first)
    assert same_value(reordered, copy) == (list(reordered) == list(first))
