"""Streaming load client for OpenAI-compatible servers (ours and vLLM's): /v1/completions, fixed concurrency.

Owns the client side of a serving phase: at most C requests in flight, each a streamed completion
of the chat-templated prompt (greedy: temperature 0, ignore_eos, max_tokens M), timing every chunk.
TTFT = request sent -> first chunk with text; ITL = gaps between a request's chunks, pooled over
requests (vLLM's benchmark_serving definition); output tokens = the final usage chunk's
completion_tokens (stream_options.include_usage), or the chunk count if a server sends none.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from itertools import pairwise

import httpx
from round_protocol import percentiles


@dataclass
class StreamResult:
    index: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def model_name(url: str) -> str:
    """The first model id /v1/models lists (the name the server wants in `model`)."""
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


async def stream_one(client: httpx.AsyncClient, index: int, model: str, prompt: str, max_tokens: int,
                     timeout_s: float) -> StreamResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult(index)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    doc = json.loads(line[len("data:"):])
                    if doc.get("usage") and doc["usage"].get("completion_tokens") is not None:
                        result.num_output_tokens = doc["usage"]["completion_tokens"]
                    for choice in doc.get("choices") or []:
                        result.chunk_times.append(now)
                        result.text += choice.get("text") or ""
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    if result.chunk_times:
        result.ttft_s = result.chunk_times[0] - start
    result.num_output_tokens = result.num_output_tokens or len(result.chunk_times)
    return result


async def _run(url: str, prompts: list[str], concurrency: int, max_tokens: int,
               timeout_s: float) -> tuple[list[StreamResult], float]:
    model = model_name(url)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        await stream_one(client, -1, model, prompts[0], 2, timeout_s)  # warm-up, not measured

        async def bounded(i: int, prompt: str) -> StreamResult:
            async with sem:
                return await stream_one(client, i, model, prompt, max_tokens, timeout_s)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def run_load(url: str, prompts: list[str], concurrency: int, max_tokens: int, timeout_s: float = 600) -> dict:
    """One serving phase: all prompts at `concurrency`; throughput, TTFT and ITL (seconds)."""
    results, wall = asyncio.run(_run(url, prompts, concurrency, max_tokens, timeout_s))
    ok = [r for r in results if r.error is None]
    tokens = sum(r.num_output_tokens for r in ok)
    gaps = [b - a for r in ok for a, b in pairwise(r.chunk_times)]
    return {"concurrency": concurrency, "num_requests": len(results), "num_errors": len(results) - len(ok),
            "errors": [r.error for r in results if r.error][:5], "wall_s": wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall, "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s]),
            "itl_s": percentiles(gaps), "e2e_s": percentiles([r.e2e_s for r in ok]),
            "finish_reasons": sorted({str(r.finish_reason) for r in ok})}
