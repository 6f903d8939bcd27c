"""HTTP routes of the Batch API: /v1/files and /v1/batches (an APIRouter the app mounts).

Owns request checks and OpenAI error answers (unknown id 404, bad body 400, too large 413);
rows and objects are store.py's, running jobs jobs.py's.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from lmi_handler.batch.jobs import BatchJobs
from lmi_handler.batch.store import WINDOW_S
from lmi_handler.protocol.batch_lines import ROUTES, BatchDefaults
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError, error_body

MAX_METADATA_KEYS = 16   # OpenAI: 16 pairs, keys up to 64 characters, values up to 512
FILE_PURPOSES = ("batch",)


class ApiError(Exception):
    """An OpenAI error answer: status, message, the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(Dialect.OPENAI, self.message, self.status, self.param), status_code=self.status)


def batch_router(jobs: BatchJobs, max_file_bytes: int) -> APIRouter:
    """The /v1/files and /v1/batches routes over `jobs` (its store and worker)."""
    router = APIRouter()
    store = jobs.store

    def answer(work) -> Any:
        try:
            return work()
        except ApiError as exc:
            return exc.response()

    def existing_file(file_id: str) -> dict:
        found = store.get_file(file_id)
        if found is None:
            raise ApiError(404, f"No such File object: {file_id}", "file_id")
        return found

    def existing_batch(batch_id: str) -> dict:
        found = store.get_batch(batch_id)
        if found is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", "batch_id")
        return found

    @router.post("/v1/files")
    async def upload(request: Request):
        if int(request.headers.get("content-length") or 0) > max_file_bytes + (64 << 10):
            return ApiError(413, f"the file is over the upload limit of {max_file_bytes} bytes", "file").response()
        try:
            form = await request.form()
        except Exception as exc:  # noqa: BLE001 - not multipart, or a broken one: the client's 400
            return ApiError(400, f"send multipart/form-data with fields `file` and `purpose`: {exc}").response()
        try:
            return _store_upload(store, form, max_file_bytes)
        except ApiError as exc:
            return exc.response()
        finally:
            await form.close()

    @router.get("/v1/files")
    async def list_files(purpose: str | None = None):
        data = store.list_files(purpose)
        return {"object": "list", "data": data, "has_more": False,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return answer(lambda: existing_file(file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        return answer(lambda: FileResponse(store.file_path(existing_file(file_id)["id"]),
                                           media_type="application/octet-stream"))

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        def work():
            existing_file(file_id)
            store.delete_file(file_id)
            return {"id": file_id, "object": "file", "deleted": True}
        return answer(work)

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        body = await request.body()
        def work():
            fields = _create_fields(body)
            source = existing_file(fields["input_file_id"])
            if source["purpose"] != "batch":
                raise ApiError(400, f"file {source['id']} has purpose {source['purpose']!r}, not 'batch'",
                               "input_file_id")
            created = store.add_batch(**fields)
            jobs.wake()
            return created
        return answer(work)

    @router.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        if not 1 <= limit <= 100:
            return ApiError(400, f"limit must be in [1, 100], got {limit}", "limit").response()
        data, has_more = store.list_batches(after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return answer(lambda: existing_batch(batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        def work():
            found = existing_batch(batch_id)
            if found["status"] in ("validating", "in_progress"):
                store.update(batch_id, status="cancelling")
                jobs.wake()
            elif found["status"] != "cancelling":
                raise ApiError(400, f"batch {batch_id} is {found['status']}: only a validating or in_progress "
                               "batch can be cancelled", "batch_id")
            return store.get_batch(batch_id)
        return answer(work)

    return router


def _store_upload(store, form, max_file_bytes: int) -> dict:
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose not in FILE_PURPOSES:
        raise ApiError(400, f"purpose must be one of {list(FILE_PURPOSES)}, got {purpose!r}", "purpose")
    if upload is None or isinstance(upload, str):
        raise ApiError(400, "the form needs a `file` part (the JSONL input)", "file")
    if upload.size is not None and upload.size > max_file_bytes:
        raise ApiError(413, f"the file is {upload.size} bytes, over the upload limit of {max_file_bytes}", "file")
    return store.add_file(upload.filename or "upload.jsonl", purpose, upload.file)


def _create_fields(body: bytes) -> dict[str, Any]:
    """The checked fields of POST /v1/batches (OpenAI's, plus our batch-level defaults). Raises ApiError 400."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", "body")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise ApiError(400, f"missing required parameter `{name}` (a string)", name)
    if data["endpoint"] not in ROUTES:
        raise ApiError(400, f"endpoint {data['endpoint']!r} is not supported; use one of {', '.join(ROUTES)}",
                       "endpoint")
    if data["completion_window"] not in WINDOW_S:
        raise ApiError(400, f"completion_window must be one of {list(WINDOW_S)}, got "
                       f"{data['completion_window']!r}", "completion_window")
    metadata = data.get("metadata")
    if metadata is not None and not _good_metadata(metadata):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA_KEYS} string pairs (keys up "
                       "to 64 characters, values up to 512)", "metadata")
    try:
        defaults = BatchDefaults.parse({name: data.get(name) for name in BatchDefaults.model_fields})
    except RequestValidationError as exc:
        raise ApiError(400, exc.message, exc.field) from None
    return {"endpoint": data["endpoint"], "input_file_id": data["input_file_id"],
            "completion_window": data["completion_window"], "metadata": metadata,
            "defaults": defaults.model_dump(exclude_none=True)}


def _good_metadata(metadata: Any) -> bool:
    return (isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS
            and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items()))
