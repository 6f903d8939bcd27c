"""Where an engine step's host time goes: Engine + ModelRunner on the demo model, no server.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_step.py BATCH [STEPS] [plain] [json]

Adds BATCH short prompts, runs the prefill, then times STEPS decode steps in this thread's CPU time
(time.thread_time, 1 thread: steadier than wall time on a shared machine), split into the model's
forward + lm_head and the rest of the step (scheduling, step tensors, sampling, stop checks, text),
then prints a cProfile of the same number of steps restricted to the engine's modules. With `json`, every
request carries a JSON schema (benchmarks/structured.py, compiled before the timed steps) and the grammar's
share of the step (the bitmask fill on llguidance's threads, waited for by this one; the mask applied to the
logits; the matchers fed the sampled tokens) is timed apart, in wall time (the fill runs on other threads).
"""
import cProfile
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.sequence import SamplingParams


def main() -> None:
    batch = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    invariant = "plain" not in sys.argv[3:]
    constrained = "json" in sys.argv[3:]
    cfg = EngineConfig(model_path="model", dtype="float32", device_id=-1, max_num_seqs=64,
                       max_num_batched_tokens=2048, max_model_len=None, block_size=16, kv_cache_bytes=1 << 28,
                       num_threads=1, batch_invariant=invariant)
    engine = Engine(cfg)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    schemas = []
    if constrained:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from structured import build_schemas, schema_text

        from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec

        schemas = [StructuredOutputSpec(GrammarKind.JSON_SCHEMA, schema_text(s))
                   for s in build_schemas([f"question {i}" for i in range(batch)])]
        for spec in schemas:
            engine.grammars.validate(spec)   # compiled (and cached) before the engine sees the requests
    for i in range(batch):
        row = replace(params, structured_output=schemas[i]) if schemas else params
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 4000 for j in range(20 + i % 5)], row)
    engine.step()   # prefill
    engine.step()
    grammar = _time_grammar(engine) if constrained else None
    forward = [0.0]
    model = engine.runner.model

    def timed(fn):
        def wrap(*args, **kwargs):
            start = time.thread_time()
            out = fn(*args, **kwargs)
            forward[0] += time.thread_time() - start
            return out
        return wrap

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    start = time.thread_time()
    for _ in range(steps):
        engine.step()
    total = (time.thread_time() - start) / steps
    print(f"batch {batch} batch_invariant={invariant}: step {total * 1e3:.1f} ms CPU, forward + lm_head "
          f"{forward[0] / steps * 1e3:.1f} ms, rest of the step {(total - forward[0] / steps) * 1e3:.2f} ms")
    if grammar is not None:
        print("grammar per step (wall ms): " + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in grammar.items()))
        for key in grammar:
            grammar[key] = 0.0
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(
        r"engine/(engine|sampler|stopping|detok|model_runner|kv_cache|scheduler|output_proc)", 30)


def _time_grammar(engine) -> dict[str, float]:
    """Wrap the grammar's parts of a step with wall-clock timers; returns the running totals (seconds)."""
    from lmi_handler.engine import grammar as grammar_mod
    from lmi_handler.engine import sampler as sampler_mod

    totals = {"fill_bitmask": 0.0, "apply_mask": 0.0, "advance": 0.0}

    def timed(key, fn):
        def wrap(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[key] += time.perf_counter() - start
            return out
        return wrap

    engine.grammars.fill_bitmask = timed("fill_bitmask", engine.grammars.fill_bitmask)
    sampler_mod.apply_token_bitmask = timed("apply_mask", sampler_mod.apply_token_bitmask)
    grammar_mod.GrammarState.advance = timed("advance", grammar_mod.GrammarState.advance)
    return totals


if __name__ == "__main__":
    main()
