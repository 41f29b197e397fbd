"""The code blocks of the docs that show a complete use run as written."""

import contextlib
import io
import os
import re

import torch

import tracejit

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def python_block_after(doc: str, heading: str) -> str:
    text = open(os.path.join(DOCS, doc), encoding="utf-8").read()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_guides_exclude_from_trace_example_runs():
    # it used an undefined `i`
    source = python_block_after("guide.md", "## exclude_from_trace")
    namespace = {"torch": torch, "tracejit": tracejit}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "guide.md", "exec"), namespace)
    assert [line.split(":")[0] for line in printed.getvalue().splitlines()] == ["step 0", "step 100", "step 200"]
    f = namespace["f"]
    assert f.stats.records == 1 and f.stats.checked_replays == 299
