"""The benchmark's workload: MT-bench prompts through the chat template, the batch file, and its FLOPs.

Owns what every engine is given (the same prompt token ids, the same output length) and the
arithmetic of the compute bound; how each engine runs it is in workers.py and vllm_worker.py.
Imports no torch (the orchestrator stays light).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# a copy inside the repository (benchmarks/data/README.md: source and licence), so a clone runs alone
PROMPTS = BENCH / "data" / "mt_bench_questions.jsonl"


@dataclass
class Workload:
    """`num_prompts` requests of `max_new_tokens` greedy tokens each, EOS ignored.

    `prompts` are the chat-templated texts (system prompt + MT-bench turns[0] + generation prompt),
    `prompt_token_ids` the same texts tokenized without extra special tokens (every engine gets these ids;
    the HTTP servers get the texts and tokenize them the same way).
    """

    model: str
    max_new_tokens: int
    questions: list[str]
    prompts: list[str]
    prompt_token_ids: list[list[int]]

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, path: Path) -> "Workload":
        return cls(**json.loads(Path(path).read_text()))

    def head(self, n: int) -> "Workload":
        """The first n requests only (concurrency-1 runs, probes)."""
        return Workload(self.model, self.max_new_tokens, self.questions[:n], self.prompts[:n],
                        self.prompt_token_ids[:n])


    def warmup(self) -> "Workload":
        """Every prompt with its token ids reversed, 2 tokens: the batch shapes of the real run (so a
        compiled engine has compiled them) without warming a prefix cache for it (no shared prefix)."""
        return Workload(self.model, 2, self.questions, self.prompts, [ids[::-1] for ids in self.prompt_token_ids])


def build_workload(model: Path, num_prompts: int, max_new_tokens: int, prompts_path: Path = PROMPTS) -> Workload:
    """Read the first `num_prompts` MT-bench questions (turns[0]) and apply the model's chat template.

    Raises SystemExit when the file holds fewer questions than asked.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    questions = [json.loads(line)["turns"][0] for line in prompts_path.read_text().splitlines() if line.strip()]
    if num_prompts > len(questions):
        raise SystemExit(f"{prompts_path} holds {len(questions)} questions, asked for {num_prompts}")
    questions = questions[:num_prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return Workload(str(model), max_new_tokens, questions, prompts, ids)


def write_batch_file(workload: Workload, path: Path, model_name: str = "model") -> Path:
    """The workload as an OpenAI batch input file (DESIGN §4): one chat-completions line per question.

    custom_id `request-<i>`, max_completion_tokens = the workload's length, ignore_eos true, and no
    temperature, so every line is greedy (batch format: temperature absent = greedy).
    """
    with open(path, "w") as f:
        for i, question in enumerate(workload.questions):
            body = {"model": model_name, "messages": [{"role": "user", "content": question}],
                    "max_completion_tokens": workload.max_new_tokens, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return path


# ---------------------------------------------------------------- compute bound

def model_flops(config: dict, workload: Workload) -> dict:
    """FLOPs the workload needs at least (no padding, no recompute), from an HF Llama config.json.

    Per computed token (prompt and output, the last output token excepted as it is never fed back):
    2 * (non-embedding params) for the linear layers, plus attention 4 * layers * heads * head_dim * context
    (QK^T and PV over the causal context). Per sampled token: 2 * hidden * vocab for lm_head (its logits
    are computed only for the last prompt token and each output token). Returns the parts and the total.
    """
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter  # q,o + k,v + gate,up,down
    layer_params = layers * per_layer
    new = workload.max_new_tokens
    linear = attention = lm_head = 0
    for ids in workload.prompt_token_ids:
        computed = len(ids) + new - 1                       # tokens fed through the layers
        linear += 2 * layer_params * computed
        # token at position p attends to p + 1 tokens: sum over p of (p + 1)
        attention += 4 * layers * heads * head_dim * computed * (computed + 1) // 2
        lm_head += 2 * hidden * vocab * new
    return {"non_embedding_params": layer_params, "lm_head_params": hidden * vocab,
            "linear_flops": linear, "attention_flops": attention, "lm_head_flops": lm_head,
            "total_flops": linear + attention + lm_head,
            "output_tokens": new * workload.num_prompts,
            "prompt_tokens": sum(len(ids) for ids in workload.prompt_token_ids)}


def compute_bound(flops: dict, peak_flops_per_s: float) -> dict:
    """Output tok/s if the whole workload ran at `peak_flops_per_s` (FLOP/s)."""
    seconds = flops["total_flops"] / peak_flops_per_s
    return {"peak_gflops_per_s": peak_flops_per_s / 1e9, "seconds_at_peak": seconds,
            "output_tokens_per_s": flops["output_tokens"] / seconds}


# ---------------------------------------------------------------- batch-1 bandwidth ceiling

# bytes per weight of each (dtype, quantization) the benchmark runs; int8 adds a float32 scale per output row
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def step_linears(config: dict) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """The matrices a decode step multiplies, from an HF Llama config.json, as the engine holds them: (layers,
    per layer the (out rows, in cols) of qkv, o, gate_up and down, the lm_head's (the tied embedding matrix)).
    Raises KeyError when the config lacks hidden_size, num_attention_heads, intermediate_size, vocab_size or
    num_hidden_layers."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return config["num_hidden_layers"], layer, (config["vocab_size"], hidden)


def weight_bytes_per_token(config: dict, weights: str) -> dict:
    """Bytes of weights one decode step must read, from an HF Llama config.json: every linear matrix of the
    layers and lm_head (the tied embedding matrix, read whole to score the vocabulary; the embedding lookup
    reads one row, left out, as are the norms' vectors), at WEIGHT_BYTES[weights] each, plus for int8 one
    float32 scale per output row (per-output-channel quantization). The minimum any engine streams per
    token in that format, so bytes / read bandwidth is the batch-1 ceiling. Raises KeyError on an unknown
    `weights`."""
    layers, layer, lm_head = step_linears(config)
    matrices = layer * layers + [lm_head]
    params = sum(rows * cols for rows, cols in matrices)
    rows = sum(r for r, _ in matrices)
    scale_bytes = 4 * rows if weights == "int8" else 0
    return {"weights": weights, "params": params, "bytes": params * WEIGHT_BYTES[weights] + scale_bytes,
            "scale_bytes": scale_bytes}


def bench_engine(model: str, dtype: str, threads: int, quantize: str | None = None):
    """An Engine with the benchmark's offline settings (64 sequences, 2048 tokens a step, 1 GiB of KV cache)."""
    from lmi_handler.config import EngineConfig
    from lmi_handler.engine.engine import Engine

    return Engine(EngineConfig(model_path=model, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], device_id=-1,
                               max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None, block_size=16,
                               kv_cache_bytes=1 << 30, num_threads=threads, quantize=quantize))
