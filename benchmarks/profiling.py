"""Where the time goes: profiles of the engine and its kernels on the benchmark's workload (no server).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profiling.py COMMAND [options]      (COMMAND --help: its options)

breakdown    one decode step, component by component (engine parts, then the forward's ops)
steps        the offline run's wall time, step by step (prefill apart from decode; CPU time beside wall time)
fixed-costs  what a batch-1 decode step costs besides streaming its weights (against a same-geometry skeleton)
kernels      the batch-invariant CPU kernels against MKL and the tiled path; --dtypes: batch-1 decode per dtype
grammar      the two grammar libraries (llguidance, xgrammar): tokenizer set-up, compile time, per-step mask cost

Each command is a module of profiling_commands/ (breakdown.py, steps.py, fixed_costs.py, kernels.py,
grammar.py); this file only dispatches.

(Named profiling.py, not profile.py: a benchmarks/profile.py would shadow the standard library's `profile`,
which cProfile imports, for every script run from benchmarks/.)
"""
from __future__ import annotations

import sys
from pathlib import Path

from profiling_commands import breakdown, fixed_costs, grammar, kernels, steps

COMMANDS = {
    "breakdown": (breakdown.breakdown_main, breakdown.BREAKDOWN_DOC),
    "steps": (steps.steps_main, steps.STEPS_DOC),
    "fixed-costs": (fixed_costs.fixed_costs_main, fixed_costs.FIXED_COSTS_DOC),
    "kernels": (kernels.kernels_main, kernels.KERNELS_DOC),
    "grammar": (grammar.grammar_main, grammar.GRAMMAR_DOC),
}


def run_command(commands: dict, doc: str, argv: list[str] | None = None) -> None:
    """`TOOL COMMAND [its options]` over `commands` (name -> (main, doc)); no command or --help prints `doc`,
    an unknown one exits naming the known ones. Shared by profiling.py and ab.py."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return
    if argv[0] not in commands:
        sys.exit(f"unknown command {argv[0]!r}: one of {', '.join(commands)} (--help says what each measures)")
    run, _ = commands[argv[0]]
    sys.argv[0] = f"{Path(sys.argv[0]).name} {argv[0]}"      # the command's --help and errors name it
    run(argv[1:])


def main(argv: list[str] | None = None) -> None:
    """`profiling.py COMMAND [its options]`; `profiling.py COMMAND --help` for a command's own."""
    run_command(COMMANDS, __doc__, argv)


if __name__ == "__main__":
    main()
