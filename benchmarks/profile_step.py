"""Where an engine step's host time goes: Engine + ModelRunner on the demo model, no server.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_step.py BATCH [STEPS] [plain]

Adds BATCH short prompts, runs the prefill, then times STEPS decode steps in this thread's CPU time
(time.thread_time, 1 thread: steadier than wall time on a shared machine), split into the model's
forward + lm_head and the rest of the step (scheduling, step tensors, sampling, stop checks, text),
then prints a cProfile of the same number of steps restricted to the engine's modules.
"""
import cProfile
import pstats
import sys
import time

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.sequence import SamplingParams


def main() -> None:
    batch = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    invariant = not (len(sys.argv) > 3 and sys.argv[3] == "plain")
    cfg = EngineConfig(model_path="model", dtype="float32", device_id=-1, max_num_seqs=64,
                       max_num_batched_tokens=2048, max_model_len=None, block_size=16, kv_cache_bytes=1 << 28,
                       num_threads=1, batch_invariant=invariant)
    engine = Engine(cfg)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 4000 for j in range(20 + i % 5)], params)
    engine.step()   # prefill
    engine.step()
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
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(
        r"engine/(engine|sampler|stopping|detok|model_runner|kv_cache|scheduler|output_proc)", 30)


if __name__ == "__main__":
    main()
