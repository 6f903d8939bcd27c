"""OpenAI's shapes: chat.completion and text_completion, whole and streamed per choice, the merged body of
several prompts, and a failed stream's error chunk.

Owns those objects (one formatter per choice); the objects' fields are protocol/openai.py's builders, the
request's tail (usage chunk, DONE) answers.py's StreamAnswer's.
"""
from __future__ import annotations

from typing import Any, Sequence

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol import openai
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, error_body
from lmi_handler.protocol.formatters.base import Formatter, error_message
from lmi_handler.protocol.plan import Prompt, RequestPlan, Shape
from lmi_handler.protocol.sequences import Combine, best_choices

OPENAI_SHAPES = (Shape.CHAT, Shape.COMPLETION)      # the shapes whose answers merge choices (n, best_of, beams)


class OpenAIFormatter(Formatter):
    """Shared by the OpenAI shapes: one per choice (engine sequence); ids, usage and logprobs from its tokens."""

    index = 0          # the choice index this sequence answers as (OpenAI n)

    def ids(self) -> dict[str, Any]:
        return {"request_id": self.plan.request_id, "created": self.plan.created, "model": self.plan.model_name}

    @property
    def num_completion_tokens(self) -> int:
        if self.plan.echo_only:        # the one token run is not answered
            return 0
        return (self.last.num_generated_tokens if self.last is not None else 0) or len(self.tokens)

    def error_document(self, out: RequestOutput) -> dict:
        return error_body(Dialect.OPENAI, error_message(out), GENERATION_ERROR_CODE)

    def _logprobs(self, tokens: list[TokenOutput], text_offset: int = 0,
                  prompt_tokens: list[TokenOutput] | None = None) -> dict | None:
        if not self.plan.logprobs:
            return None
        if self.plan.shape is Shape.CHAT:
            return openai.chat_logprobs(tokens, self.plan.decode_token)
        return openai.completion_logprobs(tokens, self.plan.decode_token, text_offset, prompt_tokens)

    def document(self) -> dict:
        return openai_body(self.plan, [self])

    def beam_choices(self, count: int) -> list[dict]:
        """A beam search's `count` best beams as choices 0..count-1, best first (vLLM use_beam_search)."""
        return [self._choice(i, beam.text, beam.finish_reason, beam.tokens)
                for i, beam in enumerate(self.last.beams[:count])]

    def choice(self, index: int) -> dict:
        return self._choice(index, self.last.generated_text, self.last.finish_reason, self.tokens)

    def _choice(self, index: int, text: str, reason: FinishReason | None, tokens: list[TokenOutput]) -> dict:
        raise NotImplementedError

    def prompt_logprobs(self) -> list[dict | None]:
        """vLLM prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
        decoded_token}} for the token itself and its k best alternatives (rank: 1-based place among the
        alternatives; the token itself: 1 + the number of vocabulary entries with a strictly higher log prob,
        as vLLM computes it, whether or not it is among them)."""
        entries: list[dict | None] = []
        for i, token in enumerate(self.prompt_tokens or []):
            if i == 0:
                entries.append(None)
                continue
            top = token.top_tokens or []
            ranks = {tid: r + 1 for r, (tid, _) in enumerate(top)}
            rank = token.rank if token.rank is not None else ranks.get(token.id)
            entry = {str(token.id): {"logprob": token.log_prob, "rank": rank,
                                     "decoded_token": token.text}}
            for tid, lp in top:
                text = self.plan.decode_token(tid) if self.plan.decode_token else ""
                entry.setdefault(str(tid), {"logprob": lp, "rank": ranks[tid], "decoded_token": text})
            entries.append(entry)
        return entries


class ChatDocument(OpenAIFormatter):
    """OpenAI chat.completion; an OpenAI error object on error. With the plan's chat_output rule the text is
    parsed into reasoning_content, tool_calls and content (chat_output.py)."""

    def _choice(self, index: int, text: str, reason: FinishReason | None, tokens: list[TokenOutput]) -> dict:
        choice = openai.chat_choice(index, text, reason, self._logprobs(tokens))
        if self.plan.chat_output is not None:
            parser = self.plan.chat_output.parser()
            parser.parse(text)
            choice.update(message=parser.message(), finish_reason=parser.finish_reason(reason))
        return choice


