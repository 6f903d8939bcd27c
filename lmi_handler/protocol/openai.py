"""OpenAI chat/completions wire schema: requests -> GenerationParameters, and response/chunk/error dicts.

Owns OpenAI's words (finish_reason "stop", usage, logprobs shapes); error objects are errors.py's, bytes the encoder's.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from lmi_handler.engine.sequence import FinishReason, TokenOutput
from lmi_handler.protocol.content import ImagePart, check_parts, image_parts, template_message
from lmi_handler.protocol.decoding import CONSTRAINT_FIELDS
from lmi_handler.protocol.errors import RequestValidationError, from_pydantic
from lmi_handler.protocol.params import INT64_MAX, INT64_MIN, MAX_TOP_N_TOKENS, RULES, GenerationParameters
from lmi_handler.protocol.tools import ToolRequest, parse_tool_request

MAX_TEMPERATURE = 2.0            # OpenAI: temperature in [0, 2]
MAX_COMPLETION_LOGPROBS = 5      # OpenAI legacy completions: logprobs at most 5

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")   # function: legacy, sent as tool
OPENAI_RULES: dict[str, str] = {
    **RULES,
    "model": "a string",
    "messages": f"a non-empty list of {{role, content}} objects (role one of {', '.join(ROLES)}; "
                "content a string or a list of text and image_url parts; only assistant messages may omit it)",
    "prompt": "a non-empty string, a non-empty list of token ids (integers >= 0), or a non-empty list of either "
              "(one choice set per prompt)",
    "max_tokens": "an integer >= 1",
    "max_completion_tokens": "an integer >= 1",
    "stop": RULES["stop_sequences"],
    "stream": "true or false",
    "stream_options": 'an object {"include_usage": true|false}',
    "echo": "true or false",
    "top_logprobs": f"an integer in [0, {MAX_TOP_N_TOKENS}] (needs logprobs=true)",
    "logprobs": f"true or false on chat; an integer in [0, {MAX_COMPLETION_LOGPROBS}] on completions (OpenAI)",
    "temperature": f"a number in [0, {MAX_TEMPERATURE:g}] (OpenAI; 0 = greedy)",
    "n": "an integer >= 1 (choices to return)",
    "user": "a string",
    "chat_template_kwargs": "an object of extra variables for the chat template (e.g. {\"enable_thinking\": false})",
    "add_generation_prompt": "true or false (end the prompt with the assistant's turn opened)",
    "continue_final_message": "true or false (continue the last assistant message; needs add_generation_prompt "
                              "false)",
}
# Chat fields about tools (protocol/tools.py checks them; completions refuse them as not implemented)
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
# apply_chat_template's own parameters: chat_template_kwargs may not set them (vLLM leaves them out too)
TEMPLATE_PARAMETERS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
# OpenAI field -> GenerationParameters field, to name the client's field in errors.
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop_sequences": "stop", "top_n_tokens": "top_logprobs",
                "return_full_text": "echo", "truncate": "truncate_prompt_tokens", "do_sample": "use_beam_search"}
_FINISH_REASONS = {FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop",
                   FinishReason.LENGTH: "length", FinishReason.ERROR: "error"}


def to_openai_finish_reason(reason: FinishReason | None) -> str | None:
    """LMI finish_reason -> OpenAI's: eos_token and stop_sequence -> "stop", length -> "length".

    error -> "error" (OpenAI has no word for it; vLLM's streaming also reports errors in-band).
    """
    return None if reason is None else _FINISH_REASONS[FinishReason(reason)]


# vLLM/OpenAI fields GenerationParameters checks (and names in errors) as the OpenAI body spells them: the
# logits controls and the structured-output constraints (protocol/decoding.py)
PASSED_THROUGH = ("logit_bias", "min_tokens", "bad_words", "allowed_token_ids", "prompt_logprobs",
                  *CONSTRAINT_FIELDS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = Field(False, description="OpenAI: send a last chunk with usage and no choices")


# Fields other servers honour that would change the answer, which this one does not implement (tools and
# functions: on completions; chat takes them, protocol/tools.py): sent with
# a value other than the neutral one, they are refused (400 naming the field) rather than ignored, so a
# client never gets an answer that silently dropped a constraint. Neutral values pass (clients such as
# text-generation's `chat` send `"tools": null`; nulls never reach this check).
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "suffix": ("",), "logits_processors": ([],), "best_of": (1,),      # best_of: chat only (completions implement it)
}
EMPTY = ({}, [], "")   # neutral for every field above


def _refuse_not_implemented(given: dict[str, Any]) -> None:
    """Raise RequestValidationError (400) for the first NOT_IMPLEMENTED field with a non-neutral value."""
    for name, neutral in NOT_IMPLEMENTED.items():
        if name in given and given[name] not in neutral and given[name] not in EMPTY:
            raise RequestValidationError(name, f"Invalid parameter `{name}`: not supported by this server "
                                         f"(leave it out{' or send ' + repr(neutral[0]) if neutral else ''})")


class _SamplingRequest(BaseModel):
    """Fields shared by chat and completions (OpenAI, plus the vLLM extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = Field(None, description="OpenAI: model name; informational here (one model served)")
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                                      description="OpenAI: [0, 2]; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description="OpenAI: (0, 1]")
    top_k: int | None = Field(None, ge=-1, description="vLLM: >= 1 keeps k tokens; 0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False, description="vLLM: [0, 1]")
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False, description="vLLM: > 0")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False, description="OpenAI: [-2, 2]")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False,
                                            description="OpenAI: [-2, 2]")
    n: int = Field(1, ge=1, description="OpenAI: choices to return, >= 1 (protocol/sequences.openai_n)")
    stream: bool = Field(False, description="OpenAI: answer as server-sent chunks")
    stream_options: StreamOptions | None = None
    stop: list[str] | str | None = Field(None, description="OpenAI: up to 16 stop strings (ours; OpenAI allows 4)")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="OpenAI: sampling seed, int64")
    max_tokens: int | None = Field(None, ge=1, description="OpenAI: generated tokens at most")
    ignore_eos: bool = Field(False, description="vLLM: keep generating past eos")
    stop_token_ids: list[int] | None = Field(None, description="vLLM: token ids that end generation")
    include_stop_str_in_output: bool = Field(False, description="vLLM: keep the stop string in the text")
    skip_special_tokens: bool = Field(True, description="vLLM: leave special tokens out of the text")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="vLLM: keep only the last k prompt tokens "
                                               "(LMI/TGI `truncate`)")
    user: str | None = None
    # vLLM beam search: n beams (completions: max(n, best_of)), the n best answered as choices
    use_beam_search: bool = Field(False, description="vLLM: beam search of width n; the n best beams answer")
    length_penalty: float | None = Field(None, allow_inf_nan=False, description="vLLM/transformers beam score "
                                         "exponent")
    early_stopping: bool | Literal["never"] | None = Field(None, description="vLLM/transformers beam stopping")
    guided_decoding_backend: str | None = Field(None, description="legacy vLLM: the grammar library; llguidance "
                                                "here whatever is named (the constraint is the same)")
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="vLLM: lower is served first "
                                 "(option.scheduling_policy=priority); default 0")
    _decoding: dict[str, Any] = PrivateAttr(default_factory=dict)   # PASSED_THROUGH fields as sent

    rules: ClassVar[dict[str, str]] = OPENAI_RULES     # each field's allowed values in words, for errors

    @classmethod
    def parse(cls, data: Any):
        """Validate an OpenAI request body (a dict). Raises RequestValidationError naming the field."""
        if not isinstance(data, dict):
            raise RequestValidationError.out_of_range("body", data, "a JSON object")
        given = {key: value for key, value in data.items() if value is not None}
        decoding = {key: given.pop(key) for key in PASSED_THROUGH if key in given}
        _refuse_not_implemented({k: v for k, v in given.items() if k not in cls.model_fields})
        unknown = sorted(set(given) - set(cls.model_fields))
        if unknown:
            logger.warning("ignoring unsupported request fields: %s", ", ".join(unknown))
        try:
            request = cls.model_validate(given)
        except ValidationError as exc:
            raise from_pydantic(exc, cls.rules) from None
        request._decoding = decoding
        if request.stream_options is not None and not request.stream:     # vLLM refuses it too
            raise RequestValidationError("stream_options", "Invalid parameter `stream_options`: only allowed "
                                         "with stream=true")
        return request

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_dict(self, defaults: dict | None, greedy_when_unset: bool) -> dict[str, Any]:
        """Request value, then `defaults` (e.g. generation_config.json), then the route's rule."""
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            out[name] = value if value is not None else (defaults or {}).get(name)
        if out["temperature"] is None:
            # vLLM: temperature absent = 1.0 (sampling), beam search greedy; DESIGN §4 batch files: absent = greedy
            out["do_sample"] = not (greedy_when_unset or self.use_beam_search)
        for name in ("presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "length_penalty",
                     "early_stopping", "priority"):
            out[name] = getattr(self, name)
        out.update(self._decoding)
        # n (and best_of) are the OpenAI dialect's rule (sequences.openai_n), not GenerationParameters'
        out.update(stop_sequences=self.stop, ignore_eos=self.ignore_eos, truncate=self.truncate_prompt_tokens,
                   include_stop_str_in_output=self.include_stop_str_in_output,
                   skip_special_tokens=self.skip_special_tokens)
        return out


