"""Formatters: engine RequestOutputs + the request's plan -> response objects (dicts), never bytes.

Owns the shapes of DESIGN §3 (LMI schema, tgi_compat), TGI /generate and OpenAI responses; which
formatter a request gets is read off its plan (plan.py decides), bytes are the encoder's.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol import openai
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, error_body
from lmi_handler.protocol.invocations import build_details, token_to_dict, top_tokens_to_dicts
from lmi_handler.protocol.plan import Kind, Prompt, RequestPlan, Shape
from lmi_handler.protocol.sequences import Combine, Member, best_choices, combine_best_of

# LMI schema: the token line sent when generation ends with no token to carry the final fields.
SENTINEL_TOKEN = TokenOutput(id=-1, text="", log_prob=-1.0, special_token=True)


def _is_error(out: RequestOutput) -> bool:
    return out.error is not None or out.finish_reason == FinishReason.ERROR


def _error_message(out: RequestOutput) -> str:
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
        return self.last is not None and _is_error(self.last)

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
        reason = FinishReason.ERROR if _is_error(out) else out.finish_reason
        prompt_tokens = self.prompt_tokens if self.plan.decoder_input_details else None
        return build_details(finish_reason=reason, tokens=self.tokens, inputs=self.prompt.text,
                             prompt_tokens=prompt_tokens, include_tokens=include_tokens,
                             tgi_compat=self.plan.tgi_names, decode_token=self.plan.decode_token)


# ---- whole answers (not streamed) -----------------------------------------------------------

class LmiDocument(Formatter):
    """LMI json {"generated_text", "details"?}.

    On error: LMI's shape with details.finish_reason "error" plus "error": message; under tgi_compat
    TGI's error object {"error", "error_type"} (TGI clients parse error bodies as an object).
    """

    def document(self) -> dict:
        out = self.last
        if self.failed and self.plan.tgi_names:
            return error_body(Dialect.TGI, _error_message(out), GENERATION_ERROR_CODE)
        doc: dict[str, Any] = {"generated_text": self.generated_text(out)}
        if self.details or self.failed:
            doc["details"] = self.lmi_details(out, include_tokens=True)
        if self.failed:
            doc["error"] = _error_message(out)
        return doc


class TgiDocument(Formatter):
    """TGI /generate: {"generated_text", "details"?: {finish_reason, generated_tokens, seed, prefill, tokens}},
    Token {id, text, logprob, special}; seed is null for greedy requests (TGI). Errors: TGI's error object."""

    def document(self) -> dict:
        out = self.last
        if self.failed:
            return error_body(Dialect.TGI, _error_message(out), GENERATION_ERROR_CODE)
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


class _OpenAIFormatter(Formatter):
    """Shared by the OpenAI shapes: one per choice (engine sequence); ids, usage and logprobs from its tokens."""

    index = 0          # the choice index this sequence answers as (OpenAI n)

    def _ids(self) -> dict[str, Any]:
        return {"request_id": self.plan.request_id, "created": self.plan.created, "model": self.plan.model_name}

    @property
    def num_completion_tokens(self) -> int:
        if self.plan.echo_only:        # the one token run is not answered
            return 0
        return (self.last.num_generated_tokens if self.last is not None else 0) or len(self.tokens)

    def _error(self, out: RequestOutput) -> dict:
        return error_body(Dialect.OPENAI, _error_message(out), GENERATION_ERROR_CODE)

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


class ChatDocument(_OpenAIFormatter):
    """OpenAI chat.completion; an OpenAI error object on error. With the plan's chat_output rule the text is
    parsed into reasoning_content, tool_calls and content (chat_output.py)."""

    def _choice(self, index: int, text: str, reason: FinishReason | None, tokens: list[TokenOutput]) -> dict:
        choice = openai.chat_choice(index, text, reason, self._logprobs(tokens))
        if self.plan.chat_output is not None:
            parser = self.plan.chat_output.parser()
            parser.parse(text)
            choice.update(message=parser.message(), finish_reason=parser.finish_reason(reason))
        return choice


class CompletionDocument(_OpenAIFormatter):
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