class CompletionDocument(OpenAIFormatter):
    """OpenAI text_completion; echo = return_full_text: the prompt's text first, and with logprobs its tokens'
    log probs first (logprob text offsets of the generated tokens then start after the prompt); echo with
    max_tokens 0 (plan.echo_only) answers the prompt alone, finish_reason "length" (vLLM)."""

    def _choice(self, index: int, text: str, reason: FinishReason | None, tokens: list[TokenOutput]) -> dict:
        echo = self.plan.return_full_text
        if self.plan.echo_only:
            text, reason, tokens = "", FinishReason.LENGTH, []
        offset = len(self.prompt.text) if echo else 0
        logprobs = self._logprobs(tokens, offset, self.prompt_tokens if echo else None)
        choice = openai.completion_choice(index, (self.prompt.text if echo else "") + text, reason, logprobs)
        if self.plan.prompt_logprobs:        # vLLM: completions carry them per choice
            choice["prompt_logprobs"] = self.prompt_logprobs()
        return choice


def openai_body(plan: RequestPlan, formatters: Sequence[OpenAIFormatter]) -> dict:
    """One prompt's OpenAI answer from its finished sequences: choices 0..n-1 (best_of > n: the n with the
    highest summed log prob, sequences.best_choices), usage with the prompt once and the completion tokens
    of every returned choice (vLLM). A sequence that failed answers for the request with an error object."""
    failed = [f for f in formatters if f.failed]
    if failed:
        return failed[0].error_document(failed[0].last)
    build = openai.chat_completion_response if plan.shape is Shape.CHAT else openai.completion_response
    first = formatters[0]
    if plan.sequences.combine is Combine.BEAMS:         # one search, its n best beams
        beams = first.last.beams[:plan.sequences.num_choices]
        body = build(**first.ids(), choices=first.beam_choices(len(beams)), prompt_tokens=first.last.num_prompt_tokens,
                     completion_tokens=sum(len(beam.tokens) for beam in beams))
    else:
        chosen = best_choices([f.score for f in formatters], plan.sequences.num_choices)
        body = build(**first.ids(), choices=[formatters[j].choice(i) for i, j in enumerate(chosen)],
                     prompt_tokens=first.last.num_prompt_tokens,
                     completion_tokens=sum(formatters[j].num_completion_tokens for j in chosen))
    if plan.prompt_logprobs and plan.shape is Shape.CHAT:    # vLLM: chat carries them beside the choices
        body["prompt_logprobs"] = first.prompt_logprobs()
    return body


