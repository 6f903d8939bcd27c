"""Service: one loaded model (settings, tokenizer, engine) and the request plan built from a request's bytes.

Owns turning bytes into a RequestPlan once (parse, tokenize, length checks, answer rules applied to
this server's settings); the DJL step protocol is handler.py's and HTTP is server/'s.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from lmi_handler.chat_template import ChatTemplate
from lmi_handler.config import ConfigError, Settings
from lmi_handler.custom_formatters import BUILTIN_OUTPUT_FORMATTERS, CustomFormatters, format_input
from lmi_handler.engine.engine import LORA_NOT_APPLIED, Engine, RequestRejected, RequestTooLong
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.lora import LoraAdapter, LoraError
from lmi_handler.engine.model.vision import MultimodalPrompt
from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.multimodal import MultimodalInputs
from lmi_handler.protocol import plan as rules
from lmi_handler.protocol import sequences
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.checkpoint_defaults import CheckpointDefaults
from lmi_handler.protocol.custom_output import CustomOutputRule
from lmi_handler.protocol.dialects import ROUTE_RESPONSES, Dialect, dialect_of
from lmi_handler.protocol.errors import RequestValidationError, check_unicode, show_value
from lmi_handler.protocol.invocations import InvocationRequest, load_json
from lmi_handler.protocol.openai import CompletionRequest
from lmi_handler.protocol.params import GenerationParameters
from lmi_handler.protocol.plan import Kind, Prompt, RequestPlan
from lmi_handler.protocol.responses import ResponseStore, renamed
from lmi_handler.protocol.sequences import Member

logger = logging.getLogger(__name__)

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"   # SageMaker's per-request adapter (LMI)

class Service:
    """The model and everything needed to plan requests for it."""

    def __init__(self, settings: Settings):
        from transformers import AutoTokenizer

        self.settings = settings
        self.engine = Engine(settings.engine_config())
        self.served_names = settings.served_model_names      # option.served_model_name; the first is answered
        self.model_name = self.served_names[0]
        # Requests are tokenized outside the engine's thread (the HTTP validation thread), so they get a
        # tokenizer of their own, used under a lock: a Rust tokenizer used from two threads at once can
        # fail with "Already borrowed". The engine's tokenizer stays the engine loop's alone.
        self.tokenizer = AutoTokenizer.from_pretrained(str(settings.model_path))
        self._tokenizer_lock = threading.Lock()
        # a vision-language checkpoint's processor and the images' limits; its chat template may live there
        self.media = MultimodalInputs(settings, self.model_name, read_config(settings.model_path), self._tokenizer_lock)
        self.chat_template = ChatTemplate(self.tokenizer, settings.chat_template_text() or self.media.chat_template,
                                          self._tokenizer_lock)
        # generation_config.json's sampling values for what requests leave out (option.generation_config)
        self.checkpoint_defaults = CheckpointDefaults.read(settings.model_path, settings.generation_config)
        self.formatters = self._load_formatters()
        self._load_startup_adapters()

    # ---- plans -----------------------------------------------------------------------------

    def plan(self, body: bytes | str | dict, route: str | None = None, content_type: str | None = None,
             request_id: str | None = None, adapter_header: str | None = None,
             responses_store: ResponseStore | None = None) -> RequestPlan:
        """Parse, tokenize and check a request of any route once. `adapter_header`: the
        X-Amzn-SageMaker-Adapter-Identifier header; `responses_store`: where /v1/responses finds a
        previous_response_id and keeps its answer. Raises RequestValidationError (status 400, 404 for a
        `model` not served under option.strict_model_name, an adapter not loaded or an unknown
        previous_response_id, 413 ...; FormatterError, 500, when model.py's input formatter fails) naming the field
        (a Responses request's fields by its own names)."""
        try:
            body = self._formatted_input(body, route, content_type, adapter_header)
            request = InvocationRequest.parse(body, content_type=content_type, route=route,
                                              responses_store=responses_store)
            return self.plan_request(request, request_id or uuid.uuid4().hex, adapter_header=adapter_header)
        except RequestValidationError as exc:
            if route == ROUTE_RESPONSES:      # it runs as a chat: the chat's checks name the chat's fields
                raise renamed(exc) from None
            raise

    def plan_openai_body(self, body: dict, url: str, request_id: str, kind: Kind = Kind.BATCH_LINE,
                         **generation: Any) -> RequestPlan:
        """The plan of an OpenAI-style body for `url` (/v1/chat/completions or /v1/completions), e.g. a batch
        file line. `generation` goes to to_generation_parameters (greedy_when_unset, defaults,
        default_max_new_tokens). Raises RequestValidationError."""
        return self.plan_request(InvocationRequest.parse_openai(body, url, **generation), request_id, kind)

    def plan_request(self, request: InvocationRequest, request_id: str, kind: Kind | None = None,
                     adapter_header: str | None = None) -> RequestPlan:
        """The plan of a parsed request: its kind, prompts (tokenized, truncated, checked against the
        context, each with its LoRA adapter), sequences and wire. Raises RequestValidationError."""
        settings = self.settings
        kind = kind or rules.kind_of(request.route, request.chat is not None, settings.is_rolling)
        request = replace(request, parameters=self.checkpoint_defaults.apply(request.parameters, kind))
        self._check_batching(request, kind)
        adapters = self._adapter_names(request, adapter_header)
        prompts = self._prompts(request, request_id, kind, adapters)
        wire_option = settings.output_formatter if settings.output_formatter in BUILTIN_OUTPUT_FORMATTERS else None
        why_streaming = rules.streaming_reason(kind, bool(request.stream), wire_option,
                                               rolling=settings.is_rolling, enable_streaming=settings.enable_streaming)
        stream = why_streaming is not None
        count = self._sequences(request, why_streaming)
        # `adapters` is [None] for the base: a request without `model` must not answer `"model": null`
        chosen = request.model is not None and request.model in adapters
        model_name = request.model if chosen else self.answering_model(request.model, kind)
        params = request.parameters
        openai = request.chat or request.completion
        return RequestPlan(
            request_id=request_id, kind=kind, shape=rules.shape_of(kind, request.route),
            wire=rules.wire_of(kind, stream, wire_option, settings.tgi_compat), stream=stream,
            prompts=prompts, sequences=count,
            details=params.wants_details(rules.details_by_default(kind, settings.tgi_compat)),
            decoder_input_details=params.decoder_input_details, return_full_text=params.return_full_text,
            tgi_names=rules.tgi_names(kind, settings.tgi_compat),
            logprobs=bool(openai and openai.logprobs is not None and openai.logprobs is not False),
            include_usage=bool(openai and openai.include_usage), model_name=model_name,
            sse_done=rules.sse_done_marker(settings.tgi_compat),
            created=int(time.time()), decode_token=self.decode_token,
            constraint_field=self._constraint_field(request),
            prompt_logprobs=params.prompt_logprobs is not None, chat_output=self._chat_output(request),
            echo_only=bool(request.completion and request.completion.echo_only), responses=request.responses,
            custom_output=self._custom_output(request, kind, adapters[0], count))

    @staticmethod
    def _constraint_field(request: InvocationRequest) -> str | None:
        """The field a constraint that fails to compile is named by: as sent (a Responses request: text.format
        for the chat's response_format)."""
        constraint = request.parameters.constraint
        if constraint is None:
            return None
        if request.responses is not None:
            return renamed(RequestValidationError(constraint[0], "")).field
        return constraint[0]

    def _chat_output(self, request: InvocationRequest) -> ChatOutputRule | None:
        """What a chat answer is parsed for (chat_output.py), decided here once: tool calls by the request's
        tool_choice (auto needs option.enable_auto_tool_choice, as vLLM's --enable-auto-tool-choice), reasoning by
        option.reasoning_parser unless the output is constrained (a schema from its first token leaves no room
        for reasoning: the whole output is the answer). None when there is nothing to parse. Raises
        RequestValidationError (400) for tool_choice auto on a server without it."""
        if request.chat is None:
            return None
        tools, settings = request.chat.tools, self.settings
        if tools is not None and tools.mode == "auto" and not settings.enable_auto_tool_choice:
            field = "function_call" if tools.legacy else "tool_choice"
            raise RequestValidationError(field, f'Invalid parameter `{field}`: "auto" tool choice (the default '
                                         "when tools are sent) needs option.enable_auto_tool_choice=true and "
                                         "option.tool_call_parser on this server; send \"required\", \"none\" "
                                         "or a named function")
        reasoning = settings.reasoning_parser if request.parameters.constraint is None else None
        if (tools is None or tools.mode == "none") and reasoning is None:
            return None
        return ChatOutputRule(reasoning, tools, settings.tool_call_parser)

    # ---- model.py's formatters (LMI's custom formatters: custom_formatters.py) --------------

    def _load_formatters(self) -> CustomFormatters:
        """model.py's formatters: DJL's model_dir's model.py (when model_dir was given: the current directory is
        never searched), else the checkpoint folder's. Raises ConfigError for a model.py that cannot be imported
        (its traceback's last line), an option.output_formatter naming no function of it, or an output formatter
        under dynamic batch (its answers are whole lists)."""
        settings = self.settings
        given = [Path(settings.model_dir)] if "model_dir" in settings.model_fields_set else []
        formatters = CustomFormatters.load([*given, settings.model_path], settings.output_formatter)
        formatters.check_batching(settings.is_rolling)
        return formatters

    def _formatted_input(self, body: bytes | str | dict, route: str | None, content_type: str | None,
                         adapter_header: str | None) -> bytes | str | dict:
        """An LMI body (/invocations, DJL's items) through model.py's input formatter, the adapter's (by the
        header or the body's `adapters`) else the base model's: the decoded JSON object in, the object the
        parser reads out. Other routes and text/plain bodies pass as they are. Raises RequestValidationError
        (400 a body that is no JSON object; FormatterError, 500, when the formatter fails)."""
        plain = (content_type or "").split(";")[0].strip().lower() == "text/plain"
        if not self.formatters.any_input or plain or dialect_of(route) is not Dialect.LMI:
            return body
        payload = load_json(body)
        named = payload.get("adapters")
        formatter = self.formatters.input_for(adapter_header or (named if isinstance(named, str) else None))
        if formatter is None:
            return payload
        with self._tokenizer_lock:    # the formatter may use the tokenizer
            return format_input(formatter, payload, self.tokenizer)

    def _custom_output(self, request: InvocationRequest, kind: Kind, adapter: str | None,
                       count: sequences.SequencePlan) -> CustomOutputRule | None:
        """model.py's output formatter for LMI text requests only (chat and the other routes keep their APIs'
        shapes). Raises RequestValidationError (400) for several sequences (CustomFormatters.output_rule)."""
        return self.formatters.output_rule(adapter, request.parameters, count.count) if kind is Kind.LMI_TEXT else None

    # ---- LoRA adapters ---------------------------------------------------------------------

    def _adapter_names(self, request: InvocationRequest, header: str | None) -> list[str | None]:
        """Each prompt's adapter (None = the base), by the first of: the body's `adapters` (LMI; a list gives
        one per input), the X-Amzn-SageMaker-Adapter-Identifier header, TGI's parameters.adapter_id, an OpenAI
        `model` that names a loaded adapter (vLLM). Raises RequestValidationError: 400 LoRA off, 404 not
        loaded, 501 the runner cannot apply adapters (tensor parallelism)."""
        sources = ((request.adapters, "adapters"), (header, ADAPTER_HEADER),
                   (request.parameters.adapter_id, "parameters.adapter_id"))
        chosen, field = next(((value, name) for value, name in sources if value), (None, None))
        if chosen is None and request.model is not None and self._is_adapter(request.model):
            chosen, field = request.model, "model"
        if chosen is None:
            return [None]
        names = chosen if isinstance(chosen, list) else [chosen]
        for name in dict.fromkeys(names):
            self._check_adapter(name, field)
        return names

    def _is_adapter(self, name: str) -> bool:
        adapters = self.engine.adapters
        return adapters is not None and not self.serves(name) and name in adapters

    def _check_adapter(self, name: str, field: str) -> None:
        if self.engine.adapters is None:
            raise RequestValidationError(field, f"Invalid parameter `{field}`: adapter {name!r} requested but LoRA "
                                         "adapters are off on this server (option.enable_lora=false)")
        if name not in self.engine.adapters:
            loaded = ", ".join(a.name for a in self.engine.adapters.adapters()) or "none"
            raise RequestValidationError(field, f"The adapter `{name}` does not exist (loaded adapters: {loaded})",
                                         status_code=404)
        if not self.engine.applies_lora:
            raise RequestValidationError(field, LORA_NOT_APPLIED, status_code=501)

    def _load_startup_adapters(self) -> None:
        """LMI's `<model>/adapters/<name>/` folders, then option.lora_modules (vLLM). Raises ConfigError naming
        the adapter that cannot load, or when they are more than option.max_cpu_loras."""
        registry = self.engine.adapters
        if registry is None:
            return
        folder = self.settings.model_path / "adapters"
        found = [(p.name, p) for p in sorted(folder.iterdir()) if p.is_dir()] if folder.is_dir() else []
        found += list(self.settings.lora_modules_list)
        if len(found) > registry.limits.max_cpu_loras:
            raise ConfigError(f"option.max_cpu_loras={registry.limits.max_cpu_loras} holds fewer than the "
                              f"{len(found)} adapters to load at start-up ({', '.join(n for n, _ in found)})")
        for name, path in found:
            try:
                registry.load(name, path, check_root=False)
            except LoraError as exc:
                raise ConfigError(f"LoRA adapter {name!r} ({path}) cannot be loaded: {exc}") from None
            self.formatters.load_adapter(name, path)      # its own model.py; ConfigError refuses the start
        self.formatters.check_batching(self.settings.is_rolling)
        if found:
            logger.info("LoRA adapters loaded: %s", ", ".join(n for n, _ in found))

    def load_adapter(self, name: str, src: str) -> LoraAdapter:
        """The adapter APIs' load: `src` must be under option.lora_adapter_roots or `<model>/adapters`.
        Raises LoraError (400 bad adapter or LoRA off, 409 name taken, 503 no room); nothing changes then."""
        if self.engine.adapters is None:
            raise LoraError("LoRA adapters are off on this server (option.enable_lora=false)")
        if self.serves(name):
            raise LoraError(f"adapter name {name!r} is the base model's served name", 409, "name")
        adapter = self.engine.adapters.load(name, src)      # checks `src` against the roots first
        try:
            self.formatters.load_adapter(name, adapter.path)
            self.formatters.check_batching(self.settings.is_rolling)
        except ConfigError as exc:          # LMI: an adapter whose model.py fails is not registered
            self.formatters.unload_adapter(name)
            self.engine.adapters.unload(name)
            raise LoraError(str(exc)) from None
        return adapter

    def unload_adapter(self, name: str) -> None:
        """Raises LoraError (400 LoRA off, 404 not loaded)."""
        if self.engine.adapters is None:
            raise LoraError("LoRA adapters are off on this server (option.enable_lora=false)")
        self.engine.adapters.unload(name)
        self.formatters.unload_adapter(name)

    def _check_batching(self, request: InvocationRequest, kind: Kind) -> None:
        if not self.settings.is_rolling and request.stream and kind is not Kind.DYNAMIC_LIST:
            raise RequestValidationError("stream", "Invalid parameter `stream`: in dynamic batch only /invocations "
                                         "with `inputs` streams (as {\"outputs\": [...]} lines); chat and the "
                                         "OpenAI routes need the rolling batch")
        if kind is Kind.BATCH_LINE and request.completion is not None and len(request.completion.prompts) > 1:
            raise RequestValidationError("prompt", "Invalid parameter `prompt`: a batch line takes one prompt (one "
                                         f"line per prompt), got a list of {len(request.completion.prompts)}")
        if kind is not Kind.DYNAMIC_LIST and isinstance(request.inputs, list):
            raise RequestValidationError("inputs", "inputs must be one string in rolling batch "
                                         "(a list of strings needs option.rolling_batch=disable)")

    def serves(self, name: str) -> bool:
        """`name` is one of option.served_model_name's (DJL's /predictions/{name} routes by it)."""
        return name in self.served_names

    def answering_model(self, requested: str | None, kind: Kind) -> str:
        """The served-model rule, decided here only: the name a request's answer carries (the first served
        name), whatever `model` it sent. Batch lines take any `model` (the OpenAI batch input format: the
        loaded model answers); so do the live routes by default, as TGI and LMI do (Hugging Face's
        InferenceClient sends "tgi"). With option.strict_model_name=true the OpenAI routes answer 404 for a
        name not served, as vLLM does. Raises RequestValidationError (404)."""
        strict = self.settings.strict_model_name and kind in (Kind.OPENAI_CHAT, Kind.OPENAI_COMPLETION,
                                                              Kind.OPENAI_RESPONSES)
        if strict and requested is not None and not self.serves(requested) and not self._is_adapter(requested):
            raise RequestValidationError("model", f"The model `{requested}` does not exist (this server serves "
                                         f"{', '.join(map(repr, self.served_names))})", status_code=404)
        return self.model_name

    def _sequences(self, request: InvocationRequest, why_streaming: str | None) -> sequences.SequencePlan:
        """n / best_of by the dialect's rule (protocol/sequences.py)."""
        params = request.parameters
        openai = request.chat or request.completion
        if params.num_beams > 1:    # one engine request: its best beams answer (protocol/sequences.beam_search)
            return sequences.beam_search(params.num_beams, openai.n if openai is not None else 1,
                                         stream=why_streaming is not None)
        if openai is not None:      # OpenAI routes, batch lines and LMI chat: OpenAI's n (and legacy best_of)
            best_of = openai.best_of if isinstance(openai, CompletionRequest) else None
            return sequences.openai_n(openai.n, best_of, stream=why_streaming is not None,
                                      max_count=self.settings.max_rolling_batch_size)
        return sequences.tgi_best_of(params.n, params.best_of, streaming_why=why_streaming,
                                     max_count=self.settings.max_rolling_batch_size)

    def _prompts(self, request: InvocationRequest, request_id: str, kind: Kind,
                 adapters: list[str | None]) -> tuple[Prompt, ...]:
        texts = self._prompt_texts(request)
        try:
            self.engine.check_priority(request.parameters.priority)
        except RequestRejected as exc:      # named as every parameter is (LMI's sit in `parameters`)
            raise RequestValidationError("priority", f"Invalid parameter `priority`: {exc}") from None
        prompts = []
        for index, (text, token_ids, images) in enumerate(texts):
            token_ids = self._truncate(token_ids, request.parameters, images is not None)
            generation = self._openai_length(request, kind, len(token_ids))
            params = self._echo_logprobs(request, self._token_controls(generation, generation.to_sampling_params()))
            params = replace(params, adapter=adapters[index % len(adapters)], multimodal=images)
            try:
                self.engine.check_fits(len(token_ids), params.max_new_tokens, params.num_beams)
            except RequestTooLong as exc:
                raise self._length_error(request, exc) from None
            except RequestRejected as exc:       # num_beams past the batch: OpenAI's beams are its `n`
                field = "n" if request.chat or request.completion else exc.field
                raise RequestValidationError(field, f"Invalid parameter `{field}`: {exc}") from None
            rid = f"{request_id}-{index}" if len(texts) > 1 else request_id
            prompts.append(Prompt(rid, text, tuple(token_ids), params))
        return tuple(prompts)

    @staticmethod
    def _length_error(request: InvocationRequest, exc: RequestTooLong) -> RequestValidationError:
        """The 400 for a request too long for the context or the KV cache, in its dialect's names, from the
        numbers the engine's error carries.

        LMI/TGI keep the engine's message (`inputs`, `max_new_tokens`, `parameters.truncate`). OpenAI
        routes and batch lines name their own fields (`messages` or `prompt`; `max_completion_tokens`
        or `max_tokens`, whichever was sent), with vLLM's/OpenAI's context-length wording.
        """
        openai = request.chat or request.completion
        if openai is None:
            return RequestValidationError(exc.field, str(exc))
        prompt_field = "messages" if request.chat is not None else "prompt"
        sent = {"max_completion_tokens": openai.max_completion_tokens, "max_tokens": openai.max_tokens}
        length_field = next((name for name, value in sent.items() if value is not None), None)
        num_prompt_tokens, limit = exc.num_prompt_tokens, exc.limit
        what = "This model's maximum context length" if exc.limit_name == "context" else "This server's KV cache"
        asked = (f"you requested {num_prompt_tokens + exc.max_new_tokens} tokens ({num_prompt_tokens} in the "
                 f"{prompt_field}, {exc.max_new_tokens} for the completion)")
        fix = f"reduce the length of the {prompt_field}" + (f" or `{length_field}`" if length_field else "")
        field = length_field if length_field and num_prompt_tokens < limit else prompt_field
        return RequestValidationError(field, f"{what} is {limit} tokens. However, {asked}. Please {fix}.")

    def add_members(self, prompt_token_ids: tuple[int, ...], request_members: list[Member]) -> None:
        """Queue every engine sequence of a prompt (n / best_of give several); if one is refused, the ones
        already queued are dropped and the error goes on (RequestRejected, a bug)."""
        added: list[str] = []
        try:
            for member in request_members:
                self.engine.add_request(member.request_id, list(prompt_token_ids), member.params)
                added.append(member.request_id)
        except Exception:
            for request_id in added:
                self.engine.abort(request_id)
            raise

    def add_prompts(self, plan: RequestPlan, members_by_prompt: list[list[Member]]) -> list[Member]:
        """Queue every prompt's sequences (completions may carry a list of prompts); returns them all, prompt
        by prompt. If one is refused, those already queued are dropped and the error goes on."""
        added: list[Member] = []
        try:
            for prompt, request_members in zip(plan.prompts, members_by_prompt):
                self.add_members(prompt.token_ids, request_members)
                added += request_members
        except Exception:
            for member in added:
                self.engine.abort(member.request_id)
            raise
        return added

    def _token_controls(self, generation: GenerationParameters, params: SamplingParams) -> SamplingParams:
        """The controls that need the model: token ids checked against its vocabulary (stop_token_ids,
        logit_bias, allowed_token_ids), bad words as token ids (vLLM: each word as written and with a
        leading space, so it is banned at the start of a word too). Raises RequestValidationError."""
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", tuple(t for t, _ in params.logit_bias))
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        if not generation.bad_words:
            return params
        words: dict[tuple[int, ...], None] = {}
        for word in generation.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                words.setdefault(tuple(self._encode(text, "bad_words", add_special_tokens=False)), None)
        return replace(params, bad_words=tuple(w for w in words if w))

    @staticmethod
    def _echo_logprobs(request: InvocationRequest, params: SamplingParams) -> SamplingParams:
        """Completions' echo with logprobs k: the prompt tokens' log probs (and their k best alternatives) are
        answered too, as OpenAI's legacy API and vLLM do (lm-evaluation-harness scores prompts so)."""
        completion = request.completion
        if completion is None or not completion.echo or completion.logprobs is None:
            return params
        return replace(params, prompt_logprobs=True,
                       prompt_top_n_tokens=max(params.prompt_top_n_tokens, completion.logprobs))

    def _check_token_ids(self, field: str, token_ids: tuple[int, ...]) -> None:
        vocab_size = self.engine.runner.config.vocab_size
        bad = [t for t in token_ids if t >= vocab_size]
        if bad:
            raise RequestValidationError(field, f"Invalid parameter `{field}`: ids must be in "
                                         f"[0, {vocab_size - 1}] (the model's vocabulary), got {show_value(bad)}")

    def _openai_length(self, request: InvocationRequest, kind: Kind, num_prompt_tokens: int) -> GenerationParameters:
        """OpenAI chat route (and /v1/responses) without max_tokens: what is left of the context (vLLM's rule)."""
        chat = request.chat
        if kind not in (Kind.OPENAI_CHAT, Kind.OPENAI_RESPONSES) or chat.max_tokens or chat.max_completion_tokens:
            return request.parameters
        remaining = max(self.engine.max_model_len - num_prompt_tokens, 1)
        return request.parameters.model_copy(update={"max_new_tokens": remaining})

    def _prompt_texts(self, request: InvocationRequest) -> list[tuple[str, list[int], MultimodalPrompt | None]]:
        """Each prompt's text, token ids and images (chat's image parts, `inputs`' markdown ones: multimodal/)."""
        media = self.media
        if request.chat is not None:
            text = self.chat_template.render(request.chat, multimodal=media.serves_images)
            return [media.tokenized(text, request.chat.image_parts(), "messages", self._encode, False)]
        if request.completion is not None:
            return [(*self._completion_prompt(prompt), None) for prompt in request.completion.prompts]
        inputs = request.inputs if isinstance(request.inputs, list) else [request.inputs]
        return [media.tokenized(text, media.markdown_parts(text), "inputs", self._encode) for text in inputs]

    def _completion_prompt(self, prompt: str | list[int]) -> tuple[str, list[int]]:
        """A completions prompt's text and ids: text is tokenized, token ids checked against the vocabulary
        and decoded (the text echo answers). Raises RequestValidationError naming `prompt`."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, "prompt")
        return self.decode(prompt, "prompt"), list(prompt)

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Raises RequestValidationError for text that is not valid Unicode
        (JSON allows lone surrogates such as "\\ud800"; UTF-8 and the tokenizer do not)."""
        check_unicode(text, field)
        with self._tokenizer_lock:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each one's character span in it (the token routes). Raises
        RequestValidationError naming `field` for text that is not valid Unicode."""
        check_unicode(text, field)
        with self._tokenizer_lock:
            encoding = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [tuple(span) for span in encoding["offset_mapping"]]

    def decode(self, token_ids: list[int], field: str = "tokens") -> str:
        """The text of `token_ids`, special tokens kept (vLLM's /detokenize). Raises RequestValidationError
        naming `field` for ids outside the vocabulary."""
        self._check_token_ids(field, tuple(token_ids))
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary string (vLLM's return_token_strs: convert_ids_to_tokens)."""
        with self._tokenizer_lock:
            return self.tokenizer.convert_ids_to_tokens(token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render chat messages with the chat template (chat_template.py), ending in the assistant's turn.
        Raises RequestValidationError (400 naming `messages`)."""
        return self.chat_template.apply(messages)

    @staticmethod
    def _truncate(token_ids: list[int], params: GenerationParameters, images: bool = False) -> list[int]:
        """LMI/TGI `truncate`: keep the last N prompt tokens (a prompt with images is never cut: 400)."""
        if params.truncate is not None and len(token_ids) > params.truncate:
            if images:
                raise RequestValidationError("truncate", "Invalid parameter `truncate`: a prompt with images is "
                                             f"not cut ({len(token_ids)} tokens, its images' included)")
            return token_ids[-params.truncate:]
        return token_ids

    def decode_token(self, token_id: int) -> str:
        """One token's text (top-token alternatives); called by formatters in the engine's thread."""
        with self._tokenizer_lock:
            return self.tokenizer.decode([token_id])
