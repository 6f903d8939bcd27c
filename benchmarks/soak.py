"""Soak and storm: mixed traffic against a real server this script starts on 127.0.0.1, every answer checked
against its solo greedy answer, the server's resources sampled; it stops by itself (bounded in time and
requests) and writes JSON and a plot to --out-dir (benchmarks/results by default).

  python benchmarks/soak.py --minutes 30                  # soak: soak-<stamp>.json + .png
  python benchmarks/soak.py --storm --clients 1000        # storm: storm-<stamp>.json + .png
  python benchmarks/soak.py --smoke --out-dir DIR         # CI: a 40 s soak, then a 200-client storm, one server

Soak: --concurrency clients loop over the mix (soak_traffic.py: every generation route, streaming and not,
n > 1, disconnects, cancels, deadlines, ~1 % of requests carrying an injected per-request fault), one batch
job after another runs through /v1/files + /v1/batches, and every --burst-every-s a burst of extra clients
meets the bounded queue (job_queue_size) and some get 503 at admission. Storm: --clients clients at once
over three routes, 1 % faulted; each must get its solo answer, a 503 at admission, or (only the faulted) an
error. Exit status 1 if any request had another outcome, or KV blocks or HTTP requests stay in use once idle.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_traffic as mix  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the server subprocess harness is the tests'
from tests.helpers import ServerProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ACTIONS = {"plain": 0.78, "n": 0.05, "disconnect": 0.04, "cancel": 0.04, "deadline": 0.08, "fault": 0.01}
STORM_ROUTES = ("invocations", "chat_stream", "generate")
HARD_EXTRA_S = 600.0   # how long past --minutes a run may go to finish its opening, first burst and batch job


# ---- what is measured: the server's resources, sampled, and their growth after warm-up ------------------------
# RSS of the server's process tree, its open file descriptors and threads, KV blocks in use and HTTP requests
# live from /metrics, the SQLite state file and everything under batch_dir.

SERIES = {"rss_bytes": "RSS (MiB)", "num_fds": "open file descriptors", "num_threads": "threads",
          "kv_blocks_used": "KV blocks in use", "live_requests": "HTTP requests live", "sqlite_bytes": "SQLite state (KiB)",
          "batch_dir_bytes": "batch_dir (KiB)"}
SCALE = {"rss_bytes": 1 << 20, "sqlite_bytes": 1 << 10, "batch_dir_bytes": 1 << 10}
GAUGES = {"kv_blocks_used": "lmi_kv_cache_blocks_used", "live_requests": "lmi_front_end_live_requests"}


def gauges(url: str) -> dict[str, int | None]:
    """GAUGES read from the server's /metrics (None where one cannot be read)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return dict.fromkeys(GAUGES)
    found = {}
    for key, metric in GAUGES.items():
        match = re.search(rf"^{metric}\s+([0-9.eE+-]+)$", text, re.M)
        found[key] = int(float(match.group(1))) if match else None
    return found


def dir_bytes(path: Path, pattern: str = "**/*") -> int:
    total = 0
    for item in path.glob(pattern):
        try:
            total += item.stat().st_size if item.is_file() else 0
        except OSError:   # deleted meanwhile
            pass
    return total


def sample(pid: int, url: str, batch_dir: Path) -> dict:
    """One reading of the server process `pid` (and its children, for RSS)."""
    proc = psutil.Process(pid)
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return {"rss_bytes": rss, "num_fds": proc.num_fds(), "num_threads": proc.num_threads(), **gauges(url),
            "sqlite_bytes": dir_bytes(batch_dir, "state.sqlite3*"),
            "batch_dir_bytes": dir_bytes(batch_dir)}


