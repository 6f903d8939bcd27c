"""The LMI schema's shapes (DESIGN §3): the whole {"generated_text", "details"?} document (also tgi_compat's),
its token-by-token stream (jsonlines / sse), dynamic batch's streamed lines and a failed stream's last line.

Owns those objects; framing them as bytes is encoder.py's.
"""
from __future__ import annotations

from typing import Any

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.errors import error_body
from lmi_handler.protocol.formatters.base import SENTINEL_TOKEN, Formatter, error_message, is_error
from lmi_handler.protocol.formatters.tgi import error_document as tgi_error_document
from lmi_handler.protocol.invocations import token_to_dict, top_tokens_to_dicts
from lmi_handler.protocol.plan import RequestPlan


class LmiDocument(Formatter):
    """LMI json {"generated_text", "details"?}.

    On error: LMI's shape with details.finish_reason "error" plus "error": message; under tgi_compat
    TGI's error object {"error", "error_type"} (TGI clients parse error bodies as an object).
    """

    def document(self) -> dict:
        out = self.last
        if self.failed and self.plan.tgi_names:
            return tgi_error_document(out)
        doc: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.details or self.failed:
            doc["details"] = self.lmi_details(out, include_tokens=True)
        if self.failed:
            doc["error"] = error_message(out)
        return doc


class TokenStream(Formatter):
    """LMI jsonlines / sse: one {"token": Token} object per generated token, as they arrive.

    Only the last carries "generated_text" and "details" (if asked; always on error, with
    finish_reason "error" and an "error" message). When the final output brings no new token
    (e.g. a stop string made of held-back tokens, or an error), the final fields ride on LMI's
    sentinel token {"id": -1, "text": ""}; details.generated_tokens counts real tokens only.
    """

    def events(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        tokens = list(out.new_tokens)
        if out.finished and not tokens:
            tokens = [SENTINEL_TOKEN]
        first_index = len(self.tokens) - len(out.new_tokens)
        lines = [self._line(t, first_index + i + 1) for i, t in enumerate(tokens)]
        if out.finished:
            lines[-1].update(self._final_fields(out))
        return lines

    def _line(self, token: TokenOutput, index: int) -> dict:
        tgi = self.plan.tgi_names
        line: dict[str, Any] = {"token": token_to_dict(token, self.plan.decode_token, tgi)}
        if tgi:  # TGI StreamResponse: 1-based index, top tokens beside the token
            line["index"] = index
            if token.top_tokens:
                line["top_tokens"] = top_tokens_to_dicts(token, self.plan.decode_token, tgi_compat=True)
        return line

    def _final_fields(self, out: RequestOutput) -> dict:
        fields: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.details or is_error(out):
            fields["details"] = self.lmi_details(out, include_tokens=False)
        if is_error(out):
            fields["error"] = error_message(out)
        return fields


def outputs_line(texts: list[str]) -> dict:
    """LMI dynamic batch streaming: one {"outputs": [new text per input]} object per step."""
    return {"outputs": texts}


def stream_failure(message: str, code: int, plan: RequestPlan) -> list[Any]:
    """LMI's last line of a stream whose request failed after HTTP 200 went out (DESIGN §3: a final line with
    finish_reason "error"), on the sentinel token."""
    return [{"token": token_to_dict(SENTINEL_TOKEN), "details": {"finish_reason": FinishReason.ERROR.value},
             **error_body(plan.dialect, message, code)}]
