"""`fusion-compiler`: the command line.

    fusion-compiler inspect [MODEL | --hf-config FILE.json] [--size tiny|real] [--layers N]
                            [--device cpu|cuda] [--batch B] [--context N] [--json OUT] [--plot OUT.png]
                            [--explain] [-v]
    fusion-compiler support [--out FILE.md] [--models LABEL ...] [-v]

The table goes to stdout; stderr gets one line per step as it runs (inspect/terminal.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys

MODELS = ("deepseek-v3.2", "minimax-m2.5", "qwen3.5")


class UsageError(Exception):
    """A bad argument: printed with the usage, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion-compiler", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="kernels per layer, matches and misses for one decode step")
    p.add_argument("model", nargs="?", choices=MODELS, help="one of our target models")
    p.add_argument("--hf-config", metavar="FILE.json", help="any transformers config JSON with a model_type")
    p.add_argument("--size", choices=("tiny", "real"), help="default: tiny on cpu, real on cuda")
    p.add_argument("--layers", type=int, help="default: smallest stack holding every layer kind")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=16, help="tokens prefilled before the decode step")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a bar chart of kernels per layer")
    p.add_argument("--explain", action="store_true",
                   help="for every miss, the FX nodes from the site's anchor to where the pattern diverged")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also the compiler's log for every compile and the warnings of Dynamo, Inductor and transformers")
    p.set_defaults(subparser=p)  # a usage error prints this command's usage, as argparse's own do
    from .inspect.support_models import models

    s = sub.add_parser("support", help="every supported model through inspect on CPU: a Markdown table (docs/SUPPORT.md)")
    s.add_argument("--out", metavar="FILE.md", help="write the table there (docs/SUPPORT.md is the committed one)")
    s.add_argument("--models", nargs="+", metavar="LABEL", choices=[label for label, _ in models()],
                   help="only these rows (default: all)")
    s.add_argument("-v", "--verbose", action="store_true", help="as inspect's -v")
    s.set_defaults(subparser=s)
    return parser


def _adapter(args):
    from .model_adapters import adapter_from_hf_config, get_adapter

    if (args.model is None) == (args.hf_config is None):
        raise UsageError("give exactly one of MODEL or --hf-config")
    if args.hf_config:
        try:
            return adapter_from_hf_config(args.hf_config)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return get_adapter(args.model)


def _writable(flag: str, path: str) -> None:
    """Checked before the run, which takes minutes: a path that cannot be written fails now."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def _check_arguments(args) -> None:
    """Every check that needs no model, before anything is built."""
    for flag, value in (("--layers", args.layers), ("--batch", args.batch), ("--context", args.context)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.json:
        _writable("--json", args.json)
    if args.plot:
        _writable("--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib (pip install 'fusion-compiler[bench]')")


def _inspect(args) -> int:
    _check_arguments(args)
    adapter = _adapter(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
    size = args.size or ("real" if args.device == "cuda" else "tiny")
    layers = args.layers if args.layers is not None else adapter.default_layers
    from .inspect.run import format_table, inspect_model, plot
    from .inspect.terminal import Terminal

    terminal = Terminal(verbose=args.verbose)
    with terminal.capture():
        result = inspect_model(
            adapter, size, layers, args.device, batch=args.batch, context=args.context, progress=terminal.progress
        )
        print(format_table(result, explain=args.explain))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if args.plot:
            plot([result], args.plot)
    return 0


def _support(args) -> int:
    if args.out:
        _writable("--out", args.out)
    from .inspect.support import markdown, provenance, run_all
    from .inspect.terminal import Terminal

    terminal = Terminal(verbose=args.verbose)
    with terminal.capture():
        table = markdown(run_all(progress=terminal.progress, only=args.models), provenance())
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return _support(args) if args.command == "support" else _inspect(args)
    except UsageError as e:
        args.subparser.print_usage(sys.stderr)
        print(f"{args.subparser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