def _parse_generation(values: dict[str, Any]) -> GenerationParameters:
    """GenerationParameters.parse, with errors renamed to the OpenAI field the client sent."""
    try:
        return GenerationParameters.parse({k: v for k, v in values.items() if v is not None})
    except RequestValidationError as err:
        name = _PARAM_NAMES.get(err.field, err.field)
        raise RequestValidationError(name, err.message.replace(f"`{err.field}`", f"`{name}`"),
                                     err.status_code) from None


class ChatCompletionRequest(_SamplingRequest):
    """OpenAI /v1/chat/completions request (LMI chat completions schema; vLLM extras)."""

    messages: list[dict[str, Any]] = Field(description="OpenAI: the conversation, oldest first, non-empty")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI: wins over max_tokens")
    logprobs: bool = Field(False, description="OpenAI: return each token's log prob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS, description="OpenAI: alternatives, [0, 20]")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM: extra variables for the chat "
                                                        "template, e.g. {\"enable_thinking\": false}")
    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the assistant's turn opened")
    continue_final_message: bool = Field(False, description="vLLM: the answer continues the last (assistant) "
                                         "message; needs add_generation_prompt false")
    _tools: ToolRequest | None = PrivateAttr(None)

    @classmethod
    def parse(cls, data: Any) -> "ChatCompletionRequest":
        """Validate a chat body: the sampling fields (_SamplingRequest.parse), the tools (tools.py), the
        template controls. Raises RequestValidationError naming the field."""
        if not isinstance(data, dict):
            raise RequestValidationError.out_of_range("body", data, "a JSON object")
        request = super().parse({key: value for key, value in data.items() if key not in TOOL_FIELDS})
        request._tools = parse_tool_request({key: data[key] for key in TOOL_FIELDS if data.get(key) is not None})
        check_parts(request.messages)           # each content part's shape, named messages[i].content[j]
        if request.continue_final_message and request.add_generation_prompt:
            raise RequestValidationError("continue_final_message", "Invalid parameter `continue_final_message`: "
                                         "needs add_generation_prompt=false (both open a new assistant turn)")
        if request.continue_final_message and request.messages[-1].get("role") != "assistant":
            raise RequestValidationError("continue_final_message", "Invalid parameter `continue_final_message`: "
                                         "the last message must be the assistant's to continue")
        reserved = sorted(set(request.chat_template_kwargs or ()) & set(TEMPLATE_PARAMETERS))
        if reserved:
            raise RequestValidationError("chat_template_kwargs", f"Invalid parameter `chat_template_kwargs`: "
                                         f"{reserved[0]!r} is a parameter of the template call, not a template "
                                         "variable (send it as its own field)")
        return request

    @property
    def tools(self) -> ToolRequest | None:
        """The request's tools and tool_choice (legacy functions mapped to them); None without tools."""
        return self._tools

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("empty messages")
        for message in messages:
            content = message.get("content")
            if message.get("role") not in ROLES or not isinstance(content, (str, list, type(None))):
                raise ValueError("bad message")
            if content is None and message.get("role") != "assistant":  # OpenAI: only assistant may omit it
                raise ValueError("missing content")
        return messages

    def text_messages(self, multimodal: bool = False) -> list[dict[str, Any]]:
        """Messages as chat templates expect them (content.template_message): text parts joined into one string
        (`multimodal`: a list of text and {"type": "image"} parts), a legacy `function` message as a `tool`
        message, the arguments of an assistant's tool calls as objects (JSON text that parses; transformers'
        templates index them, vLLM does the same)."""
        return [template_message(m, multimodal) for m in self.messages]

    def image_parts(self) -> list[ImagePart]:
        """The images of the messages, in order (content.image_parts)."""
        return image_parts(self.messages)

    def to_generation_parameters(self, *, default_max_new_tokens: int | None = None,
                                 defaults: dict | None = None,
                                 greedy_when_unset: bool = False) -> GenerationParameters:
        """OpenAI -> LMI parameters.

        Length: max_completion_tokens, then max_tokens, then `default_max_new_tokens` (the
        server passes what is left of the context, as vLLM does), then LMI's 30.
        Sampling: see _SamplingRequest._sampling_dict (live route: vLLM's temperature 1.0;
        batch files: greedy_when_unset=True). Raises RequestValidationError.
        """
        if self.top_logprobs and not self.logprobs:
            raise RequestValidationError("top_logprobs", "Invalid parameter `top_logprobs`: needs logprobs=true")
        values = self._sampling_dict(defaults, greedy_when_unset)
        values["max_new_tokens"] = self.max_completion_tokens or self.max_tokens or default_max_new_tokens
        values["top_n_tokens"] = (self.top_logprobs or 0) if self.logprobs else None
        values["num_beams"] = self.n if self.use_beam_search else 1
        params = _parse_generation(values)
        if self._tools is not None and self._tools.constrained:     # required / named: the tools' schemas
            params = params.with_constraint("tool_choice", self._tools.constraint())
        return params