class OpenAIStream(OpenAIFormatter):
    """One choice's chunks per step: the step's text (if any) and, on its last, its finish_reason.

    The request's tail (usage chunk, DONE) and errors are StreamAnswer's, which merges the choices.
    """

    def __init__(self, plan: RequestPlan, prompt: Prompt, seed: int | None = None, details: bool | None = None):
        super().__init__(plan, prompt, seed, details)
        self.text_offset = len(prompt.text) if plan.return_full_text else 0

    def events(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        tokens = [] if self.plan.echo_only else out.new_tokens
        text = "".join(t.text for t in tokens)
        if not text and not out.finished and not (self.plan.logprobs and tokens):
            return []
        logprobs = self._logprobs(tokens, self.text_offset, self._unsent_prompt_tokens())
        self.text_offset += len(text)
        reason = (FinishReason.LENGTH if self.plan.echo_only else out.finish_reason) if out.finished else None
        chunk = self._chunk(text, reason, logprobs)
        if chunk is None:                # a parser holds the text back for now
            return []
        if self.plan.include_usage:
            chunk["usage"] = None        # OpenAI: with include_usage, every other chunk has usage null
        return [chunk]

    def _unsent_prompt_tokens(self) -> list[TokenOutput] | None:
        """Prompt tokens whose log probs go first in this chunk's logprobs (completions' echo), else None."""
        return None

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict | None:
        raise NotImplementedError


class ChatStream(OpenAIStream):
    """OpenAI chat.completion.chunk stream of one choice. Every delta carries role "assistant" and
    tool_calls null, as TGI sends them (OpenAI allows both; the TGI client's ChoiceDelta requires them).

    With the plan's chat_output rule the text goes through its parser: a delta carries the step's content
    (null when it has none), `reasoning_content` when it has reasoning, and OpenAI's tool-call deltas; a
    step whose text the parser holds back sends nothing (unless it has log probs or ends the choice).
    """

    def __init__(self, plan: RequestPlan, prompt: Prompt, seed: int | None = None, details: bool | None = None):
        super().__init__(plan, prompt, seed, details)
        self.parser = plan.chat_output.parser() if plan.chat_output is not None else None

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict | None:
        delta: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": None}
        finish_reason = openai.to_openai_finish_reason(reason)
        if self.parser is not None:
            parts = self.parser.feed(text, final=reason is not None)
            finish_reason = self.parser.finish_reason(reason)
            if not parts and reason is None and logprobs is None:
                return None
            delta = {"role": "assistant", "content": parts.content or None, "tool_calls": parts.tool_calls or None}
            if parts.reasoning:
                delta["reasoning_content"] = parts.reasoning
        chunk = openai.chat_completion_chunk(**self.ids(), index=self.index, delta=delta, logprobs=logprobs)
        chunk["choices"][0]["finish_reason"] = finish_reason
        return chunk


class CompletionStream(OpenAIStream):
    """OpenAI text_completion stream of one choice; echo sends the prompt (and, with logprobs, its tokens'
    log probs) in its first chunk, as vLLM does."""

    echo_sent = False

    def _unsent_prompt_tokens(self) -> list[TokenOutput] | None:
        return self.prompt_tokens if self.plan.return_full_text and not self.echo_sent else None

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
        if self.plan.return_full_text and not self.echo_sent:
            text, self.echo_sent = self.prompt.text + text, True
        return openai.completion_chunk(**self.ids(), index=self.index, text=text, finish_reason=reason,
                                       logprobs=logprobs)


def merge_openai_bodies(documents: Sequence[dict]) -> dict:
    """Several prompts' OpenAI bodies as one (completions with a list of prompts): the choices in prompt
    order, indexed on across prompts (prompt p's choice i is p * n + i, OpenAI's and vLLM's order), usage
    summed; the first error object answers for the request."""
    failed = next((doc for doc in documents if "choices" not in doc), None)
    if failed is not None:
        return failed
    choices: list[dict] = []
    for doc in documents:
        base = len(choices)
        choices += [{**choice, "index": base + choice["index"]} for choice in doc["choices"]]
    counts = [sum(doc["usage"][key] for doc in documents) for key in ("prompt_tokens", "completion_tokens")]
    return {**documents[0], "choices": choices, "usage": openai.usage(*counts)}


def stream_failure(message: str, code: int, plan: RequestPlan) -> list[Any]:
    """OpenAI's error chunk and the terminator end a stream whose request failed after HTTP 200 went out, as
    vLLM sends them."""
    return [error_body(plan.dialect, message, code), *plan.stream_end]


def stream_tail(plan: RequestPlan, streams: list[OpenAIStream]) -> list[Any]:
    """The end of an OpenAI stream once every choice finished: the usage chunk (stream_options.include_usage:
    empty choices, prompt once, completion tokens of all choices) and DONE. `streams`: every choice's, in order."""
    done = list(plan.stream_end)
    if not plan.include_usage:
        return done
    firsts = streams[::plan.sequences.count]       # one per prompt: each prompt counted once
    return [openai.usage_chunk(**streams[0].ids(), chat=plan.shape is Shape.CHAT,
                               prompt_tokens=sum(f.last.num_prompt_tokens for f in firsts),
                               completion_tokens=sum(f.num_completion_tokens for f in streams)), *done]