def openai_body(plan: RequestPlan, formatters: Sequence[_OpenAIFormatter]) -> dict:
    """One prompt's OpenAI answer from its finished sequences: choices 0..n-1 (best_of > n: the n with the
    highest summed log prob, sequences.best_choices), usage with the prompt once and the completion tokens
    of every returned choice (vLLM). A sequence that failed answers for the request with an error object."""
    failed = [f for f in formatters if f.failed]
    if failed:
        return failed[0]._error(failed[0].last)
    build = openai.chat_completion_response if plan.shape is Shape.CHAT else openai.completion_response
    first = formatters[0]
    if plan.sequences.combine is Combine.BEAMS:         # one search, its n best beams
        beams = first.last.beams[:plan.sequences.num_choices]
        body = build(**first._ids(), choices=first.beam_choices(len(beams)), prompt_tokens=first.last.num_prompt_tokens,
                     completion_tokens=sum(len(beam.tokens) for beam in beams))
    else:
        chosen = best_choices([f.score for f in formatters], plan.sequences.num_choices)
        body = build(**first._ids(), choices=[formatters[j].choice(i) for i, j in enumerate(chosen)],
                     prompt_tokens=first.last.num_prompt_tokens,
                     completion_tokens=sum(formatters[j].num_completion_tokens for j in chosen))
    if plan.prompt_logprobs and plan.shape is Shape.CHAT:    # vLLM: chat carries them beside the choices
        body["prompt_logprobs"] = first.prompt_logprobs()
    return body


# ---- streams: each step's objects -----------------------------------------------------------

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
        if self.details or _is_error(out):
            fields["details"] = self.lmi_details(out, include_tokens=False)
        if _is_error(out):
            fields["error"] = _error_message(out)
        return fields


class TgiStream(Formatter):
    """TGI /generate_stream: one StreamResponse per token, every key present as TGI sends them
    ({index, token, top_tokens, generated_text: null, details: null}; the TGI client's types require
    them); the last carries generated_text and, when asked, details {finish_reason, generated_tokens,
    seed, input_length}. A token-less end rides on LMI's sentinel token. Errors: TGI's error event."""

    def events(self, out: RequestOutput) -> list[dict]:
        self.add(out)
        if _is_error(out):
            return [error_body(Dialect.TGI, _error_message(out), GENERATION_ERROR_CODE)]
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


class _OpenAIStream(_OpenAIFormatter):
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


class ChatStream(_OpenAIStream):
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
        chunk = openai.chat_completion_chunk(**self._ids(), index=self.index, delta=delta, logprobs=logprobs)
        chunk["choices"][0]["finish_reason"] = finish_reason
        return chunk


class CompletionStream(_OpenAIStream):
    """OpenAI text_completion stream of one choice; echo sends the prompt (and, with logprobs, its tokens'
    log probs) in its first chunk, as vLLM does."""

    echo_sent = False

    def _unsent_prompt_tokens(self) -> list[TokenOutput] | None:
        return self.prompt_tokens if self.plan.return_full_text and not self.echo_sent else None

    def _chunk(self, text: str, reason: FinishReason | None, logprobs: dict | None) -> dict:
        if self.plan.return_full_text and not self.echo_sent:
            text, self.echo_sent = self.prompt.text + text, True
        return openai.completion_chunk(**self._ids(), index=self.index, text=text, finish_reason=reason,
                                       logprobs=logprobs)


# One formatter per (shape, streamed): adding a shape adds a row here and its class above.
_DOCUMENTS = {Shape.LMI: LmiDocument, Shape.TGI: TgiDocument, Shape.CHAT: ChatDocument,
              Shape.COMPLETION: CompletionDocument}
_STREAMS = {Shape.LMI: TokenStream, Shape.TGI: TgiStream, Shape.CHAT: ChatStream, Shape.COMPLETION: CompletionStream}


def stream_formatter(plan: RequestPlan, prompt: Prompt, index: int = 0) -> TokenStream | TgiStream | _OpenAIStream:
    """The formatter of one streamed sequence (choice `index`); its events(out) are that sequence's objects."""
    formatter = _STREAMS[plan.shape](plan, prompt)
    formatter.index = index
    return formatter