# A completions prompt: text, or token ids (lm-evaluation-harness and vLLM's clients send ids)
PromptInput = str | list[int]


class CompletionRequest(_SamplingRequest):
    """OpenAI /v1/completions request (legacy text completions; vLLM extras).

    `prompt` takes OpenAI's four forms: a string, a list of strings, a list of token ids, a list of lists of
    token ids; each prompt of a list gets its own n choices (index = prompt index * n + choice, OpenAI's and
    vLLM's order). Ids are checked against the vocabulary where the model is known (service.py).
    """

    rules: ClassVar[dict[str, str]] = {**OPENAI_RULES, "max_tokens": "an integer >= 0 (0 only with echo=true: "
                                       "the prompt alone, as OpenAI's legacy API and vLLM answer it)"}

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="OpenAI: text or token ids, one prompt or a list (each its own n choices)")
    max_tokens: int | None = Field(16, ge=0, description="OpenAI: generated tokens at most (default 16); 0 with "
                                   "echo answers the prompt alone")
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens, as on chat and in "
                                              "batch lines (DESIGN §4), so a batch body and the route agree")
    echo: bool = Field(False, description="OpenAI: prepend the prompt to the text (and, with logprobs, its "
                       "tokens' log probs to logprobs)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="OpenAI: alternatives per token, [0, 5]")
    best_of: int | None = Field(None, ge=1, description="OpenAI: candidates generated server-side, >= n")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        """Each of OpenAI's forms, non-empty all the way down, ids ints >= 0 (JSON true is no token id)."""
        def is_ids(value: Any) -> bool:
            return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)

        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and (
                is_ids(prompt) or all(isinstance(p, str) and p for p in prompt) or all(is_ids(p) for p in prompt)):
            return prompt
        raise ValueError("bad prompt")

    @property
    def prompts(self) -> list[PromptInput]:
        """The prompts in order: each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its log probs) alone, finish_reason "length" (OpenAI legacy,
        vLLM). The engine still runs one token, as vLLM does; the answer leaves it out."""
        return self.echo and self.max_tokens == 0 and self.max_completion_tokens is None

    def to_generation_parameters(self, *, defaults: dict | None = None,
                                 greedy_when_unset: bool = False) -> GenerationParameters:
        """OpenAI -> LMI parameters (max_completion_tokens, then max_tokens, default 16; echo -> return_full_text).
        Raises RequestValidationError (max_tokens 0 without echo)."""
        if self.max_tokens == 0 and self.max_completion_tokens is None and not self.echo:
            raise RequestValidationError.out_of_range("max_tokens", 0, self.rules["max_tokens"])
        values = self._sampling_dict(defaults, greedy_when_unset)
        values.update(max_new_tokens=1 if self.echo_only else self.max_completion_tokens or self.max_tokens,
                      return_full_text=self.echo, top_n_tokens=self.logprobs,
                      num_beams=max(self.n, self.best_of or 1) if self.use_beam_search else 1)
        return _parse_generation(values)


