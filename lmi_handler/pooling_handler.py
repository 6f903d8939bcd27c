"""handle() for a pooling model (option.task text-embedding, rerank, classification): the DJL step protocol
answered whole, every item in the call that brings it (a pooling request is one prefill).

Owns the answer entries of both batch modes (DESIGN §2): rolling, each item's `data` is its whole JSON
answer with `last` true (an error: `code` and `error`, `last` true); dynamic, each item's answer under its
batch index (an error: its dialect's body and batch_{i}_code). The items of a call run at once so the engine
puts them in the same steps. What a route answers is pooling_answers.py's.
"""
from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

from lmi_handler.djl import Input, Output
from lmi_handler.pooling_answers import PoolingAnswers
from lmi_handler.pooling_service import QueueFull
from lmi_handler.protocol.dialects import dialect_of
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, RequestValidationError, error_body

logger = logging.getLogger(__name__)
ROUTE_PROPERTY = "X-Lmi-Route"      # handler.py's: the HTTP path, passed per item


class PoolingHandler:
    """handle(inputs) -> Output for a loaded PoolingAnswers; `rolling`: option.rolling_batch is not disable."""

    def __init__(self, answers: PoolingAnswers, rolling: bool, max_workers: int = 32):
        self.answers, self.rolling = answers, rolling
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pooling-item")

    def handle(self, inputs: Input) -> Output:
        items = inputs.get_batches()
        results = list(self.pool.map(self._answer, items))
        answer = Output()
        for index, (item, (body, code, error)) in enumerate(zip(items, results)):
            if self.rolling:
                self._rolling_entry(answer, index, item, body, code, error)
            else:
                answer.add(encode_bytes(body), key="data", batch_index=index)
                answer.add_property(f"batch_{index}_Content-Type", "application/json")
                if code != 200:
                    answer.add_property(f"batch_{index}_code", str(code))
        if not self.rolling:
            answer.add_property("content-type", "application/json")
        return answer

    def _answer(self, item: Input) -> tuple[object, int, str | None]:
        """(the item's answer object or error body, its status, the error's message or None)."""
        route = item.get_property(ROUTE_PROPERTY)
        dialect = dialect_of(route)
        try:
            return self.answers.answer(route, item.get_as_bytes("data")), 200, None
        except RequestValidationError as exc:
            code, message, field = exc.status_code, str(exc), exc.field
        except QueueFull as exc:
            code, message, field = 503, str(exc), None
        except Exception as exc:
            logger.exception("pooling request failed")
            code, message, field = GENERATION_ERROR_CODE, f"pooling failed: {exc}", None
        return error_body(dialect, message, code, field), code, message

    def _rolling_entry(self, answer: Output, index: int, item: Input, body, code: int, error: str | None) -> None:
        request_id = item.get_property("requestId") or uuid.uuid4().hex
        entry = {"data": encode_bytes(body).decode(), "last": "true", "content_type": "application/json",
                 "request_id": request_id}
        if error is not None:
            entry.update(data="", code=str(code), error=error)
        answer.add(Output.binary_encode(entry), key="data", batch_index=index)
        answer.add_property(f"batch_{index}_Content-Type", "application/json")
        answer.add_property(f"batch_{index}_requestId", request_id)
