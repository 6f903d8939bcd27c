"""The Python helper: create_batch (check a JSONL file and its batch-level defaults) and submit_batch
(run it on a server through /v1/files + /v1/batches, or offline in this process).

Owns the client side only; the line rules are protocol/batch_lines.py's, the work the runner's or the server's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from lmi_handler.protocol.batch_lines import BatchDefaults, BatchRejected, read_batch

TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True)
class BatchSpec:
    """A checked batch file and its batch-level defaults (what create_batch returns)."""

    path: Path
    defaults: BatchDefaults
    total: int              # requests in the file (bad lines included: each gets its own error record)
    num_bad_lines: int
    endpoint: str | None    # the url of the first good line: a /v1/batches job takes one endpoint


@dataclass(frozen=True)
class BatchResult:
    """How a submitted batch ended: status, counts and where the result files are."""

    status: str
    total: int
    completed: int
    failed: int
    output: Path
    errors: Path | None
    batch_id: str | None = None      # set when a server ran it


def create_batch(path: str | Path, *, max_decoding_length: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None) -> BatchSpec:
    """Check a batch input file (DESIGN §4) with batch-level defaults; nothing runs yet.

    Raises: RequestValidationError for a bad default (naming it), BatchRejected naming the lines
    that have no output length when max_decoding_length is not given, FileNotFoundError.
    Bad lines are not an error here: each gets its own error record when the batch runs.
    """
    defaults = BatchDefaults.parse({"max_decoding_length": max_decoding_length, "temperature": temperature,
                                    "top_p": top_p, "top_k": top_k})
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as lines:
        plan = read_batch(lines, defaults)
    if plan.rejection():
        raise BatchRejected(plan.rejection())
    with open(path, encoding="utf-8", errors="replace") as lines:
        endpoint = _first_url(lines, defaults)
    return BatchSpec(path, defaults, plan.total, len(plan.errors), endpoint)


def submit_batch(batch: BatchSpec, output: str | Path, errors: str | Path | None = None, *,
                 base_url: str | None = None, api_key: str = "unused", metadata: dict[str, str] | None = None,
                 poll_s: float = 1.0, timeout_s: float | None = None,
                 properties: str | Path = "serving.properties", progress: bool = True,
                 ray_address: str | None = None, replicas: int = 2, shard_lines: int = 500,
                 replica_cpus: float = 1.0, replica_gpus: float = 0.0) -> BatchResult:
    """Run a batch and write its result records (OpenAI batch output lines) to `output` / `errors`.

    With `base_url` (e.g. "http://localhost:8080/v1"): upload the file, create a /v1/batches job with
    the batch-level defaults as extra fields, poll every `poll_s` seconds until it ends (TimeoutError
    after `timeout_s`), then download the output and error files. Without it: run offline in this
    process on the model of `properties` (as `lmi-handler batch` does; rerunning resumes).
    With `ray_address` instead (the `ray` extra): shard the file over `replicas` engine replicas of a Ray
    cluster, as `lmi-handler batch --ray` does: "local" starts a cluster of this job on 127.0.0.1 only, any
    other value is what ray.init joins ("auto", "HOST:PORT"); `shard_lines`, `replica_cpus` and `replica_gpus`
    as the CLI's flags (batch/cluster.py; raises ClusterError, ShardsLost).
    Without `errors`, failures go to `output` too.
    """
    output, errors = Path(output), Path(errors) if errors else None
    if base_url is not None and ray_address is not None:
        raise ValueError("give base_url (a server runs the batch) or ray_address (a Ray cluster does), not both")
    if ray_address is not None:
        from lmi_handler.batch.cluster import ClusterPlan

        plan = ClusterPlan(ray_address, replicas, shard_lines, replica_cpus, replica_gpus)
        return _run_offline(batch, output, errors, Path(properties), progress, plan)
    if base_url is None:
        return _run_offline(batch, output, errors, Path(properties), progress)
    return _run_on_server(batch, output, errors, base_url.rstrip("/"), api_key, metadata, poll_s, timeout_s)


def _run_offline(batch: BatchSpec, output: Path, errors: Path | None, properties: Path, progress: bool,
                 plan=None) -> BatchResult:
    """In this process (plan None), or over the replicas of a Ray cluster (plan: a cluster.ClusterPlan)."""
    from lmi_handler.batch.cluster import run_on_ray
    from lmi_handler.batch.runner import BatchRunner
    from lmi_handler.config import Settings, read_serving_properties
    from lmi_handler.service import Service

    settings = Settings.from_properties(read_serving_properties(properties))
    if plan is not None:
        summary = run_on_ray(settings, batch.path, output, errors, batch.defaults, plan, progress=progress)
    else:
        summary = BatchRunner(Service(settings)).run(batch.path, output, errors, batch.defaults, progress=progress)
    return BatchResult("completed", summary.total, summary.completed, summary.failed, output, errors)


def _run_on_server(batch: BatchSpec, output: Path, errors: Path | None, base_url: str, api_key: str,
                   metadata: dict[str, str] | None, poll_s: float, timeout_s: float | None) -> BatchResult:
    import httpx

    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=120) as http:
        with open(batch.path, "rb") as file:
            uploaded = _ok(http.post("/files", files={"file": (batch.path.name, file)}, data={"purpose": "batch"}))
        body = {"input_file_id": uploaded["id"], "endpoint": batch.endpoint or "/v1/chat/completions",
                "completion_window": "24h", "metadata": metadata, **batch.defaults.model_dump(exclude_none=True)}
        job = _ok(http.post("/batches", json=body))
        started = time.monotonic()
        while job["status"] not in TERMINAL:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"batch {job['id']} is still {job['status']} after {timeout_s} s")
            time.sleep(poll_s)
            job = _ok(http.get(f"/batches/{job['id']}"))
        if job["status"] == "failed":
            raise BatchRejected(f"batch {job['id']} failed: " + "; ".join(
                e["message"] for e in (job.get("errors") or {}).get("data", [])))
        _download(http, job["output_file_id"], output, "wb")
        _download(http, job["error_file_id"], errors or output, "wb" if errors else "ab")
    counts = job["request_counts"]
    return BatchResult(job["status"], counts["total"], counts["completed"], counts["failed"], output, errors,
                       job["id"])


def _ok(response) -> dict:
    if response.status_code >= 400:
        raise RuntimeError(f"{response.request.method} {response.request.url}: {response.status_code} "
                           f"{response.text[:500]}")
    return response.json()


def _download(http, file_id: str | None, path: Path, mode: str) -> None:
    with open(path, mode) as out:
        if file_id is not None:
            response = http.get(f"/files/{file_id}/content")
            _ok(response) if response.status_code >= 400 else out.write(response.content)


def _first_url(lines, defaults: BatchDefaults) -> str | None:
    from lmi_handler.protocol.batch_lines import BatchLine, check_lines

    return next((item.url for item in check_lines(lines, defaults) if isinstance(item, BatchLine)), None)
