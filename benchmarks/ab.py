"""A/B by phase, interleaved: this checkout against a git revision (or, for prefill, two forms of one step).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py COMMAND [options]      (COMMAND --help: its options)

linears    the packed linear, weights from DRAM (30 layers' worth, a decode step's call order), old vs new kernels
attention  the paged-attention kernel: bitwise check on small cases, then a decode step's 30 layer calls
prefill    one step's forward: the fused decoder stack against the same C++ ops called one by one (no revision)
batch1     batch-1 (or small-batch) decode steps of a ModelRunner, old vs new kernels in one process
engine     whole-engine batch-1 decode (scheduler, sampler, output processing too), two worker processes
lora       64 requests over 4 LoRA adapters against the same 64 on the base model, in one engine (no revision)

Each side takes turns with the other, the order flipping each round, so both see the same minutes of the host;
read the medians and the per-round ratios, and rerun when the load average was high.

Each command is a module of ab_commands/ (batch1.py, linears.py, attention.py, prefill.py, engine.py, lora.py;
revision.py builds another revision's kernels); this file only dispatches.
"""
from __future__ import annotations

from ab_commands import attention, batch1, engine, linears, lora, prefill
from profiling import run_command

COMMANDS = {
    "batch1": (batch1.batch1_main, batch1.BATCH1_DOC),
    "linears": (linears.linears_main, linears.LINEARS_DOC),
    "attention": (attention.attention_main, attention.ATTENTION_DOC),
    "prefill": (prefill.prefill_main, prefill.PREFILL_DOC),
    "engine": (engine.engine_main, engine.ENGINE_DOC),
    "lora": (lora.lora_main, lora.LORA_DOC),
}


def main(argv: list[str] | None = None) -> None:
    """`ab.py COMMAND [its options]`; `ab.py COMMAND --help` for a command's own."""
    run_command(COMMANDS, __doc__, argv)


if __name__ == "__main__":
    main()
