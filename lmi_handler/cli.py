"""Command line: lmi-handler serve | prepare-model | batch | bench.

Owns argument parsing and process set-up (logging, uvicorn); the work is done elsewhere.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    from lmi_handler.config import read_serving_properties
    from lmi_handler.server.app import create_app
    from lmi_handler.server.ops import serve

    properties = read_serving_properties(args.properties)
    app = create_app(properties)
    serve(app, args.host, args.port, args.log_level.lower())  # uvicorn, draining on SIGTERM
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from lmi_handler.prepare import PrepareError, prepare_model

    try:
        out = prepare_model(args.out, force=args.force)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model ready in {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmi-handler", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve /ping, /invocations and OpenAI routes over HTTP")
    serve.add_argument("--properties", default="serving.properties", type=Path,
                       help="serving.properties file (OPTION_* environment variables override its keys)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", default=8080, type=int)
    serve.set_defaults(func=_serve)

    prepare = sub.add_parser("prepare-model", help="write the demo model (SmolLM2-135M-Instruct) as a plain HF checkpoint")
    prepare.add_argument("--out", default="model", type=Path)
    prepare.add_argument("--force", action="store_true", help="rewrite even when the checkpoint is already there")
    prepare.set_defaults(func=_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
