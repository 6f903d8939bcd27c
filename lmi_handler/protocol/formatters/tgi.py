"""TGI's shapes: /generate's document and /generate_stream's StreamResponses, and TGI's error event when a
stream fails (TGI's routes; tgi_compat on /invocations keeps LMI's shapes, lmi.py).

Owns those objects; framing them as bytes is encoder.py's.
"""
from __future__ import annotations

from typing import Any

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, error_body
from lmi_handler.protocol.formatters.base import SENTINEL_TOKEN, Formatter, error_message, is_error
from lmi_handler.protocol.invocations import build_details, token_to_dict, top_tokens_to_dicts
from lmi_handler.protocol.plan import RequestPlan


def error_document(out: RequestOutput) -> dict:
    """TGI's error object {"error", "error_type"} for a failed sequence (TGI clients parse error bodies as an
    object); also LMI's document under tgi_compat."""
    return error_body(Dialect.TGI, error_message(out), GENERATION_ERROR_CODE)


class TgiDocument(Formatter):
    """TGI /generate: {"generated_text", "details"?: {finish_reason, generated_tokens, seed, prefill, tokens}},
    Token {id, text, logprob, special}; seed is null for greedy requests (TGI). Errors: TGI's error object."""

    def document(self) -> dict:
        out = self.last
        if self.failed:
            return error_document(out)
        doc: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.details:
            prompt_tokens = self.prompt_tokens if self.plan.decoder_input_details else None
            lmi = build_details(finish_reason=out.finish_reason, tokens=self.tokens, inputs="",
                                prompt_tokens=prompt_tokens, tgi_compat=True, decode_token=self.plan.decode_token)
            doc["details"] = {"finish_reason": lmi["finish_reason"], "generated_tokens": lmi["generated_tokens"],
                              "seed": self.tgi_seed, "prefill": lmi["prefill"], "tokens": lmi["tokens"]}
            if "top_tokens" in lmi:
                doc["details"]["top_tokens"] = lmi["top_tokens"]
        return doc


class TgiStream(Formatter):
    """TGI /generate_stream: one StreamResponse per token, every key present as TGI sends them
    ({index, token, top_tokens, generated_text: null, details: null}; the TGI client's types require
    them); the last carries generated_text and, when asked, details {finish_reason, generated_tokens,
    seed, input_length}. A token-less end rides on LMI's sentinel token. Errors: TGI's error event."""

    def events(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        if is_error(out):
            return [error_document(out)]
        tokens = list(out.new_tokens) or ([SENTINEL_TOKEN] if out.finished else [])
        first_index = len(self.tokens) - len(out.new_tokens)
        events = [self._event(t, first_index + i + 1) for i, t in enumerate(tokens)]
        if out.finished:
            events[-1]["generated_text"] = self.generated_text(out)
            if self.details:
                events[-1]["details"] = {"finish_reason": FinishReason(out.finish_reason).value,
                                         "generated_tokens": len(self.tokens), "seed": self.tgi_seed,
                                         "input_length": len(self.prompt.token_ids)}
        return events

    def _event(self, token: TokenOutput, index: int) -> dict:
        top = top_tokens_to_dicts(token, self.plan.decode_token, tgi_compat=True) if token.top_tokens else []
        return {"index": index, "token": token_to_dict(token, self.plan.decode_token, tgi_compat=True),
                "top_tokens": top, "generated_text": None, "details": None}


def stream_failure(message: str, code: int, plan: RequestPlan) -> list[Any]:
    """TGI's error event ends a stream whose request failed after HTTP 200 went out (no terminator: TGI sends
    none)."""
    return [error_body(plan.dialect, message, code)]
