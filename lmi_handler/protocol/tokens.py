"""The token routes' bodies and answers: vLLM's /tokenize and /detokenize, TGI's /tokenize.

Owns their request and answer shapes (one POST /tokenize takes both servers' bodies: TGI's has `inputs`);
tokenizing is service.py's, the routes server/tokens.py's (TGI's body answered by server/tgi.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmi_handler.protocol.errors import RequestValidationError, from_pydantic
from lmi_handler.protocol.invocations import load_json
from lmi_handler.protocol.openai import ChatCompletionRequest

TOKEN_RULES = {
    "prompt": "a string",
    "messages": "a non-empty list of {role, content} objects (as on /v1/chat/completions)",
    "add_special_tokens": "true or false",
    "return_token_strs": "true or false",
    "inputs": "a string",
    "tokens": "a list of token ids (integers >= 0)",
    "model": "a string",
}


class _VllmTokenize(BaseModel):
    """vLLM's TokenizeCompletionRequest / TokenizeChatRequest (one of prompt, messages)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = Field(None, description="vLLM: prompt true, messages false by default "
                                            "(the chat template writes its own special tokens)")
    return_token_strs: bool = Field(False, description="vLLM: also answer each token's vocabulary string")


class _TgiTokenize(BaseModel):
    """TGI's /tokenize takes its GenerateRequest; only `inputs` matters (parameters are not read)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    inputs: str


class _Detokenize(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(description="vLLM: the ids to decode")


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's /tokenize body: `text` to tokenize, or `messages` (rendered by the service's chat template)."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


def _validate(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:
        raise from_pydantic(exc, TOKEN_RULES) from None


def is_tgi_tokenize(body: bytes) -> bool:
    """Whether a POST /tokenize body is TGI's (it holds `inputs`); vLLM's otherwise, and when it is no JSON
    object at all (vLLM's errors then answer it)."""
    try:
        return "inputs" in load_json(body)
    except RequestValidationError:
        return False


def parse_tgi_tokenize(body: bytes) -> str:
    """TGI's /tokenize body (its GenerateRequest): the `inputs` text. Raises RequestValidationError."""
    return _validate(_TgiTokenize, load_json(body)).inputs


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """vLLM's /tokenize body: {"prompt"} or {"messages"}, with add_special_tokens (default true for a prompt,
    false for messages, as vLLM) and return_token_strs. Raises RequestValidationError naming the field."""
    request = _validate(_VllmTokenize, load_json(body))
    if (request.prompt is None) == (request.messages is None):
        raise RequestValidationError("prompt", "Invalid parameter `prompt`: send one of `prompt` (a string) or "
                                     "`messages` (vLLM), or TGI's `inputs`")
    messages = None
    if request.messages is not None:     # the chat route's own rules for messages
        messages = ChatCompletionRequest.parse({"messages": request.messages}).text_messages()
    add_special = request.add_special_tokens
    return TokenizeRequest(request.prompt, messages, add_special if add_special is not None else messages is None,
                           request.return_token_strs)


def parse_detokenize(body: bytes) -> list[int]:
    """vLLM's /detokenize body {"tokens": [ids]}: the ids (range checked by the service). Raises
    RequestValidationError naming `tokens`."""
    tokens = _validate(_Detokenize, load_json(body)).tokens
    if any(t < 0 for t in tokens):
        raise RequestValidationError.out_of_range("tokens", tokens, TOKEN_RULES["tokens"])
    return tokens


def tokenize_answer(token_ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict:
    """vLLM's TokenizeResponse: {count, max_model_len, tokens, token_strs} (token_strs null unless asked)."""
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}


def tgi_tokens(text: str, token_ids: list[int], offsets: list[tuple[int, int]]) -> list[dict]:
    """TGI's /tokenize answer: one SimpleToken {id, text, start, stop} per token; start and stop are character
    offsets into `text` and `text` is that slice (a special token the tokenizer adds spans nothing: "")."""
    return [{"id": tid, "text": text[start:stop], "start": start, "stop": stop}
            for tid, (start, stop) in zip(token_ids, offsets)]
