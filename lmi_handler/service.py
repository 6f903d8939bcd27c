"""Service: one loaded model (settings, tokenizer, engine) and request preparation shared by every route.

Owns turning a parsed request into prompt token ids + SamplingParams + a response context;
the DJL step protocol is handler.py's and HTTP is server/'s.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from lmi_handler.config import Settings
from lmi_handler.engine.engine import Engine, RequestRejected
from lmi_handler.engine.sequence import SamplingParams, random_seed, wrap_int64
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.formatters import ResponseContext
from lmi_handler.protocol.invocations import ROUTE_CHAT, InvocationRequest
from lmi_handler.protocol.params import GenerationParameters

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A request ready for the engine: one prompt, its trusted params and how to answer it.

    `num_sequences` > 1 (n / best_of) runs that many engine sequences ("members") with seeds
    seed, seed+1, ...; the best by summed log prob answers, the others go to
    details.best_of_sequences (TGI).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    context: ResponseContext
    num_sequences: int = 1

    def members(self, front_end_seed: int | None = None) -> list[tuple[str, SamplingParams]]:
        """(engine request id, params) of each sequence; a single sequence keeps the request id."""
        if self.num_sequences == 1:
            return [(self.request_id, self.params)]
        base = self.params.seed
        if base is None:
            base = front_end_seed if front_end_seed is not None else random_seed()
        return [(f"{self.request_id}#{j}", replace(self.params, seed=wrap_int64(base + j)))
                for j in range(self.num_sequences)]


class Service:
    """The model and everything needed to prepare requests for it."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.engine = Engine(settings.engine_config())
        self.model_name = settings.model_path.resolve().name
        self._local = threading.local()
        self._local.tokenizer = self.engine.tokenizer

    @property
    def tokenizer(self):
        """This thread's tokenizer: HTTP handlers and the batching loop never share one instance
        (a Rust tokenizer used from two threads at once can fail with "Already borrowed")."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = self._local.tokenizer = AutoTokenizer.from_pretrained(str(self.settings.model_path))
        return tokenizer

    # ---- parsing ---------------------------------------------------------------------------

    def parse(self, body: bytes | str | dict, route: str | None = None,
              content_type: str | None = None) -> InvocationRequest:
        """Parse a body of /invocations (or of an OpenAI route, by `route`). Raises RequestValidationError."""
        return InvocationRequest.parse(body, content_type=content_type, route=route)

    def prepare(self, request: InvocationRequest, request_id: str | None = None) -> list[PreparedRequest]:
        """Tokenize, truncate and check each prompt of a parsed request against the context.

        Returns one PreparedRequest per prompt (a list of `inputs` gives several).
        Raises: RequestValidationError naming `inputs`/`max_new_tokens` when a prompt cannot fit.
        """
        params = request.parameters
        if not self.settings.is_rolling and request.stream and (request.is_openai or request.chat is not None):
            raise RequestValidationError("stream", "Invalid parameter `stream`: in dynamic batch only /invocations "
                                         "with `inputs` streams (as {\"outputs\": [...]} lines); chat and the "
                                         "OpenAI routes need the rolling batch")
        if request.is_openai and isinstance(request.inputs, list):
            raise RequestValidationError("prompt", "Invalid parameter `prompt`: one prompt per request is supported "
                                         f"here, got a list of {len(request.inputs)}")
        if self.settings.is_rolling and isinstance(request.inputs, list):
            raise RequestValidationError("inputs", "inputs must be one string in rolling batch "
                                         "(a list of strings needs option.rolling_batch=disable)")
        prompts = self._prompt_texts(request)
        prepared = []
        for index, (text, token_ids) in enumerate(prompts):
            token_ids = self._truncate(token_ids, params)
            sampling = self._openai_length(request, len(token_ids)).to_sampling_params(self.engine.eos_token_ids)
            self._check_token_ids(sampling.stop_token_ids)
            try:
                self.engine.check_fits(len(token_ids), sampling.max_new_tokens)
            except RequestRejected as exc:
                raise RequestValidationError(exc.field, str(exc)) from None
            rid = request_id or uuid.uuid4().hex
            if len(prompts) > 1:
                rid = f"{rid}-{index}"
            prepared.append(PreparedRequest(rid, token_ids, sampling, self.response_context(request, text, rid),
                                            self._num_sequences(request)))
        return prepared

    def _check_token_ids(self, token_ids: tuple[int, ...]) -> None:
        vocab_size = self.engine.runner.config.vocab_size
        bad = [t for t in token_ids if t >= vocab_size]
        if bad:
            raise RequestValidationError("stop_token_ids", f"Invalid parameter `stop_token_ids`: ids must be in "
                                         f"[0, {vocab_size - 1}] (the model's vocabulary), got {bad}")

    def _num_sequences(self, request: InvocationRequest) -> int:
        """n / best_of: several sequences, non-streaming /invocations only (TGI rule), at most a batch."""
        count = request.parameters.num_sequences
        if count == 1:
            return 1
        name = "best_of" if (request.parameters.best_of or 1) >= request.parameters.n else "n"
        if request.is_openai or request.chat is not None:
            raise RequestValidationError(name, f"Invalid parameter `{name}`: only 1 is supported for chat and on "
                                         f"the OpenAI routes, got {count}")
        if self.is_streaming(request):
            why = ("send stream=false" if request.stream else
                   f"option.output_formatter={self.settings.output_formatter} streams every response here")
            raise RequestValidationError(name, f"Invalid parameter `{name}`: {name} > 1 cannot be streamed "
                                         f"({why}), got {count}")
        if count > self.settings.max_rolling_batch_size:
            raise RequestValidationError(name, f"Invalid parameter `{name}`: must be at most "
                                         f"max_rolling_batch_size ({self.settings.max_rolling_batch_size}), got {count}")
        return count

    def _openai_length(self, request: InvocationRequest, num_prompt_tokens: int) -> GenerationParameters:
        """OpenAI chat route without max_tokens: what is left of the context (vLLM's rule)."""
        chat = request.chat
        if request.route != ROUTE_CHAT or chat.max_tokens or chat.max_completion_tokens:
            return request.parameters
        remaining = max(self.engine.max_model_len - num_prompt_tokens, 1)
        return request.parameters.model_copy(update={"max_new_tokens": remaining})

    def _prompt_texts(self, request: InvocationRequest) -> list[tuple[str, list[int]]]:
        if request.chat is not None:
            text = self.apply_chat_template(request.chat.text_messages())
            return [(text, self._encode(text, "messages", add_special_tokens=False))]
        field = "prompt" if request.completion is not None else "inputs"
        inputs = request.inputs if isinstance(request.inputs, list) else [request.inputs]
        return [(text, self._encode(text, field)) for text in inputs]

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Raises RequestValidationError for text that is not valid Unicode
        (JSON allows lone surrogates such as "\\ud800"; UTF-8 and the tokenizer do not)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestValidationError(field, f"Invalid parameter `{field}`: the text is not valid Unicode "
                                         f"({exc.reason} at position {exc.start})") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render chat messages with the tokenizer's chat template, ending in the assistant's turn."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja errors on malformed messages
            raise RequestValidationError("messages",
                                         f"messages cannot be rendered by the chat template: {exc}") from None

    @staticmethod
    def _truncate(token_ids: list[int], params: GenerationParameters) -> list[int]:
        """LMI/TGI `truncate`: keep the last N prompt tokens."""
        if params.truncate is not None and len(token_ids) > params.truncate:
            return token_ids[-params.truncate:]
        return token_ids

    def response_context(self, request: InvocationRequest, prompt_text: str, request_id: str) -> ResponseContext:
        params = request.parameters
        stream = self.is_streaming(request)
        openai = request.chat or request.completion
        return ResponseContext(
            stream=stream, details=params.wants_details(self.settings.tgi_compat),
            decoder_input_details=params.decoder_input_details,
            return_full_text=params.return_full_text, prompt_text=prompt_text,
            output_formatter=self.output_formatter(stream, request.is_openai),
            tgi_compat=self.settings.tgi_compat, chat=request.chat is not None,
            completion=request.completion is not None, model_name=self.model_name, request_id=request_id,
            created=int(time.time()), decode_token=self.decode_token,
            logprobs=bool(openai and openai.logprobs is not None and openai.logprobs is not False),
            include_usage=bool(openai and openai.include_usage))

    def is_streaming(self, request: InvocationRequest) -> bool:
        """`stream: true`, or (on /invocations) option.output_formatter set to jsonlines | sse."""
        if not self.settings.is_rolling:  # dynamic batch: {"outputs": [...]} lines when asked, never by option
            return bool(request.stream)
        if request.is_openai:
            return bool(request.stream)
        return bool(request.stream) or self.settings.output_formatter in ("jsonlines", "sse")

    def output_formatter(self, stream: bool, openai: bool = False) -> str:
        """json when not streaming; SSE on OpenAI routes; else option.output_formatter, else sse
        with tgi_compat, else jsonlines (LMI defaults)."""
        if not stream:
            return "json"
        if openai:
            return "sse"
        if self.settings.output_formatter and self.settings.output_formatter != "json":
            return self.settings.output_formatter
        return "sse" if self.settings.tgi_compat else "jsonlines"

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
