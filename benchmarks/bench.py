"""The benchmark: one workload through every engine, one engine after the other, in one invocation.

    .venv/bin/python benchmarks/bench.py [--smoke] [--write-readme] [--skip vllm,hf ...]

Workload (workload.py): the first 64 MT-bench prompts (turns[0]) through the chat template, 128
greedy tokens each, EOS ignored. Phases, never two engines running at once:

1. peak matmul rate (a big torch.matmul) — the compute bound's denominator;
2. offline, in --offline-rounds interleaved rounds (offline_rounds.py): our Engine and vLLM's CPU build
   (benchmarks/.venv-vllm, set up by vllm_peer.py) both loaded, taking turns on the whole workload,
   who goes first swapping every round; then our engine's plain variant, one round alone;
3. the batch-file runner: the same prompts as an OpenAI batch JSONL through `lmi-handler batch`;
4. our HTTP server (ServerProcess) streaming /v1/completions at each --concurrency;
5. transformers generate(), static batches at the fastest of --hf-batch-sizes;
6. vLLM's API server, as our server;
7. the peak matmul rate again (the machine's state at the end).

A phase that cannot run (peer not set up, command missing, a failure) is recorded with its reason
and the run goes on. Writes results/bench-<stamp>.json and .png; --write-readme updates the README table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report as report_mod  # noqa: E402
import vllm_peer  # noqa: E402
from load_client import run_load  # noqa: E402
from monitor import PhaseMonitor, machine_snapshot  # noqa: E402
from offline_rounds import OfflineWorker, log_tail, run_rounds  # noqa: E402
from workload import BENCH, PROMPTS, REPO, Workload, build_workload, compute_bound, model_flops, write_batch_file  # noqa: E402

sys.path.insert(0, str(REPO))   # the server subprocess harness is the tests' (tests/helpers.py)
from tests.helpers import ServerProcess, free_port


class PhaseSkipped(Exception):
    """A phase could not run; its message says why (recorded in the report, the run goes on)."""


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

    # ---- our engine's options, the same for offline, server and batch runner ----------------

    def our_options(self, **extra: str) -> dict[str, str]:
        a = self.args
        opts = {"max_rolling_batch_size": a.max_num_seqs, "max_rolling_batch_prefill_tokens": a.max_batched_tokens,
                "kv_cache_bytes": int(a.kv_cache_gib * 2**30), "num_threads": a.threads, "dtype": a.dtype}
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
               "--dtype", self.args.dtype, "--peak-size", str(self.args.peak_size)]
        return self.run_worker(name, cmd, self.env)

    def offline(self, names: list[str], num_rounds: int) -> None:
        """Offline phases `names` (of ours_offline, ours_offline_plain, vllm_offline) as workers taking turns
        for `num_rounds` rounds (offline_rounds.run_rounds); each one's result or why not goes into phases."""
        print(f"[{time.strftime('%H:%M:%S')}] {' + '.join(names)}: {num_rounds} rounds ...", flush=True)
        makers = {"ours_offline": self._ours_worker, "vllm_offline": self._vllm_worker,
                  "ours_offline_plain": lambda name: self._ours_worker(name, batch_invariant="false")}
        workers = []
        for name in names:
            try:
                workers.append(makers[name](name))
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

    def _ours_worker(self, name: str, **extra: str) -> OfflineWorker:
        opts = [x for kv in self.our_options(**extra).items() for x in ("--option", *kv)]
        cmd = [sys.executable, str(BENCH / "workers.py"), "ours-offline", "--workload", str(self.workload_path),
               "--threads", str(self.args.threads), *opts]
        return OfflineWorker(name, cmd, self.env, self.tmp, self.args.phase_timeout_s)

    def hf(self) -> dict:
        cmd = [sys.executable, str(BENCH / "workers.py"), "hf", "--workload", str(self.workload_path),
               "--out", str(self.tmp / "hf.json"), "--threads", str(self.args.threads), "--dtype", self.args.dtype,
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

    def _vllm_worker(self, name: str) -> OfflineWorker:
        py = self._vllm_python()
        a = self.args
        cmd = [str(py), str(BENCH / "vllm_worker.py"), "--workload", str(self.workload_path),
               "--dtype", self._vllm_dtype(),
               "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_batched_tokens)]
        return OfflineWorker(name, cmd, self._vllm_env(), self.tmp, a.phase_timeout_s)

    def vllm_server(self) -> dict:
        py = self._vllm_python()
        a = self.args
        port = free_port()
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", self.workload.model,
               "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self._vllm_dtype(), "--max-num-seqs", str(a.max_num_seqs),
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
        if not vllm_peer.is_ready(self.args.vllm_venv):
            raise PhaseSkipped(f"vLLM venv {self.args.vllm_venv} is not set up (run `make bench-setup`, i.e. "
                               "`.venv/bin/python benchmarks/vllm_peer.py setup`)")
        return vllm_peer.venv_python(self.args.vllm_venv)

    def _vllm_dtype(self) -> str:
        return "float32" if self.args.dtype == "auto" else self.args.dtype

    def _vllm_env(self) -> dict[str, str]:
        threads = self.args.threads
        return vllm_peer.vllm_env(threads_bind=f"0-{threads - 1}" if threads > 1 else "0",
                                  kvcache_gib=max(1, round(self.args.kv_cache_gib)))


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


PHASES = ("peak", "peak_start", "peak_end", "ours_offline", "ours_offline_plain", "batch_runner", "ours_server", "hf",
          "vllm", "vllm_offline", "vllm_server")


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    import transformers

    return {"cpu": cpu, "cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "mem_gib": mem / 2**30, "platform": platform.platform(), "python": platform.python_version(),
            "transformers": transformers.__version__}


def run(args: argparse.Namespace) -> dict:
    workload = build_workload(args.model, args.num_prompts, args.max_new_tokens, args.prompts)
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=args.out_dir))
    bench = Bench(args, workload, tmp)
    before = machine_snapshot()
    print(f"workload: {workload.num_prompts} prompts x {workload.max_new_tokens} tokens; threads {args.threads}; "
          f"load {before['loadavg_1_5_15']}, other processes {before['other_cpu_cores_busy']:.2f} cores; "
          f"logs in {tmp}", flush=True)
    skip = set(args.skip)

    def wanted(name: str) -> bool:
        group = name.split("_")[0] if name.startswith(("vllm", "peak")) else name
        if name in skip or group in skip:
            why = args.smoke_skips.get(name) or args.smoke_skips.get(group) or "--skip"
            bench.phases[name] = {"skipped": why}
            print(f"    {name}: skipped ({why})", flush=True)
            return False
        return True

    if wanted("peak_start"):
        bench.phase("peak_start", bench.peak, "peak_start")
    pair = [name for name in ("ours_offline", "vllm_offline") if wanted(name)]
    if pair:
        bench.offline(pair, args.offline_rounds)
    if not args.plain:
        why = "--smoke (add --with plain)" if args.smoke else "--no-plain"
        bench.phases["ours_offline_plain"] = {"skipped": why}
        print(f"    ours_offline_plain: skipped ({why})", flush=True)
    elif wanted("ours_offline_plain"):
        bench.offline(["ours_offline_plain"], 1)
    for name, fn, *fn_args in [("batch_runner", bench.batch_runner), ("ours_server", bench.ours_server),
                               ("hf", bench.hf), ("vllm_server", bench.vllm_server),
                               ("peak_end", bench.peak, "peak_end")]:
        if wanted(name):
            bench.phase(name, fn, *fn_args)
    config = json.loads((Path(workload.model) / "config.json").read_text())
    flops = model_flops(config, workload)
    peaks = [bench.phases[p].get("peak_flops_per_s") for p in ("peak_start", "peak_end")]
    peak = max((p for p in peaks if p), default=None)
    return {"date": dt.datetime.now().isoformat(timespec="seconds"),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": {**machine_info(), "before": before, "after": machine_snapshot()},
            "workload": {"num_prompts": workload.num_prompts, "max_new_tokens": workload.max_new_tokens,
                         "prompt_tokens": flops["prompt_tokens"], "c1_prompts": args.c1_prompts},
            "flops": flops, "compute_bound": compute_bound(flops, peak) if peak else None,
            "phases": bench.phases, "tmp_dir": str(tmp)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CI variant: 2 prompts x 8 tokens, ours offline + batch runner + server at C=2 + HF (bs 2), "
                        "1 thread unless --threads; these sizes replace --num-prompts, --max-new-tokens, --concurrency "
                        "and --hf-batch-sizes; vLLM and the plain variant skipped unless named in --with")
    p.add_argument("--with", dest="with_", type=words, default=[], help="with --smoke: also run these (vllm,plain)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32, 64], help="server concurrency levels, e.g. 1,8,32,64")
    p.add_argument("--c1-prompts", type=int, default=8, help="prompts sent at concurrency 1 (keeps the run short)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine (OMP_NUM_THREADS; vLLM: VLLM_CPU_OMP_THREADS_BIND=0-(N-1)); "
                        "default: every CPU this process may use (--smoke: 1, robust on a shared machine)")
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on CUDA (vLLM: float32)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache of ours (exact) and vLLM (VLLM_CPU_KVCACHE_SPACE takes whole GiB: rounded, at least 1)")
    p.add_argument("--option", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="extra option.KEY=VALUE for our engine (offline, server and batch runner alike)")
    p.add_argument("--offline-rounds", type=int, default=None,
                   help="rounds of the offline workload per engine, ours and vLLM taking turns, who goes first "
                        "swapping each round; the figures are the median round (default 3, --smoke 2)")
    p.add_argument("--no-plain", dest="plain", action="store_false",
                   help="do not also run our engine offline with option.batch_invariant=false")
    p.add_argument("--hf-batch-sizes", type=ints, default=[8, 16, 32, 64])
    p.add_argument("--hf-probe-tokens", type=int, default=32, help="tokens per probe of a batch size")
    p.add_argument("--peak-size", type=int, default=0, help="square matmul size (0: 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--skip", type=words, default=[], help=f"phases to skip, comma-separated: {','.join(PHASES)}")
    p.add_argument("--vllm-venv", type=Path, default=vllm_peer.DEFAULT_VENV)
    p.add_argument("--model", type=Path, default=REPO / "model")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="MT-bench questions JSONL (turns[0] is used)")
    p.add_argument("--out-dir", type=Path, default=BENCH / "results")
    p.add_argument("--write-readme", action="store_true", help="replace the results table in benchmarks/README.md")
    p.add_argument("--readme-from", type=Path, help="only regenerate the README table from this result JSON")
    p.add_argument("--request-timeout-s", type=float, default=900)
    p.add_argument("--server-start-timeout-s", type=float, default=600)
    p.add_argument("--phase-timeout-s", type=float, default=3600,
                   help="per worker: an offline worker's limit counts its own start-up, rounds and batch-1, "
                        "not the rounds it waits through")
    args = p.parse_args(argv)
    unknown = sorted(set(args.skip) - set(PHASES))
    if unknown:
        p.error(f"--skip {','.join(unknown)}: unknown phase; the phases are {','.join(PHASES)}")
    for name, value, low in (("--threads", args.threads, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--max-new-tokens", args.max_new_tokens, 1), ("--c1-prompts", args.c1_prompts, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1), ("--max-batched-tokens", args.max_batched_tokens, 1),
                             ("--hf-probe-tokens", args.hf_probe_tokens, 1), ("--peak-size", args.peak_size, 0)):
        if value is not None and value < low:
            p.error(f"{name} {value}: at least {low}")
    for name, values in (("--concurrency", args.concurrency), ("--hf-batch-sizes", args.hf_batch_sizes)):
        if not values or min(values) < 1:
            p.error(f"{name} {','.join(map(str, values))}: one or more integers, each at least 1")
    if args.kv_cache_gib <= 0:
        p.error(f"--kv-cache-gib {args.kv_cache_gib}: must be > 0")
    if args.readme_from and not args.readme_from.is_file():
        p.error(f"--readme-from {args.readme_from}: no such file")
    if args.with_ and not args.smoke:
        p.error("--with only applies to --smoke")
    args.smoke_skips = {}
    if args.smoke:
        sizes = {"--num-prompts": 64, "--max-new-tokens": 128, "--concurrency": [1, 8, 32, 64], "--hf-batch-sizes": [8, 16, 32, 64]}
        overridden = [flag for flag, default in sizes.items() if getattr(args, flag[2:].replace("-", "_")) != default]
        if overridden:
            print(f"--smoke sets its own sizes: {', '.join(overridden)} ignored", flush=True)
        args.threads = args.threads or 1
        args.kv_cache_gib = min(args.kv_cache_gib, 0.125)
        args.num_prompts, args.max_new_tokens, args.concurrency = 2, 8, [2]
        args.hf_batch_sizes, args.hf_probe_tokens, args.peak_size = [2], 4, args.peak_size or 512
        args.plain = "plain" in args.with_
        args.smoke_skips = {"peak_end": "--smoke", **({} if "vllm" in args.with_ else {"vllm": "--smoke (add --with vllm)"})}
        args.skip = [*args.skip, *args.smoke_skips]
        args.phase_timeout_s = min(args.phase_timeout_s, 600)
    if args.offline_rounds is None:
        args.offline_rounds = 2 if args.smoke else 3
    if args.offline_rounds < 1:
        p.error(f"--offline-rounds {args.offline_rounds}: at least 1")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    return args


def _unwind_on_sigterm() -> None:
    """SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: every phase's `finally` then stops the engines,
    servers and workers it started (they run in process groups of their own and would outlive us)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _unwind_on_sigterm()
    if args.readme_from:
        report_mod.write_readme(json.loads(args.readme_from.read_text()), args.readme_from.name)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = run(args)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    stem = args.out_dir / (f"bench-smoke-{stamp}" if args.smoke else f"bench-{stamp}")
    report_mod.add_summary(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    report_mod.plot(result, stem.with_suffix(".png"))
    print(report_mod.table(result))
    print(f"\nwrote {stem}.json and {stem}.png")
    if args.write_readme:
        report_mod.write_readme(result, stem.with_suffix(".json").name)
        print("updated benchmarks/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
