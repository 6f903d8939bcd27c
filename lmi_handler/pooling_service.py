"""PoolingService: one loaded pooling model (tokenizer, PoolingEngine and the thread that steps it) and the
three things a pooling route asks of it: embed, score, classify.

Owns tokenizing the queries (sentence-transformers' prompts, cross-encoder pairs with their token types,
truncation or a 400 naming the field), the engine loop (requests of every route gathered into the same
steps: many sequences per step, first come first served) and the queue's bound (option.job_queue_size
requests waiting: a 503 beyond). The routes and their bodies are server/pooling.py's and protocol/'s; the
engine is engine/pooling_engine.py's.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future

import torch

from lmi_handler.config import Settings
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.pooling import activate, finish_embedding, resolve_task
from lmi_handler.engine.pooling_engine import PoolingEngine, PoolingOutput, PoolingRequest
from lmi_handler.engine.precision import pick_device, pick_precision
from lmi_handler.protocol.embeddings import EmbedQuery
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.rerank import ClassifyQuery, ScoreQuery

logger = logging.getLogger(__name__)


def served_task(settings: Settings) -> str:
    """option.task with auto resolved by the checkpoint (engine/pooling.resolve_task); text-generation where
    no local config.json says otherwise (a Hub id is fetched by the generation start-up)."""
    if settings.task != "auto":
        return settings.task
    if not (settings.model_path / "config.json").is_file():
        return "text-generation"
    return resolve_task("auto", settings.model_path, read_config(settings.model_path))


class QueueFull(RuntimeError):
    """option.job_queue_size requests are already waiting (answered 503)."""


class PoolingService:
    """Load the model of `settings` (option.task a pooling task, or auto resolved to one) and start its loop."""

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        config = settings.engine_config()
        device = pick_device(config.device_id)
        precision = pick_precision(config, device)
        logger.info("%s", precision.reason)
        self.settings = settings
        self.engine = PoolingEngine(config.model_path, precision.dtype, device, settings.task, settings.pooling,
                                    settings.normalize, config.max_num_seqs, config.max_num_batched_tokens,
                                    config.max_model_len, config.kernel_backend, precision.quantize)
        self.pooler = self.engine.pooler
        self.tokenizer = AutoTokenizer.from_pretrained(str(config.model_path))
        self._tokenizer_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._max_waiting = settings.job_queue_size
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="pooling-engine", daemon=True)
        self._thread.start()
        logger.info("pooling model loaded: task %s, pooling %s, normalize %s, %d dimensions", self.engine.task,
                    self.pooler.mode, self.pooler.normalize, self.pooler.dimensions)

    @property
    def task(self) -> str:
        return self.engine.task

    def stop(self) -> None:
        self._queue.put(None)

    def embed(self, query: EmbedQuery) -> tuple[list[list[float]], int]:
        """(one vector per input, as lists of floats; the tokens counted). Raises RequestValidationError."""
        self._check_task("text-embedding")
        if query.dimensions is not None and query.dimensions > self.pooler.dimensions:
            raise RequestValidationError("dimensions", f"dimensions={query.dimensions} is more than the model's "
                                                       f"{self.pooler.dimensions}")
        prompt, skip = self._prompt(query.prompt_name)
        requests = [self._request(item, query.field, query.truncate, prompt, skip) for item in query.inputs]
        normalize = self.pooler.normalize if query.normalize is None else query.normalize
        outputs = self._run(requests)
        vectors = [finish_embedding(o.vector, normalize, query.dimensions).tolist() for o in outputs]
        return vectors, sum(o.num_tokens for o in outputs)

    def score(self, query: ScoreQuery) -> tuple[list[float], int]:
        """One score per (query, text) pair: the classifier's first logit through its activation (raw_scores:
        the logit)."""
        self._check_task("rerank", "classification")
        requests = [self._pair(a, b, query.truncate) for a, b in query.pairs]
        outputs = self._run(requests)
        scores = [(o.logits if query.raw_scores else activate(o.logits, self.pooler.activation))[0].item()
                  for o in outputs]
        return scores, sum(o.num_tokens for o in outputs)

    def classify(self, query: ClassifyQuery) -> tuple[list[list[float]], int]:
        """Each input's class probabilities (raw_scores: logits), in label order."""
        self._check_task("rerank", "classification")
        requests = [self._pair(*item, query.truncate) if isinstance(item, tuple)
                    else self._request(item, "inputs", query.truncate, "", 0) for item in query.inputs]
        outputs = self._run(requests)
        probs = [(o.logits if query.raw_scores else activate(o.logits, self.pooler.activation)).tolist()
                 for o in outputs]
        return probs, sum(o.num_tokens for o in outputs)

    def _check_task(self, *tasks: str) -> None:
        if self.engine.task not in tasks:
            raise RequestValidationError("task", f"option.task: this model serves {self.engine.task}, not {' or '.join(tasks)} "
                                                 "(option.task)", 400)

    def _prompt(self, name: str | None) -> tuple[str, int]:
        """The prompt text of `name` (or the checkpoint's default prompt) and its token count (without the
        end token the tokenizer adds, as sentence-transformers counts it)."""
        name = name if name is not None else self.pooler.default_prompt_name
        if name is None:
            return "", 0
        if name not in self.pooler.prompts:
            raise RequestValidationError("prompt_name", f"prompt_name {name!r} is not one of the model's prompts "
                                                        f"{sorted(self.pooler.prompts)}")
        prompt = self.pooler.prompts[name]
        with self._tokenizer_lock:
            count = len(self.tokenizer(prompt)["input_ids"]) - 1
        return prompt, max(count, 0)

    def _request(self, item, field: str, truncate: bool, prompt: str, skip: int) -> PoolingRequest:
        if isinstance(item, list):
            ids = item
        else:
            with self._tokenizer_lock:
                ids = self.tokenizer(prompt + item)["input_ids"]
        return PoolingRequest(f"p{next(self._ids)}", self._fit(ids, field, truncate), None, skip)

    def _pair(self, first: str, second: str, truncate: bool) -> PoolingRequest:
        with self._tokenizer_lock:
            enc = self.tokenizer(first, second)
        ids, types = enc["input_ids"], enc.get("token_type_ids")
        ids = self._fit(ids, "texts", truncate)
        return PoolingRequest(f"p{next(self._ids)}", ids, types[:len(ids)] if types else None)

    def _fit(self, ids: list[int], field: str, truncate: bool) -> list[int]:
        limit = self.engine.max_model_len
        if truncate and len(ids) > limit:
            return ids[:limit]
        if len(ids) > limit and not truncate:
            raise RequestValidationError(field, f"{field}: an input has {len(ids)} tokens, more than the model's {limit} "
                                                "(ask for truncation: truncate / truncate_prompt_tokens)")
        if not ids:
            raise RequestValidationError(field, f"{field}: an input is empty")
        if max(ids) >= self.engine.vocab_size:
            raise RequestValidationError(field, f"{field}: token id {max(ids)} is past the model's vocabulary "
                                                f"({self.engine.vocab_size} ids)")
        return ids

    def _run(self, requests: list[PoolingRequest]) -> list[PoolingOutput]:
        if self._queue.qsize() >= self._max_waiting:
            raise QueueFull(f"{self._max_waiting} requests are waiting (option.job_queue_size)")
        future: Future = Future()
        self._queue.put((requests, future))
        return future.result()

    def _loop(self) -> None:
        """Take every waiting request, step the engine until they are answered, again."""
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            if any(item is None for item in items):
                return
            try:
                for requests, _ in items:
                    for request in requests:
                        self.engine.add_request(request)
                done: dict[str, PoolingOutput] = {}
                with torch.inference_mode():
                    while self.engine.has_unfinished():
                        done.update((o.request_id, o) for o in self.engine.step())
                for requests, future in items:
                    future.set_result([done[r.request_id] for r in requests])
            except Exception as exc:
                logger.exception("pooling step failed")
                self.engine.waiting.clear()
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
