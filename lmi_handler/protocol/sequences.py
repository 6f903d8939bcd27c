"""n / best_of: how many engine sequences a request runs and how their answers combine, per dialect.

Owns each dialect's rule (TGI best_of on /invocations and /generate; OpenAI n and legacy best_of on
the OpenAI routes and LMI chat), the members' seeds and the rankings; documents are formatters/'s.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Sequence

from lmi_handler.engine.sequence import SamplingParams, random_seed, wrap_int64
from lmi_handler.protocol.errors import RequestValidationError, show_value


class Combine(str, enum.Enum):
    """How several sequences of one prompt make one answer."""

    SINGLE = "single"        # one sequence, answered as itself
    BEST_OF = "best_of"      # TGI: the best summed log prob answers; the others go to details.best_of_sequences
    CHOICES = "choices"      # OpenAI n: one choice per sequence (best_of > n: the n best, vLLM)
    BEAMS = "beams"          # beam search: one engine request; its n best beams answer (vLLM use_beam_search)


@dataclass(frozen=True)
class SequencePlan:
    """`count` engine sequences per prompt, combined by `combine`; CHOICES answers `num_choices` of them."""

    count: int = 1
    combine: Combine = Combine.SINGLE
    num_choices: int = 1


SINGLE = SequencePlan()


@dataclass(frozen=True)
class Member:
    """One engine sequence of a prompt: its engine request id and params (seed resolved)."""

    request_id: str
    params: SamplingParams


def requested(n: int, best_of: int | None) -> tuple[int, str]:
    """Sequences asked for, max(n, best_of) (vLLM/TGI best_of semantics), and the field to name in errors."""
    count = max(n, best_of or 1)
    return count, ("best_of" if (best_of or 1) >= n else "n")


def check_sampled(n: int, best_of: int | None, greedy: bool) -> None:
    """TGI rule: several sequences need sampling (greedy ones would all be the same). Raises RequestValidationError."""
    count, name = requested(n, best_of)
    if count > 1 and greedy:
        value = best_of if name == "best_of" else n
        raise RequestValidationError(
            name, f"Invalid parameter `{name}`: {name} > 1 needs sampling (do_sample=true or a sampling "
                  f"parameter such as temperature), got {show_value(value)} with greedy decoding")


def tgi_best_of(n: int, best_of: int | None, *, streaming_why: str | None, max_count: int) -> SequencePlan:
    """LMI /invocations and TGI /generate: n or best_of > 1 generate that many sampled sequences and answer
    the best (TGI best_of). Not streamed (TGI), at most `max_count` (the batch size).

    `streaming_why` says why the answer would stream (None when it does not). Raises RequestValidationError.
    """
    count, name = requested(n, best_of)
    if count == 1:
        return SINGLE
    if streaming_why is not None:
        raise RequestValidationError(name, f"Invalid parameter `{name}`: {name} > 1 cannot be streamed "
                                     f"({streaming_why}), got {count}")
    if count > max_count:
        raise RequestValidationError(name, f"Invalid parameter `{name}`: must be at most "
                                     f"max_rolling_batch_size ({max_count}), got {count}")
    return SequencePlan(count, Combine.BEST_OF)


def openai_n(n: int, best_of: int | None, *, stream: bool, max_count: int) -> SequencePlan:
    """OpenAI chat and completions (and LMI chat): `n` choices, index 0..n-1, each its own engine sequence.

    Legacy completions `best_of` (>= n) generates best_of sequences and answers the n with the highest
    summed log prob (OpenAI, vLLM's cumulative_logprob); it cannot be streamed (OpenAI). Greedy n > 1 is
    allowed (n identical choices, as OpenAI and vLLM answer). At most `max_count` (the batch size)
    sequences. Raises RequestValidationError naming n or best_of.
    """
    if best_of is not None and best_of < n:
        raise RequestValidationError("best_of", f"Invalid parameter `best_of`: must be >= n ({n}), got {best_of}")
    count, name = requested(n, best_of)
    if count > max_count:
        raise RequestValidationError(name, f"Invalid parameter `{name}`: must be at most "
                                     f"max_rolling_batch_size ({max_count}), got {count}")
    if count > n and stream:
        raise RequestValidationError("best_of", f"Invalid parameter `best_of`: best_of > n cannot be streamed "
                                     f"(OpenAI), got best_of={best_of} with n={n}")
    if count == 1:
        return SINGLE
    return SequencePlan(count, Combine.CHOICES, num_choices=n)


def beam_search(num_beams: int, num_choices: int, *, stream: bool) -> SequencePlan:
    """A beam search (num_beams > 1) is one engine request whose best `num_choices` beams answer, best first
    (vLLM use_beam_search: n choices). Streamed, it sends its best beam once the search ends (every token
    at once: the search decides the beam only at its end), so a stream answers one choice. Raises
    RequestValidationError("n") for a streamed n > 1."""
    if stream and num_choices > 1:
        raise RequestValidationError("n", f"Invalid parameter `n`: a streamed beam search answers its best beam "
                                     f"only, so n must be 1, got {num_choices}")
    return SequencePlan(1, Combine.BEAMS, num_choices=min(num_choices, num_beams))


def best_choices(scores: Sequence[float], num_choices: int) -> list[int]:
    """OpenAI best_of: the members answering as choices 0..num_choices-1, highest summed log prob first
    (vLLM sorts by cumulative_logprob; ties keep member order). With best_of == n, every member in order."""
    if num_choices >= len(scores):
        return list(range(len(scores)))
    return sorted(range(len(scores)), key=lambda j: -scores[j])[:num_choices]


def members(request_id: str, params: SamplingParams, plan: SequencePlan,
            front_end_seed: int | None = None) -> list[Member]:
    """The engine sequences of one prompt, with seeds seed, seed+1, ... (int64-wrapped).

    The base seed is the request's, else the front end's (DJL batch_NNN.seed), else a fresh one, as
    Engine.add_request would choose; a single sequence keeps the request id.
    """
    base = params.seed
    if base is None:
        base = front_end_seed if front_end_seed is not None else random_seed()
    if plan.count == 1:
        return [Member(request_id, replace(params, seed=base))]
    return [Member(f"{request_id}#{j}", replace(params, seed=wrap_int64(base + j))) for j in range(plan.count)]


def combine_best_of(documents: Sequence[dict[str, Any]], scores: Sequence[float], seeds: Sequence[int | None],
                    details: bool) -> dict[str, Any]:
    """TGI best_of: the document with the highest summed log prob (`scores`) answers; with details, the
    others follow in details.best_of_sequences as TGI's BestOfSequence
    {generated_text, finish_reason, generated_tokens, seed, tokens}. Each document carries details."""
    best = max(range(len(documents)), key=lambda j: scores[j])
    answer: dict[str, Any] = {"generated_text": documents[best]["generated_text"]}
    if details:
        answer["details"] = dict(documents[best]["details"])
        answer["details"]["best_of_sequences"] = [
            {"generated_text": doc["generated_text"], "finish_reason": doc["details"]["finish_reason"],
             "generated_tokens": doc["details"]["generated_tokens"], "seed": seeds[j],
             "tokens": doc["details"]["tokens"]}
            for j, doc in enumerate(documents) if j != best]
    return answer