class Sampler:
    """A thread sampling every `interval_s` seconds from start() to stop(); `samples` carry `t_s` (seconds
    since start) and `requests_done` (read from `progress()`)."""

    def __init__(self, pid: int, url: str, batch_dir: Path, interval_s: float, progress=lambda: 0):
        self.pid, self.url, self.batch_dir, self.interval_s, self.progress = pid, url, batch_dir, interval_s, progress
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self.start_time = 0.0

    def start(self) -> "Sampler":
        self.start_time = time.monotonic()
        self._thread.start()
        return self

    def take(self) -> dict:
        reading = {"t_s": round(time.monotonic() - self.start_time, 2), **sample(self.pid, self.url, self.batch_dir),
                   "requests_done": self.progress()}
        self.samples.append(reading)
        return reading

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.take()
            except psutil.Error:   # the server is gone; the run reports that itself
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def growth(samples: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per series: the median of the first tenth of the samples after warm-up (`after_warmup`), of the last
    tenth (`end`), their change in % of the first (`growth_pct`, None when it is 0) and the maximum."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    out: dict[str, dict] = {}
    if len(after) < 2:
        return out
    k = max(1, len(after) // 10)
    for name in SERIES:
        values = [s[name] for s in after if s.get(name) is not None]
        if len(values) < 2:
            continue
        base, end = statistics.median(values[:k]), statistics.median(values[-k:])
        out[name] = {"after_warmup": base, "end": end, "max": max(values),
                     "growth_pct": round(100 * (end - base) / base, 2) if base else None}
    return out


def describe_growth(report: dict[str, dict]) -> list[str]:
    """One line per series, for the console."""
    lines = []
    for name, row in report.items():
        scale = SCALE.get(name, 1)
        pct = "n/a (starts at 0)" if row["growth_pct"] is None else f"{row['growth_pct']:+.1f} %"
        lines.append(f"  {SERIES[name]:24s} {row['after_warmup'] / scale:10.1f} -> {row['end'] / scale:10.1f}  "
                     f"({pct}; max {row['max'] / scale:.1f})")
    return lines


def plot(samples: list[dict], warmup_s: float, path: Path, title: str) -> None:
    """One panel per series against time, the warm-up marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SERIES) + ["requests_done"]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.0 * len(names)), sharex=True)
    times = [s["t_s"] / 60 for s in samples]
    for ax, name in zip(axes, names):
        scale = SCALE.get(name, 1)
        ax.plot(times, [(s.get(name) or 0) / scale for s in samples], lw=1.2)
        ax.axvline(warmup_s / 60, color="grey", ls="--", lw=0.8)
        ax.set_ylabel(SERIES.get(name, "requests done"), fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=10)
    axes[-1].set_xlabel("minutes (dashed: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="soak length (default 30)")
    parser.add_argument("--max-requests", type=int, default=200_000, help="soak stops after this many requests")
    parser.add_argument("--concurrency", type=int, default=8, help="soak clients looping over the mix")
    parser.add_argument("--batch-size", type=int, default=16, help="option.max_rolling_batch_size")
    parser.add_argument("--queue", type=int, default=8, help="job_queue_size (the bounded waiting queue)")
    parser.add_argument("--burst-every-s", type=float, default=60.0, help="seconds between 503 bursts")
    parser.add_argument("--num-prompts", type=int, default=12, help="distinct prompts (2 solo cases each)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    parser.add_argument("--warmup-s", type=float, default=None, help="growth is measured after this "
                        "(default: a fifth of the soak, at least 30 s)")
    parser.add_argument("--storm", action="store_true", help="run the storm instead of the soak")
    parser.add_argument("--clients", type=int, default=1000, help="storm clients, all at once")
    parser.add_argument("--storm-batch-size", type=int, default=32)
    parser.add_argument("--storm-queue", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="CI: a 40 s soak and a 200-client storm")
    parser.add_argument("--num-threads", type=int, default=0, help="option.num_threads (0: PyTorch's default)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="a request slower is 'hung'")
    parser.add_argument("--seed", type=int, default=0, help="the traffic's random choices")
    parser.add_argument("--api-key", default=None, help="start the server with this API key (LMI_API_KEY) and "
                        "send it on every request; default: the server runs open")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    for name in ("minutes", "max_requests", "concurrency", "batch_size", "queue", "num_prompts", "sample_s",
                 "clients", "storm_batch_size", "storm_queue", "burst_every_s", "request_timeout_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    if args.smoke:
        args.minutes, args.num_prompts, args.sample_s, args.burst_every_s = 40 / 60, 4, 2.0, 12.0
        args.clients, args.warmup_s = 200, 10.0
    return args


def start_server(args, batch_dir: Path, log: Path, batch_size: int, queue: int) -> ServerProcess:
    options = {"max_rolling_batch_size": str(batch_size), "job_queue_size": str(queue), "batch_dir": str(batch_dir),
               "fault_injection": mix.FAULT_RULES, "num_threads": str(args.num_threads)}
    env = {"TOKENIZERS_PARALLELISM": "false", **({"LMI_API_KEY": args.api_key} if args.api_key else {})}
    server = ServerProcess(options, log, REPO / "serving.properties", env=env)
    try:
        server.ready_s = round(server.wait_ready(timeout_s=900), 1)    # a first start may compile the C++ kernels
    except BaseException:
        server.stop()
        raise
    return server


def auth_headers(args) -> dict[str, str]:
    """What every request sends: the API key, when the run has one."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def raise_fd_limit(needed: int) -> None:
    """Enough descriptors for `needed` sockets here and in the server (it inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else needed, max(soft, needed))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, int | None]:
    """KV blocks in use and HTTP requests live once the server has nothing left to do (polled until both
    are 0, or `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await asyncio.to_thread(gauges, url)
        if all(value == 0 for value in found.values()) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


def summarise(results: list[mix.Result]) -> dict:
    bad = [r for r in results if r.outcome not in mix.GOOD]
    return {"requests": len(results), "outcomes": dict(Counter(r.outcome for r in results)),
            "by_action": {a: dict(Counter(r.outcome for r in results if r.action == a))
                          for a in sorted({r.action for r in results})},
            "by_route": {n: dict(Counter(r.outcome for r in results if r.route == n))
                         for n in sorted({r.route for r in results})},
            "bad": len(bad), "bad_examples": [vars(r) for r in bad[:30]],
            "latency_s_max": max((r.latency_s for r in results), default=None)}


# ---- soak ------------------------------------------------------------------------------------------

async def soak_traffic(args, url: str, model: str, cases, solo, results: list[mix.Result]) -> None:
    """The soak's traffic until --minutes or --max-requests. It also lasts until the opening requests (every
    route and action once), one burst and one batch job are done, but never past HARD_EXTRA_S more."""
    rng = random.Random(args.seed)
    end = time.monotonic() + args.minutes * 60
    hard_end = end + HARD_EXTRA_S
    done = {"burst": False, "batch": False}
    # Idle connections are dropped after 2 s, well before the server's keep-alive of 5 s (uvicorn's): at
    # httpx's default, also 5 s, a connection reused just as the server closes it is reset (a client race,
    # seen in early storms), which would read as the server's defect.
    limits = httpx.Limits(max_connections=args.concurrency + args.batch_size + args.queue + 16, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s, limits=limits,
                                 headers=auth_headers(args)) as client:
        traffic = mix.Traffic(client, model, cases, solo, rng, args.request_timeout_s)
        opening = [("plain", route) for route in mix.ROUTES] + [(action, None) for action in ACTIONS] + [("fault", None)]

        def more() -> bool:
            now = time.monotonic()
            if len(results) >= args.max_requests or now >= hard_end:
                return False
            return now < end or bool(opening) or not all(done.values())

        async def client_loop() -> None:
            while more():
                action, route = opening.pop(0) if opening else (rng.choices(list(ACTIONS), list(ACTIONS.values()))[0],
                                                                None)
                results.append(await traffic.run(action, route))

        async def batch_loop() -> None:
            while more():
                results.append(await mix.batch_job(client, model, cases, solo, timeout_s=args.request_timeout_s * 2))
                done["batch"] = True
                await asyncio.sleep(1.0)

        async def bursts() -> None:
            size = args.batch_size + args.queue + 8
            while opening and more():   # the opening requests are never the ones refused
                await asyncio.sleep(0.2)
            while more():
                burst = [traffic.run("plain", mix.BY_NAME["invocations"]) for _ in range(size)]
                results.extend(await asyncio.gather(*burst))
                done["burst"] = True
                next_at = time.monotonic() + args.burst_every_s
                while more() and time.monotonic() < next_at:
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)), batch_loop(), bursts())


def run_soak(args, stamp: str, tmp: Path) -> dict:
    server = start_server(args, tmp / "batches", tmp / "soak-server.log", args.batch_size, args.queue)
    try:
        return asyncio.run(_soak(args, server, tmp, stamp))
    finally:
        server.stop()


async def _soak(args, server: ServerProcess, tmp: Path, stamp: str) -> dict:
    model = httpx.get(server.url + "/v1/models", timeout=10, headers=auth_headers(args)).json()["data"][0]["id"]
    cases = mix.make_cases(args.num_prompts)
    solo_start = time.monotonic()
    async with httpx.AsyncClient(base_url=server.url, timeout=args.request_timeout_s,
                                 headers=auth_headers(args)) as client:
        solo = await mix.solo_answers(client, model, cases)
    solo_s = round(time.monotonic() - solo_start, 1)
    results: list[mix.Result] = []
    warmup_s = args.warmup_s if args.warmup_s is not None else max(30.0, args.minutes * 60 / 5)
    sampler = Sampler(server.proc.pid, server.url, tmp / "batches", args.sample_s, lambda: len(results)).start()
    started = time.monotonic()
    try:
        await soak_traffic(args, server.url, model, cases, solo, results)
        idle = await wait_idle(server.url)
        sampler.take()
    finally:
        sampler.stop()
    report = {"mode": "soak", "duration_s": round(time.monotonic() - started, 1), "warmup_s": warmup_s,
              "server_ready_s": server.ready_s, "solo_answers_s": solo_s, "cases": len(cases),
              **summarise(results), "after_idle": idle,
              "growth_after_warmup": growth(sampler.samples, warmup_s), "samples": sampler.samples,
              "solo_answers": {f"{c.kind}|{c.prompt}|{c.max_tokens}": text for c, text in solo.items()}}
    if args.smoke:   # the storm runs on the same server: one start in CI
        report["storm"] = await _storm(args, server, tmp)
    plot(sampler.samples, warmup_s, args.out_dir / f"soak-{stamp}.png",
         f"soak {report['duration_s'] / 60:.1f} min, {report['requests']} requests, {report['bad']} bad")
    return report


# ---- storm -----------------------------------------------------------------------------------------

def run_storm(args, stamp: str, tmp: Path) -> dict:
    raise_fd_limit(4 * args.clients + 256)
    server = start_server(args, tmp / "batches", tmp / "storm-server.log", args.storm_batch_size, args.storm_queue)
    try:
        report = asyncio.run(_storm(args, server, tmp, sample=True))
    finally:
        server.stop()
    plot(report.pop("samples_list"), 0.0, args.out_dir / f"storm-{stamp}.png",
         f"storm {args.clients} clients: {report['outcomes']}")
    return report


async def _storm(args, server: ServerProcess, tmp: Path, sample: bool = False) -> dict:
    """`args.clients` requests at once: client i on STORM_ROUTES[i % 3], every 100th one faulted."""
    model = httpx.get(server.url + "/v1/models", timeout=10, headers=auth_headers(args)).json()["data"][0]["id"]
    cases = mix.make_cases(args.num_prompts)
    # one connection per client, as from 1,000 different clients: none reuses a connection another client's
    # quick 503 left idle (with pooling, a few were reused just as the server's 5 s keep-alive closed them)
    limits = httpx.Limits(max_connections=args.clients + 16, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=args.request_timeout_s, limits=limits,
                                 headers=auth_headers(args)) as client:
        solo = await mix.solo_answers(client, model, cases)
        sampler = Sampler(server.proc.pid, server.url, tmp / "batches", 1.0).start() if sample else None
        gate = asyncio.Event()

        async def one(i: int) -> mix.Result:
            route = mix.BY_NAME[STORM_ROUTES[i % len(STORM_ROUTES)]]
            case = [c for c in cases if c.kind == route.kind][(i // len(STORM_ROUTES)) % args.num_prompts]
            faulted = i % 100 == 50
            prompt = f"{case.prompt} {mix.FAULT_PREFILL}" if faulted else case.prompt
            body = mix.request_body(route, model, prompt, case.max_tokens)
            await gate.wait()
            start = time.monotonic()
            try:
                async with asyncio.timeout(args.request_timeout_s):
                    answer = await mix.send(client, route, body)
                outcome, detail = mix.judge("fault" if faulted else "plain", answer, None if faulted else solo[case])
            except TimeoutError:
                outcome, detail = "hung", f"no answer within {args.request_timeout_s:g} s"
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                outcome, detail = "transport_error", mix.describe_error(exc)
            return mix.Result("fault" if faulted else "plain", route.name, outcome, time.monotonic() - start, detail)

        tasks = [asyncio.create_task(one(i)) for i in range(args.clients)]
        await asyncio.sleep(0.2)
        started = time.monotonic()
        gate.set()
        results = await asyncio.gather(*tasks)
        wall_s = time.monotonic() - started
    idle = await wait_idle(server.url)
    samples = []
    if sampler is not None:
        sampler.take()
        sampler.stop()
        samples = sampler.samples
    report = {"mode": "storm", "clients": args.clients, "server_ready_s": server.ready_s, "routes": list(STORM_ROUTES), "wall_s": round(wall_s, 1),
              "faulted_clients": sum(1 for r in results if r.action == "fault"), **summarise(results),
              "after_idle": idle}
    if sample:
        report["samples_list"] = samples
    return report


def print_report(report: dict) -> None:
    print(f"{report['mode']}: {report['requests']} requests, outcomes {report['outcomes']}, bad {report['bad']}, "
          f"once idle: {report['after_idle']}", flush=True)
    for example in report["bad_examples"][:10]:
        print(f"  BAD {example['action']} {example['route']}: {example['outcome']} {example['detail']} "
              f"({example['latency_s']:.2f} s)")
    if "growth_after_warmup" in report:
        print(f"growth after warm-up ({report['warmup_s']:.0f} s), first tenth -> last tenth (medians):")
        print("\n".join(describe_growth(report["growth_after_warmup"])))
    if "storm" in report:
        print_report(report["storm"])
    for crash in report.get("server_crashes", [])[:3]:
        print(f"  SERVER CRASH:\n{crash}")


CRASH_MARKERS = ("Exception in ASGI application", "Task exception was never retrieved", "--- Logging error ---")


def server_crashes(log_text: str) -> list[str]:
    """The server log's lines (with the 12 after each) where something failed that nobody handled: an
    exception out of the app (uvicorn drops the connection), a task's, a log record that could not be written.
    Injected faults are handled (their tracebacks are logged on purpose) and do not count."""
    lines = log_text.splitlines()
    return ["\n".join(lines[i:i + 12]) for i, line in enumerate(lines) if any(m in line for m in CRASH_MARKERS)][:20]


def passed(report: dict) -> bool:
    ok = (report["bad"] == 0 and all(value == 0 for value in report["after_idle"].values())
          and not report.get("server_crashes") and not report.get("api_key_in_server_log"))
    return ok and passed(report["storm"]) if "storm" in report else ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%d-%H%M")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp_name:
        tmp = Path(tmp_name)
        if args.smoke:
            raise_fd_limit(4 * args.clients + 256)
        report = run_storm(args, stamp, tmp) if args.storm else run_soak(args, stamp, tmp)
        report["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report["config"]["api_key"] = "<set>" if args.api_key else None     # never the key itself
        log = next(iter(sorted(tmp.glob("*-server.log"))))
        text = log.read_text(errors="replace")
        report["server_crashes"] = server_crashes(text)
        report["api_key_in_server_log"] = bool(args.api_key) and args.api_key in text
        report["server_log_tail"] = text[-4000:]
        if not passed(report):      # keep the whole log beside the results
            log_copy = args.out_dir / f"{report['mode']}-{stamp}-server.log"
            log_copy.write_text(text)
            report["server_log"] = str(log_copy)
    path = args.out_dir / f"{report['mode']}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"wrote {path}", flush=True)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
