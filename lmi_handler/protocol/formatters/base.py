"""The formatter every dialect's shapes derive from: one engine sequence's tokens, prompt tokens and last
output, and the LMI-schema details built from them.

Owns what all shapes share; each dialect's shapes are its module beside this one (lmi.py, tgi.py, openai.py),
and answers.py picks one per request from its plan.
"""
from __future__ import annotations

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.invocations import build_details
from lmi_handler.protocol.plan import Prompt, RequestPlan

# LMI schema: the token line sent when generation ends with no token to carry the final fields.
SENTINEL_TOKEN = TokenOutput(id=-1, text="", log_prob=-1.0, special_token=True)


def is_error(out: RequestOutput) -> bool:
    return out.error is not None or out.finish_reason == FinishReason.ERROR


def error_message(out: RequestOutput) -> str:
    return out.error or "generation failed"


class Formatter:
    """One per engine sequence: keeps the tokens seen so far (details, usage) and the prompt tokens
    (decoder_input_details). `details` overrides the plan's (best_of members always keep theirs)."""

    def __init__(self, plan: RequestPlan, prompt: Prompt, seed: int | None = None, details: bool | None = None):
        self.plan = plan
        self.prompt = prompt
        self.seed = seed
        self.details = plan.details if details is None else details
        self.tokens: list[TokenOutput] = []
        self.prompt_tokens: list[TokenOutput] | None = None
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.tokens.extend(out.new_tokens)
        if out.prompt_tokens is not None:
            self.prompt_tokens = out.prompt_tokens
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def failed(self) -> bool:
        return self.last is not None and is_error(self.last)

    @property
    def tgi_seed(self) -> int | None:
        """TGI details.seed: the seed a sampled sequence used, null for greedy ones (TGI)."""
        return None if self.prompt.params.greedy else self.seed

    @property
    def score(self) -> float:
        """Summed log prob of the tokens (TGI best_of ranks sequences by it)."""
        return sum(t.log_prob for t in self.tokens)

    def generated_text(self, out: RequestOutput) -> str:
        return (self.prompt.text if self.plan.return_full_text else "") + out.generated_text

    def lmi_details(self, out: RequestOutput, include_tokens: bool) -> dict:
        reason = FinishReason.ERROR if is_error(out) else out.finish_reason
        prompt_tokens = self.prompt_tokens if self.plan.decoder_input_details else None
        return build_details(finish_reason=reason, tokens=self.tokens, inputs=self.prompt.text,
                             prompt_tokens=prompt_tokens, include_tokens=include_tokens,
                             tgi_compat=self.plan.tgi_names, decode_token=self.plan.decode_token)
