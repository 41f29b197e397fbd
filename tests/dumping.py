"""Helpers for the dump/load tests: traced inference functions and running code in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import tracejit

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def infer(x, *, model):
    with torch.no_grad():
        return model(x)


def traced_inference(model, x, **options):
    """A capture_as_const trace of `model` in eval mode, called once on `x`."""
    model.eval()
    traced = tracejit.trace(infer, capture_as_const=True, **options)
    traced(x, model=model)
    return traced


def fresh_python(code: str, *args: str, cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter that sees only the installed tracejit (not the tests)."""
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def tracejit_cli(*args: str, cwd: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "tracejit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])
