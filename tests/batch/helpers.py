"""Batch test helpers: JSONL lines and files, the batch CLI in a subprocess, a batch-API server process,
and the /v1/files + /v1/batches calls through the `openai` package.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO, ServerProcess, free_port, server_process

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ORDER = ["validating", "in_progress", "finalizing", "completed"]   # a Batch's statuses, in order
MAX_FILE_BYTES = 200_000   # option.batch_max_file_bytes of the test servers (the 413 test)


def batch_line(custom_id: str, body: dict, url: str = CHAT, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def write_jsonl(path: Path, lines: list) -> Path:
    """Write lines (dicts as JSON; plain strings verbatim, as cases/README.md says)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()] if path.exists() else []


def by_custom_id(records: list[dict]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for record in records:
        assert record["custom_id"] not in found, f"custom_id {record['custom_id']} twice"
        found[record["custom_id"]] = record
    return found


def content(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update(PYTHONPATH=str(REPO), OPTION_NUM_THREADS="1")
    return env


def batch_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmi_handler.cli", "batch", *args, "--properties", str(REPO / "serving.properties")]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(batch_cli(*args), env=cli_env(), capture_output=True, text=True, timeout=timeout)


def start(tmp_path_factory, batch_dir, name: str, **options: str) -> ServerProcess:
    """A server on the repo's serving.properties with its batch state in `batch_dir` and `options` (OPTION_*
    overrides; use with `with`)."""
    return server_process(tmp_path_factory, name, **{"batch_dir": str(batch_dir), "num_threads": "1",
                                                      "batch_max_file_bytes": str(MAX_FILE_BYTES), **options})


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(sdk, lines: list):
    return sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")


def poll(sdk, batch_id: str, timeout_s: float = 300, until=("completed", "failed", "cancelled", "expired")):
    """Statuses and request_counts seen every 0.5 s until a terminal status; checks they only move forward."""
    seen, counts = [], []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        seen.append(batch.status)
        counts.append(batch.request_counts)
        if batch.status in until:
            return batch, seen, counts
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {seen[-1]} after {timeout_s} s")


def records(sdk, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(t) for t in sdk.files.content(file_id).text.splitlines() if t.strip()]


def finish_reason(record: dict) -> str:
    return record["response"]["body"]["choices"][0]["finish_reason"]


def completion_tokens(record: dict) -> int:
    return record["response"]["body"]["usage"]["completion_tokens"]


# Lines written as the batch input format's own examples write them: `model` is any id ("for OpenAI
# compatibility"; the server's loaded model answers), here the format's placeholder "m", a foreign model id,
# the served name, and none.
FOREIGN_MODEL = "meta-llama/Meta-Llama-3.1-8B-Instruct"


def format_example_lines() -> list[dict]:
    ask = [{"role": "user", "content": "Name three colors."}]
    return [batch_line("m-chat", {"model": "m", "messages": ask, "max_completion_tokens": 6}),
            batch_line("m-text", {"model": "m", "prompt": "The sky is", "max_tokens": 4}, COMPLETIONS),
            batch_line("foreign", {"model": FOREIGN_MODEL, "messages": ask, "max_tokens": 6, "temperature": 0}),
            batch_line("served", {"model": "model", "messages": ask, "max_completion_tokens": 6}),
            batch_line("no-model", {"messages": ask, "max_completion_tokens": 6})]


# ---- Ray (batch/cluster.py) ------------------------------------------------------------------------------

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",      # config.RAY_LOOPBACK_SWITCH: node 127.0.0.1
           "RAY_AUTH_MODE": "token",   # Ray's token auth on the head and for drivers given its address (Ray's rule)
           "OPTION_KV_CACHE_BYTES": str(256 << 20)}        # two replicas beside the other tests' models


def ray_cli_env() -> dict[str, str]:
    return {**cli_env(), **RAY_ENV}


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (by /proc parent ids), alive now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def group_members(pgid: int) -> list[int]:
    """Processes alive in process group `pgid` (what a session started with start_new_session holds)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == pgid:
                    members.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return members


def kill_group(pgid: int, timeout_s: float = 30) -> list[int]:
    """SIGTERM, then SIGKILL, every process of group `pgid` (started by this test); returns who was left."""
    left = group_members(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in group_members(pgid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return left


def listening_addresses(pids: list[int]) -> set[str]:
    """Local IPv4/IPv6 addresses (hex, as /proc/net/tcp writes them) of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:    # state LISTEN
                found.add(fields[1].rsplit(":", 1)[0])
    return found


# 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


class RayHead:
    """`ray start --head --block` on 127.0.0.1 for the tests (2 CPUs, no dashboard, a small object store, token
    auth with Ray's default token file, made here when missing), in a session of its own; `stop()` ends it and
    kills whatever of its group is left."""

    def __init__(self, log_path: Path, num_cpus: int = 2):
        import tempfile

        from lmi_handler.batch.cluster import LOCAL_SYSTEM_CONFIG

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")   # short: Ray's socket paths are limited
        ray = Path(sys.executable).with_name("ray")
        # token auth (RAY_ENV) needs a token before `ray start`: on a fresh machine nothing has made
        # ~/.ray/auth_token yet (ray.init of a local cluster makes it; `ray start` does not)
        subprocess.run([str(ray), "get-auth-token", "--generate"], env=ray_cli_env(), capture_output=True,
                       check=True, timeout=120)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(ray), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.port}",
             f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
             f"--object-store-memory={128 << 20}", f"--temp-dir={self.temp_dir}",
             f"--system-config={json.dumps(LOCAL_SYSTEM_CONFIG)}"],   # as the local cluster of a job
            env=ray_cli_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ray start failed: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    def replicas(self) -> list[int]:
        """Process ids of the replica actors running in this cluster now."""
        return [pid for pid in process_tree(self.proc.pid) if cmdline(pid).startswith("ray::Replica")]

    def stop(self) -> None:
        import shutil

        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc.pid)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
