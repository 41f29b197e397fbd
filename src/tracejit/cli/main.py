"""`tracejit demo|...`: argument parsing and dispatch to the subcommands."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tracejit", description="tracejit: a tracing JIT for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small classifier traced next to eager")
    demo.add_argument("--steps", type=int, default=200, help="training steps per system")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(steps=args.steps)
    return 2
