"""`tracejit run|show|demo`: argument parsing, dispatch, and one-line errors.

A user error (a bad file, a bad input spec, a missing path) prints one line, `tracejit: error:
...`, and exits with status 1; argparse's own usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import LoadError
from ..options import BACKENDS
from .demo import MIN_STEPS, WARMUP_STEPS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracejit", description="tracejit: a tracing JIT for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="load a dumped graph and run it: latency, throughput, checks, profile")
    run.add_argument("file", help="a file written by traced.dump()")
    run.add_argument("--input", action="append", default=[], metavar="NAME=SPEC",
                     help="data for an input: #rand(min,max[,shape...]) or a .npy file (repeatable); "
                          "default: the first embedded test case, else #rand(0,1)")
    run.add_argument("--iters", type=int, default=10, help="timed calls (default 10)")
    run.add_argument("--warmup", type=int, default=2, help="untimed calls before them (default 2)")
    run.add_argument("--check", action="store_true", help="run the embedded test cases against their reference "
                                                          "outputs; exit 1 if one is off by more than its maxerr")
    run.add_argument("--profile", action="store_true", help="time every node and print the profile table")
    run.add_argument("--backend", default="auto", choices=BACKENDS, help="fused-kernel backend (default auto)")
    run.add_argument("--graph", help="which graph of a file holding several")

    show = commands.add_parser("show", help="inputs, outputs, op counts, parameters and the graph of a dumped file")
    show.add_argument("file", help="a file written by traced.dump()")
    show.add_argument("--dot", action="store_true", help="print the graph in graphviz DOT instead")
    show.add_argument("--graph", help="which graph of a file holding several (default: all)")

    demo = commands.add_parser("demo", help="train a small classifier traced next to eager, dump, load, run it")
    demo.add_argument("--steps", type=int, default=200, help=f"training steps per system (default 200, at least {MIN_STEPS})")
    demo.add_argument("--out", metavar="PATH", help="where to write the dumped classifier: a file, or a directory "
                                                    "for classifier.tjit (default: classifier.tjit here)")
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from .run import run_file

        return run_file(args)
    if args.command == "show":
        from .show import show_file

        return show_file(args)
    from .demo import run_demo

    return run_demo(steps=args.steps, out=args.out)


_LEAST = {"iters": 0, "warmup": 0, "steps": MIN_STEPS}
_WHY_LEAST = {"steps": f" ({WARMUP_STEPS} untimed warm-up steps per system, then at least one timed)"}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name, least in _LEAST.items():
        if getattr(args, name, least) < least:
            print(f"tracejit: error: --{name} must be >= {least}{_WHY_LEAST.get(name, '')}", file=sys.stderr)
            return 2
    try:
        return _dispatch(args)
    except BrokenPipeError:
        return _reader_went_away()
    except (LoadError, ValueError, TypeError, OSError) as error:
        print(f"tracejit: error: {_one_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tracejit: interrupted", file=sys.stderr)
        return 130


def _reader_went_away() -> int:
    """The output's reader stopped reading (`tracejit show f.tjit --dot | head`): nothing is
    wrong, say nothing. Python would report the broken pipe again when it flushes stdout at exit,
    so stdout goes to /dev/null first. The status is the shell's for a process killed by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    return " ".join(str(error).split())
