"""`profiling.py grammar`: the two grammar libraries (llguidance, xgrammar): tokenizer set-up, compile time, per-step
mask cost.

A command of benchmarks/profiling.py, which calls grammar_main; `profiling.py grammar --help` prints GRAMMAR_DOC.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

GRAMMAR_DOC = """Measure the two grammar libraries on this machine: tokenizer set-up, compile time, per-step mask cost.

Usage: .venv/bin/python benchmarks/profiling.py grammar [--model model] [--out FILE.json]
Each library is measured only when it is installed (the project installs llguidance; add xgrammar with
`pip install xgrammar` to compare). Compile times are wall seconds with the library's cache off (a fresh
matcher per spec), median of 3. The per-step cost is the thread CPU time (time.thread_time, so other
processes on the host do not count) of one mask fill plus one token consume, walked along a valid
output's tokens, 1 thread; its wall median is printed beside it. The GIL figure is how many iterations
of a pure-Python loop the main thread ran while a worker thread compiled the largest schema, as a
fraction of the same loop alone over the same wall time (1.0 = the compile never held the GIL).
"""

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                                    "email": {"type": "string", "format": "email"}},
                  "required": ["name"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}, "minItems": 1}},
        "required": ["id", "tags", "owner", "items"]},
    "wide_enum": {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "enum": [f"value_{i}_{j}" for j in range(40)]} for i in range(60)},
        "required": [f"field_{i}" for i in range(60)]},
}
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "nested": {"id": 7, "tags": ["red", "blue"], "owner": {"name": "Bob", "email": "bob@example.com"},
               "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 10}]},
}
# --large adds it: llguidance builds it in about a second, xgrammar compiled it for minutes here
LARGE_SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 50 + 1}}}[0-9]+x{i}$"} for i in range(3000)},
    "required": [f"p{i}" for i in range(3000)]}
REGEXES = {"date": r"\d{4}-\d{2}-\d{2}", "phone": r"\(\d{3}\) \d{3}-\d{4}",
           "choice": r"(yes|no|maybe)"}
REGEX_TEXT = {"date": "2024-01-31", "phone": "(555) 123-4567", "choice": "maybe"}


def gil_share(work) -> float:
    """Main-thread Python progress while `work` runs in a thread, relative to the loop alone."""
    def spin(seconds: float) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    thread = threading.Thread(target=work)
    start = time.perf_counter()
    thread.start()
    count = 0
    while thread.is_alive():
        count += spin(0.01)
    elapsed = time.perf_counter() - start
    alone = spin(elapsed)
    return count / max(alone, 1)


def walk(fill, consume, tokens: list[int]) -> tuple[float, float, bool]:
    """(median thread-CPU us, median wall us) per step of fill+consume along `tokens`; all allowed?"""
    cpu, wall, ok = [], [], True
    for token in tokens:
        c0, w0 = time.thread_time(), time.perf_counter()
        allowed = fill(token)
        consume(token)
        cpu.append((time.thread_time() - c0) * 1e6)
        wall.append((time.perf_counter() - w0) * 1e6)
        ok &= allowed
    return statistics.median(cpu), statistics.median(wall), ok


def timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bit_set(mask_row, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def measure_llguidance(tokenizer, vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    out = {"version": llguidance.get_version() if hasattr(llguidance, "get_version") else "?",
           "tokenizer_s": time.perf_counter() - start, "compile_s": {}, "step_cpu_us": {}, "step_wall_us": {}}
    grammars = {f"json:{k}": llguidance.LLMatcher.grammar_from_json_schema(
        v, defaults={"whitespace_flexible": False}) for k, v in SCHEMAS.items()}
    grammars.update({f"regex:{k}": llguidance.LLMatcher.grammar_from_regex(v) for k, v in REGEXES.items()})
    for name, grammar in grammars.items():
        out["compile_s"][name] = timed(lambda grammar=grammar: llguidance.LLMatcher(lltok, grammar))
    mask = llt.allocate_token_bitmask(1, vocab_size)
    texts = {f"json:{k}": json.dumps(v, separators=(",", ":")) for k, v in INSTANCES.items()}
    texts.update({f"regex:{k}": v for k, v in REGEX_TEXT.items()})
    for name, text in texts.items():
        matcher = llguidance.LLMatcher(lltok, grammars[name])
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

        def fill(token, matcher=matcher):
            llt.fill_next_token_bitmask(matcher, mask, 0)
            return bit_set(mask[0], token)
        cpu, wall, ok = walk(fill, matcher.consume_token, tokens)
        out["step_cpu_us"][name], out["step_wall_us"][name] = cpu, wall
        out.setdefault("valid_walk", {})[name] = ok and not matcher.is_error()
    big = grammars["json:wide_enum"]
    out["gil_share_during_compile"] = gil_share(lambda: llguidance.LLMatcher(lltok, big))
    return out


def measure_xgrammar(tokenizer, vocab_size: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    out = {"tokenizer_s": time.perf_counter() - start, "compile_s": {}, "step_cpu_us": {}, "step_wall_us": {}}

    def compiler():
        return xgr.GrammarCompiler(info, cache_enabled=False)

    builders = {f"json:{k}": (lambda v=v: compiler().compile_json_schema(json.dumps(v), any_whitespace=False))
                for k, v in SCHEMAS.items()}
    builders.update({f"regex:{k}": (lambda v=v: compiler().compile_regex(v)) for k, v in REGEXES.items()})
    compiled = {}
    for name, build in builders.items():
        out["compile_s"][name] = timed(build)
        compiled[name] = build()
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    texts = {f"json:{k}": json.dumps(v, separators=(", ", ": ")) for k, v in INSTANCES.items()}
    texts.update({f"regex:{k}": v for k, v in REGEX_TEXT.items()})
    for name, text in texts.items():
        matcher = xgr.GrammarMatcher(compiled[name])
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

        def fill(token, matcher=matcher):
            matcher.fill_next_token_bitmask(mask, 0)
            return bit_set(mask[0], token)
        cpu, wall, ok = walk(fill, matcher.accept_token, tokens)
        out["step_cpu_us"][name], out["step_wall_us"][name] = cpu, wall
        out.setdefault("valid_walk", {})[name] = ok and matcher.is_terminated()
    big = json.dumps(SCHEMAS["wide_enum"])
    out["gil_share_during_compile"] = gil_share(lambda: compiler().compile_json_schema(big, any_whitespace=False))
    return out


def grammar_main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=GRAMMAR_DOC.splitlines()[0])
    parser.add_argument("--model", default="model")
    parser.add_argument("--out", default=None)
    parser.add_argument("--large", action="store_true", help="also compile a 3000-property schema")
    args = parser.parse_args(argv)
    if args.large:
        SCHEMAS["large_3000"] = LARGE_SCHEMA
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    results = {"vocab_size": vocab_size}
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            results[name] = measure(tokenizer, vocab_size)
        except ImportError as exc:
            results[name] = {"not_installed": str(exc)}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
