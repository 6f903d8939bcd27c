"""`ab.py lora`: 64 requests over 4 LoRA adapters against the same 64 on the base model, in one engine.

A command of benchmarks/ab.py, which calls lora_main; `ab.py lora --help` prints LORA_DOC.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from workers import drop_prefix_cache
from workload import REPO, build_workload

LORA_DOC = """Interleaved A/B of LoRA's cost (issue 41): 64 requests over 4 adapters against the same 64 on the base model.

One process, one engine (the benchmark's offline settings: 64 sequences, 2048 tokens a step, 1 GiB KV cache,
option.enable_lora with max_loras 4), four random rank-`--rank` PEFT adapters on q/v/o/gate/down written to a
temporary folder and loaded. Each round runs the workload twice, the order flipping each round, the prefix cache
emptied before each run: all 64 MT-bench prompts (chat template) on the base, then the same 64 with request i on
adapter i % 4. Every request is greedy, `--max-new-tokens` tokens with ignore_eos, so both runs generate the
same number of tokens. Prints each run's output tok/s per round, their medians and lora / base (the issue's
target: at least 0.8).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ab.py lora [--dtype fp32] [--threads 2] [--rounds 3]
"""

LORA_ADAPTERS = ("a0", "a1", "a2", "a3")
LORA_MODULES = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "gate_proj": "mlp",
           "down_proj": "mlp"}    # the projections the adapters change, and where PEFT names them


def write_lora_adapter(path: Path, config: dict, rank: int, seed: int) -> None:
    """A random LoRA adapter of the model's `config` (config.json) in PEFT's layout, non-zero A and B."""
    from safetensors.torch import save_file

    from lmi_handler.engine.model.lora import base_module_shapes

    shapes, generator, tensors = base_module_shapes(config), torch.Generator().manual_seed(seed), {}
    for layer in range(config["num_hidden_layers"]):
        for module, sublayer in LORA_MODULES.items():
            in_features, out_features = shapes[module]
            name = f"base_model.model.model.layers.{layer}.{sublayer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(LORA_MODULES)}))


def lora_main(argv=None) -> None:
    p = argparse.ArgumentParser(description=LORA_DOC.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the engine's dtype (activations, KV cache)")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each runs the base and the LoRA workload once")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    args = p.parse_args(argv)

    from lmi_handler.config import EngineConfig, LoraConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.sequence import SamplingParams

    model = REPO / "model"
    work = build_workload(model, 64, args.max_new_tokens)
    config = json.loads((model / "config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed, name in enumerate(LORA_ADAPTERS):
            write_lora_adapter(root / name, config, args.rank, seed)
        lora = LoraConfig(max_loras=4, max_lora_rank=max(16, args.rank), max_cpu_loras=4, adapter_roots=(root,))
        engine = Engine(EngineConfig(model_path=model, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                                     device_id=-1, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None,
                                     block_size=16, kv_cache_bytes=1 << 30, num_threads=args.threads, lora=lora))
        for name in LORA_ADAPTERS:
            engine.adapters.load(name, root / name)
        params = SamplingParams(greedy=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)

        def run(with_lora: bool) -> float:
            drop_prefix_cache(engine.allocator)
            requests = [(f"r{i}", ids, replace(params, adapter=LORA_ADAPTERS[i % 4] if with_lora else None))
                        for i, ids in enumerate(work.prompt_token_ids)]
            start = time.perf_counter()
            outputs = engine.generate(requests)
            seconds = time.perf_counter() - start
            tokens = sum(len(t.new_tokens) for outs in outputs.values() for t in outs)
            return tokens / seconds

        run(True)                                            # warm-up: the adapters' stacks, every shape once
        rates: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            for name in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
                rates[name].append(run(name == "lora"))
    base, lora_rate = (statistics.median(rates[k]) for k in ("base", "lora"))
    print(f"{args.dtype}, {args.threads} threads, 64 requests x {args.max_new_tokens} tokens, 4 adapters of rank "
          f"{args.rank}: base {base:.1f} tok/s, lora {lora_rate:.1f} tok/s, lora / base {lora_rate / base:.3f} "
          f"(per round base {', '.join(f'{x:.1f}' for x in rates['base'])}; "
          f"lora {', '.join(f'{x:.1f}' for x in rates['lora'])})")
