"""Plans and engine outputs built by hand for the protocol tests (no model needed)."""
from __future__ import annotations

import json

from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, TokenOutput
from lmi_handler.protocol.encoder import Wire, encode
from lmi_handler.protocol.formatters import Answer, StreamAnswer
from lmi_handler.protocol.plan import Kind, Prompt, RequestPlan, Shape, shape_of
from lmi_handler.protocol.sequences import SINGLE, Combine, SequencePlan, members

PROMPT = "Say:"


def tok(i: int, text: str, top: bool = False) -> TokenOutput:
    return TokenOutput(i, text, -0.1 * i, False, [(i, -0.1 * i), (99, -5.0)] if top else None)


def steps(reason: FinishReason = FinishReason.LENGTH, top: bool = False, request_id: str = "abc") -> list[RequestOutput]:
    """Three steps: one token, none (text held back), then two tokens and finish; "Hi 我😀"."""
    return [
        RequestOutput(request_id, [tok(1, "Hi", top)], "Hi", False, None, 4, 1,
                      prompt_tokens=[TokenOutput(7, "Say", None, False), TokenOutput(8, ":", -2.0, False)]),
        RequestOutput(request_id, [], "Hi", False, None, 4, 2),
        RequestOutput(request_id, [tok(2, " 我", top), tok(3, "😀", top)], "Hi 我😀", True, reason, 4, 3),
    ]


def make_plan(kind: Kind = Kind.LMI_TEXT, wire: Wire = Wire.JSON, params: SamplingParams | None = None,
              shape: Shape | None = None, **fields) -> RequestPlan:
    """A one-prompt plan (request id "abc", prompt "Say:"); `wire` other than json means streamed."""
    prompt = Prompt("abc", PROMPT, (7, 8), params or SamplingParams())
    base = dict(request_id="abc", kind=kind, shape=shape or shape_of(kind), wire=wire, stream=wire is not Wire.JSON,
                prompts=(prompt,), sequences=SINGLE, model_name="smol", created=1700000000)
    return RequestPlan(**{**base, **fields})


def run(plan: RequestPlan, outs: list[RequestOutput]) -> list[str]:
    """The text each step sends, as the handler sends it: streamed events, or the whole answer at the end."""
    plan_members = members(plan.request_id, plan.prompts[0].params, plan.sequences, 0)
    if plan.stream:
        stream = StreamAnswer(plan, plan_members)
        return [encode(stream.events({out.request_id: out}), plan.wire) for out in outs]
    answer = Answer(plan, [plan_members])
    sent = []
    for out in outs:
        answer.add(out)
        sent.append(encode([answer.body()], Wire.JSON) if answer.done else "")
    return sent


def lines_of(text: str, sse: bool = False) -> list[dict]:
    """The JSON objects in one step's text ("" = nothing sent); SSE events must be `data: ...`."""
    if not text:
        return []
    if sse:
        events = [e for e in text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        return [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]"]
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


SAMPLED = SamplingParams(greedy=False, seed=10)


def choices_plan(kind: Kind, count: int, num_choices: int, wire: Wire = Wire.JSON, **fields) -> RequestPlan:
    """A plan of `count` sampled sequences (seed 10) answered as `num_choices` OpenAI choices."""
    return make_plan(kind, wire, params=SAMPLED, sequences=SequencePlan(count, Combine.CHOICES, num_choices),
                     **fields)


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as a server streams it: the demo tokenizer's tokens of it, each one's new text as the engine's
    IncrementalDetokenizer gives it (special tokens kept: the family markers are plain text to this tokenizer)."""
    from lmi_handler.engine.detokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    pieces = [detokenizer.decode_next(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    pieces.append(detokenizer.flush())
    return [p for p in pieces if p]