# ---- responses ----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI usage: the prompt counted once, completion tokens summed over all choices."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top_entries(token: TokenOutput, decode_token: Callable[[int], str] | None) -> list[tuple[str, float]]:
    return [(decode_token(tid) if decode_token else "", lp) for tid, lp in token.top_tokens or ()]


def chat_logprobs(tokens: list[TokenOutput], decode_token: Callable[[int], str] | None = None) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]},
    bytes the token text's UTF-8; top_logprobs best first, top_logprobs long ([] when 0 or absent)."""
    def entry(text: str, log_prob: float) -> dict:
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.text, t.log_prob),
                         "top_logprobs": [entry(text, lp) for text, lp in _top_entries(t, decode_token)]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenOutput], decode_token: Callable[[int], str] | None = None,
                        text_offset: int = 0, prompt_tokens: list[TokenOutput] | None = None) -> dict:
    """OpenAI completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.

    top_logprobs[i] maps token text -> log prob for the `logprobs` best tokens plus the sampled one, so up
    to logprobs+1 entries (OpenAI's rule; vLLM's too). text_offset[i] is the character offset of token i
    in the choice's text (echo: the prompt comes first, so offsets start at its length).
    `prompt_tokens` (echo with logprobs): the prompt's tokens come first, offsets from 0, the first one's
    log prob and top_logprobs null (nothing comes before it), as OpenAI's legacy API and vLLM answer.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def put(token: TokenOutput, offset: int, first: bool) -> None:
        top = None if first else dict(_top_entries(token, decode_token))
        if top is not None and all(tid != token.id for tid, _ in token.top_tokens or ()):
            top[token.text] = token.log_prob
        out["tokens"].append(token.text)
        out["token_logprobs"].append(None if first else token.log_prob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)

    prompt_offset = 0
    for i, token in enumerate(prompt_tokens or ()):
        put(token, prompt_offset, i == 0)
        prompt_offset += len(token.text)
    for token in tokens:
        put(token, text_offset, False)
        text_offset += len(token.text)
    return out


# OpenAI's optional backend tag; TGI's clients (text_generation's ChatComplete/ChatCompletionChunk) require it.
SYSTEM_FINGERPRINT = "lmi_handler"


def chat_choice(index: int, content: str, finish_reason: FinishReason | None, logprobs: dict | None = None) -> dict:
    """One choice of a chat.completion."""
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": to_openai_finish_reason(finish_reason)}


def completion_choice(index: int, text: str, finish_reason: FinishReason | None, logprobs: dict | None = None) -> dict:
    """One choice of a text_completion (streamed chunks carry the same object)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": to_openai_finish_reason(finish_reason)}


def chat_completion_response(*, request_id: str, created: int, model: str, choices: list[dict],
                             prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI chat.completion object; `choices` from chat_choice, index 0..n-1."""
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(*, request_id: str, created: int, model: str, choices: list[dict],
                        prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI text_completion object; `choices` from completion_choice, index 0..n-1."""
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_completion_chunk(*, request_id: str, created: int, model: str, delta: dict, index: int = 0,
                          finish_reason: FinishReason | None = None, logprobs: dict | None = None) -> dict:
    """OpenAI chat.completion.chunk with one choice (choice `index` of n); `delta` is {role?, content?}."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": to_openai_finish_reason(finish_reason)}
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}


def completion_chunk(*, request_id: str, created: int, model: str, text: str, index: int = 0,
                     finish_reason: FinishReason | None = None, logprobs: dict | None = None) -> dict:
    """One streamed text_completion chunk for choice `index` (OpenAI streams the same object type)."""
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def usage_chunk(*, request_id: str, created: int, model: str, chat: bool, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """stream_options.include_usage: the last chunk before [DONE], with empty choices and the usage of
    every choice (OpenAI); sent only when asked."""
    prefix, kind = ("chatcmpl", "chat.completion.chunk") if chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created, "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