class StreamAnswer:
    """A streamed answer (plan.stream): each step's objects for all of the prompt's members.

    LMI shapes stream their one sequence as it is. OpenAI shapes stream choice j's chunks with index j
    (members in order, each with its own finish_reason), then once every choice finished the usage chunk
    (stream_options.include_usage: empty choices, prompt once, completion tokens of all choices) and DONE;
    an error in any choice ends the stream with an OpenAI error object and DONE (vLLM).
    """

    def __init__(self, plan: RequestPlan, members: Sequence[Member]):
        """`members`: every prompt's members in order (a list of prompts: prompt p's are members[p*count:
        (p+1)*count]); member j streams as choice j, so prompt p's choices are p*n .. p*n+n-1 (OpenAI, vLLM)."""
        self.plan = plan
        count = plan.sequences.count
        self.streams = {m.request_id: stream_formatter(plan, plan.prompts[j // count], j)
                        for j, m in enumerate(members)}
        self.finished = False

    def events(self, outputs: Mapping[str, RequestOutput]) -> list[Any]:
        """This step's objects; `outputs` holds the step's RequestOutputs by engine request id (others ignored)."""
        events: list[Any] = []
        for request_id, stream in self.streams.items():
            out = outputs.get(request_id)
            if out is None:
                continue
            if self.plan.shape in (Shape.LMI, Shape.TGI):     # one sequence, streamed as it is
                self.finished = out.finished
                return stream.events(out)
            if _is_error(out):
                self.finished = True
                return [stream._error(out), *self.plan.stream_end]
            events.extend(stream.events(out))
        if self.plan.shape not in (Shape.LMI, Shape.TGI) and all(f.finished for f in self.streams.values()):
            self.finished = True
            events.extend(self._tail())
        return events

    def _tail(self) -> list[Any]:
        done = list(self.plan.stream_end)
        if not self.plan.include_usage:
            return done
        streams = list(self.streams.values())
        firsts = streams[::self.plan.sequences.count]       # one per prompt: each prompt counted once
        return [openai.usage_chunk(**streams[0]._ids(), chat=self.plan.shape is Shape.CHAT,
                                   prompt_tokens=sum(f.last.num_prompt_tokens for f in firsts),
                                   completion_tokens=sum(f.num_completion_tokens for f in streams)), *done]


class Answer:
    """A whole (not streamed) answer: gathers every member's outputs; body() once all finished.

    members[p] are prompt p's engine sequences (protocol/sequences.members).
    """

    def __init__(self, plan: RequestPlan, members: Sequence[Sequence[Member]]):
        self.plan = plan
        details = True if plan.sequences.combine is Combine.BEST_OF else None   # members rank by their details
        self.formatters = [[_DOCUMENTS[plan.shape](plan, prompt, m.params.seed, details) for m in prompt_members]
                           for prompt, prompt_members in zip(plan.prompts, members)]
        self._by_id = {m.request_id: f for prompt_members, fs in zip(members, self.formatters)
                       for m, f in zip(prompt_members, fs)}

    def add(self, out: RequestOutput) -> None:
        """Take one step's output of any member (others' ids are ignored)."""
        formatter = self._by_id.get(out.request_id)
        if formatter is not None:
            formatter.add(out)

    @property
    def done(self) -> bool:
        return all(f.finished for f in self._by_id.values())

    def body(self) -> Any:
        """The answer object: one prompt's document, the dynamic-batch list, or TGI's [document]."""
        documents = [self._prompt_document(fs) for fs in self.formatters]
        if self.plan.kind is Kind.DYNAMIC_LIST:
            return documents
        if len(documents) > 1:               # OpenAI completions with a list of prompts: one document
            return merge_openai_bodies(documents)
        failed = any(f.failed for f in self.formatters[0])
        if self.plan.in_list and not failed:
            return [documents[0]]      # TGI's POST / and tgi_compat wrap the non-streaming answer in a list
        return documents[0]

    def _prompt_document(self, formatters: list[Formatter]) -> dict:
        if self.plan.shape in (Shape.CHAT, Shape.COMPLETION):
            return openai_body(self.plan, formatters)
        if len(formatters) == 1:
            return formatters[0].document()
        failed = [f for f in formatters if f.failed]
        if failed:                      # a member that failed answers for the request
            return failed[0].document()
        return combine_best_of([f.document() for f in formatters], [f.score for f in formatters],
                               [f.seed for f in formatters], self.plan.details)


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


def response_body(plan: RequestPlan, members: Sequence[Sequence[Member]],
                  outputs: dict[str, Sequence[RequestOutput]]) -> Any:
    """The answer object of a finished request: `members` is plan.members() (the sequences that ran),
    `outputs[member.request_id]` each member's RequestOutputs step by step, the last one finished
    (Engine.generate's result). For an OpenAI plan (chat, completion, batch line) this is the OpenAI
    response body dict; batch output lines embed it as response.body."""
    answer = Answer(plan, members)
    for prompt_members in members:
        for member in prompt_members:
            for out in outputs[member.request_id]:
                answer.add(out)
    return answer.body()


def outputs_line(texts: list[str]) -> dict:
    """LMI dynamic batch streaming: one {"outputs": [new text per input]} object per step."""
    return {"outputs": texts}


def stream_failure(message: str, code: int, plan: RequestPlan) -> list[Any]:
    """The last objects of a stream whose request failed after HTTP 200 went out (DESIGN §3: a final
    line with finish_reason "error"). OpenAI kinds get an error chunk and the terminator, as vLLM sends;
    TGI's routes TGI's error event (no terminator: TGI sends none)."""
    if plan.dialect is Dialect.OPENAI:
        return [error_body(plan.dialect, message, code), *plan.stream_end]
    if plan.dialect is Dialect.TGI:
        return [error_body(plan.dialect, message, code)]
    return [{"token": token_to_dict(SENTINEL_TOKEN), "details": {"finish_reason": FinishReason.ERROR.value},
             **error_body(Dialect.LMI, message, code)}]
