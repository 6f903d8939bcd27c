"""Command line: lmi-handler serve | prepare-model | batch (the benchmark is benchmarks/bench.py, `make bench`).

Owns argument parsing and process set-up (logging, uvicorn); the work is done elsewhere.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    """Exit code 2 with one line naming the option when a setting is refused at start-up (ConfigError)."""
    from lmi_handler.config import ConfigError, read_serving_properties
    from lmi_handler.server.app import create_app
    from lmi_handler.server.ops import serve

    properties = read_serving_properties(args.properties)
    try:
        app = create_app(properties)
        # a Hub id is fetched (or found in the Hub cache) before the server starts: a missing one exits here
        logging.getLogger(__name__).info("model directory: %s", app.state.settings.model_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        serve(app, args.host, args.port, args.log_level.lower())  # uvicorn, draining on SIGTERM
    except SystemExit:
        if not isinstance(app.state.front_end.init_error, ConfigError):
            raise
    # refused while the engine is built (option.max_model_len past the model's, a kernel_backend that cannot
    # run here, an adapter that does not load): the same one line and status 2 as the refusals above
    if isinstance(app.state.front_end.init_error, ConfigError):
        print(f"error: {app.state.front_end.init_error}", file=sys.stderr)
        return 2
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


def _batch(args: argparse.Namespace) -> int:
    from lmi_handler.batch.cluster import LOCAL, ClusterError, ClusterPlan, run_on_ray
    from lmi_handler.batch.runner import BatchRejected, BatchRunner, EngineFailed
    from lmi_handler.config import ConfigError, Settings, read_serving_properties
    from lmi_handler.protocol.batch_lines import BatchDefaults, read_batch
    from lmi_handler.protocol.errors import RequestValidationError
    from lmi_handler.service import Service

    if (args.address or args.replicas or args.shard_lines) and not args.ray:
        print("error: --address, --replicas and --shard-lines go with --ray", file=sys.stderr)
        return 2
    try:
        defaults = BatchDefaults.parse({"max_decoding_length": args.max_decoding_length,
                                        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k})
    except RequestValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.input.is_file():
        print(f"error: no such input file: {args.input}", file=sys.stderr)
        return 2
    with open(args.input, encoding="utf-8", errors="replace") as lines:
        rejection = read_batch(lines, defaults).rejection()   # before the model loads: no work at all
    if rejection:
        print(f"error: batch rejected, nothing was run: {rejection}", file=sys.stderr)
        return 2
    try:    # a refused option, or a Hub id neither cached nor reachable (model_path fetches it once)
        settings = Settings.from_properties(read_serving_properties(args.properties))
        model_path = settings.model_path
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not (model_path / "config.json").is_file():   # e.g. run outside the checkout
        print(f"error: no model at {model_path} (from {args.properties}): pass --properties "
              "PATH/serving.properties, or run where serving.properties names a prepared model", file=sys.stderr)
        return 2
    try:
        plan = ClusterPlan(address=args.address or LOCAL, replicas=args.replicas or ClusterPlan.replicas,
                           shard_lines=args.shard_lines or ClusterPlan.shard_lines, replica_cpus=args.replica_cpus,
                           replica_gpus=args.replica_gpus)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.ray:
            summary = run_on_ray(settings, args.input, args.output, args.errors, defaults, plan,
                                 progress=not args.quiet)
        else:
            summary = BatchRunner(Service(settings)).run(args.input, args.output, args.errors, defaults,
                                                         progress=not args.quiet)
    except BatchRejected as exc:
        print(f"error: batch rejected, nothing was run: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:     # refused when the engine is built (option.max_model_len past the model's, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (EngineFailed, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"batch done: {summary.total} lines, {summary.completed} completed, {summary.failed} failed "
          f"({summary.already_done} already done before this run); {summary.output_tokens} output tokens in "
          f"{summary.elapsed_s:.1f} s ({summary.output_tokens_per_s:.1f} tok/s)", file=sys.stderr)
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

    batch = sub.add_parser("batch", help="run a JSONL file of OpenAI batch requests offline (results by custom_id)")
    batch.add_argument("input", type=Path, help="batch input JSONL: {custom_id, method, url, body} per line")
    batch.add_argument("-o", "--output", required=True, type=Path,
                       help="output JSONL (OpenAI batch output records); rerun to finish an interrupted run")
    batch.add_argument("--errors", type=Path, help="failed lines go here (default: the output file)")
    batch.add_argument("--max-decoding-length", type=int,
                       help="output tokens of lines with neither max_completion_tokens nor max_tokens")
    batch.add_argument("--temperature", type=float, help="default for lines without one (absent: greedy)")
    batch.add_argument("--top-p", type=float, help="default for lines without one (absent: 1.0)")
    batch.add_argument("--top-k", type=int, help="default for lines without one (absent or 0: off; 1: argmax)")
    batch.add_argument("--properties", default="serving.properties", type=Path,
                       help="serving.properties file (OPTION_* environment variables override its keys)")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    ray = batch.add_argument_group("Ray", "shard the file over engine replicas on a Ray cluster (pip install .[ray])")
    ray.add_argument("--ray", action="store_true",
                     help="run on Ray: without --address, a local cluster of this job on 127.0.0.1 only")
    ray.add_argument("--address", help="join a running cluster (`ray start --head`): auto, or HOST:PORT of its head")
    ray.add_argument("--replicas", type=_positive, help="engine replicas, one Ray actor each (default 2)")
    ray.add_argument("--shard-lines", type=_positive,
                     help="input lines per shard, the unit of work a replica runs and a failure recomputes "
                          "(default 500)")
    ray.add_argument("--replica-cpus", type=float, default=1.0,
                     help="Ray CPUs each replica asks for (default 1; set option.num_threads to match)")
    ray.add_argument("--replica-gpus", type=float, default=0.0,
                     help="Ray GPUs each replica asks for (default 0; option.tensor_parallel_degree of them for "
                          "a sharded model)")
    batch.set_defaults(func=_batch)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _restart_with_malloc_huge_pages(properties: Path) -> None:
    """Before anything else runs: start this command again with glibc malloc's heap on huge pages
    (engine/host_memory.py) unless option.malloc_tuning or option.huge_pages is off. Settings the engine
    will refuse are left for it to report."""
    from lmi_handler.config import Settings, read_serving_properties
    from lmi_handler.engine.host_memory import restart_with_malloc_huge_pages

    logging.disable(logging.WARNING)    # the command itself reports the options (it may run twice)
    try:
        settings = Settings.from_properties(read_serving_properties(properties))
    except Exception:  # noqa: BLE001 - the command itself reports a bad file or setting
        return
    finally:
        logging.disable(logging.NOTSET)
    restart_with_malloc_huge_pages(settings.malloc_tuning, settings.huge_pages)


def main(argv: list[str] | None = None) -> int:
    """argv None: the process's own command line (`lmi-handler ...`), which serve and batch may restart
    once (_restart_with_malloc_huge_pages); a list (tests, callers in process) never restarts."""
    args = build_parser().parse_args(argv)
    if argv is None and args.func in (_serve, _batch):
        _restart_with_malloc_huge_pages(args.properties)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
