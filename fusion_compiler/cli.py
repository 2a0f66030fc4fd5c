"""`fusion-compiler`: the command line.

    fusion-compiler inspect [MODEL | --hf-config FILE.json] [--size tiny|real] [--layers N]
                            [--device cpu|cuda] [--batch B] [--json OUT] [--plot OUT.png] [--explain]
"""

from __future__ import annotations

import argparse
import json
import logging
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
    p.add_argument("-v", "--verbose", action="store_true", help="log each mode as it runs")
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


def _inspect(args) -> int:
    adapter = _adapter(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
    size = args.size or ("real" if args.device == "cuda" else "tiny")
    layers = args.layers if args.layers is not None else adapter.default_layers
    if layers < 1:
        raise UsageError(f"--layers must be >= 1, got {layers}")
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    from .inspect.run import format_table, inspect_model, plot

    progress = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.verbose else (lambda msg: None)
    result = inspect_model(adapter, size, layers, args.device, batch=args.batch, context=args.context, progress=progress)
    print(format_table(result, explain=args.explain))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot([result], args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return _inspect(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"fusion-compiler: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
