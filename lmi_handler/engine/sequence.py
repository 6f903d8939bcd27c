"""One request's state inside the engine: token ids, sampling params, status, KV blocks, outputs.

Owns the plain dataclasses every engine part shares; validation of user input happens earlier,
in protocol/params.py, which turns a request into a trusted `SamplingParams`.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def wrap_int64(value: int) -> int:
    """`value` reduced to the int64 with the same low 64 bits (seeds may be any int64, e.g. seed + j)."""
    return ((value + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def random_seed() -> int:
    """A seed drawn for a request that names none: any int64, as the DJL front end draws them."""
    return random.randint(INT64_MIN, INT64_MAX)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    """LMI schema finish reasons; protocol/openai.py maps them to OpenAI's words."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ERROR = "error"


class GrammarKind(str, enum.Enum):
    """What a structured-output constraint is written in (engine/grammar.py compiles each)."""

    JSON_SCHEMA = "json_schema"   # value: the schema as JSON text
    JSON_OBJECT = "json_object"   # any JSON object; value ""
    REGEX = "regex"               # value: the pattern, matched in full
    CHOICE = "choice"             # choices: the allowed outputs, exactly
    GRAMMAR = "grammar"           # value: a Lark grammar, or GBNF/EBNF (rules written with ::=)


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's output constraint, as the protocol layer hands it over (hashable: compiles are cached by it).

    The engine masks every token the grammar cannot accept next; the sequence ends when the grammar
    does (the model must then pick eos or a stop token). `max_whitespace` bounds each run of
    whitespace between JSON tokens (JSON kinds), so JSON mode cannot spin on spaces until max_new_tokens.
    """

    kind: GrammarKind
    value: str = ""
    choices: tuple[str, ...] = ()
    max_whitespace: int = 8


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation knobs, already validated at the edge (protocol/params.py).

    `greedy` is decided once at the edge (LMI >= 0.32: explicit do_sample=false or
    temperature 0 forces greedy; otherwise sampling parameters alone turn sampling on).
    `seed` None means "draw one at admission" (the engine fills it, so every sampled row
    has a seed and its draws depend only on (seed, output position)).
    """

    greedy: bool = True
    temperature: float = 1.0            # > 0; only used when not greedy
    top_k: int = 0                      # LMI schema: 0 = off
    top_p: float = 1.0                  # (0, 1]; 1.0 = off
    min_p: float = 0.0                  # [0, 1]; 0 = off
    typical_p: float = 1.0              # (0, 1]; 1.0 = off
    repetition_penalty: float = 1.0     # > 0; over prompt and output tokens (vLLM definition)
    presence_penalty: float = 0.0       # [-2, 2]; over output tokens
    frequency_penalty: float = 0.0      # [-2, 2]; over output tokens
    seed: int | None = None
    max_new_tokens: int = 30            # tokens
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    top_n_tokens: int = 0               # alternatives returned per generated token
    prompt_logprobs: bool = False       # LMI decoder_input_details
    prompt_top_n_tokens: int = 0        # vLLM prompt_logprobs=k: alternatives per prompt token (needs prompt_logprobs)
    # logits controls (engine/logits_controls.py); token ids must be < the model's vocab size
    logit_bias: tuple[tuple[int, float], ...] = ()   # OpenAI/vLLM: (token id, added to its logit), ids unique
    min_tokens: int = 0                 # vLLM: eos and stop_token_ids banned (and stop strings unmatched) before this
    bad_words: tuple[tuple[int, ...], ...] = ()      # vLLM bad_words / TRT-LLM bad_sequences, as token ids: the
    # last id is banned whenever the ids before it end the context (prompt + output; one id = always banned)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM: only these ids may be generated
    structured_output: StructuredOutputSpec | None = None
    # beam search (engine/beam_search.py; transformers' semantics): num_beams > 1 turns it on
    num_beams: int = 1
    length_penalty: float = 1.0         # finished score = sum of log probs / generated_len ** length_penalty
    early_stopping: bool | str = False  # True, False (transformers' heuristic) or "never"
    adapter: str | None = None          # the LoRA adapter's name (option.enable_lora); None = the base model
    priority: int = 0                   # vLLM: lower runs first under option.scheduling_policy=priority (scheduler.py)
    # a prompt's images (engine/model/vision.MultimodalPrompt: token ids with the placeholders expanded, each
    # image's pixels, positions and hash); carried with the knobs so every member of n / best_of / beams has them
    multimodal: Any = field(default=None, compare=False)

    @property
    def uses_beam_search(self) -> bool:
        return self.num_beams > 1


@dataclass
class TokenOutput:
    """One generated token as it leaves the engine (maps 1:1 to the LMI `Token` object).

    `text` is this token's share of the released output text: the streamed texts of a
    request always concatenate to its generated_text (stop strings trimmed, partial UTF-8
    characters carried by the token that completes them).
    `log_prob` is the natural-log probability of the token under the processed distribution
    it was drawn from (after penalties, temperature and top-k/top-p/min-p/typical-p; the raw
    log-softmax for greedy rows).
    """

    id: int
    text: str
    log_prob: float
    special_token: bool
    top_tokens: list[tuple[int, float]] | None = None  # (id, log_prob), best first
    rank: int | None = None  # prompt tokens with prompt_top_n_tokens: 1 + ids with a strictly higher log prob (vLLM)


@dataclass(eq=False)
class Sequence:
    """A request's running state. The engine mutates it; the model runner and scheduler read it.

    Compared by identity (eq=False): a beam forked from another is field-for-field equal to it at first,
    and the queues' `in` / `remove` must never mistake one for the other.

    Token positions: all_token_ids = prompt_token_ids + output_token_ids.
    `num_computed_tokens` counts tokens whose K/V are in the cache; the sequence is in
    prefill while `num_tokens - num_computed_tokens > 1`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0                       # seconds, time.monotonic()
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # prefix caching (scheduler.py): chain hashes of the full blocks of all_token_ids computed so
    # far (they stay valid across preemption: tokens never change), how many leading blocks of
    # block_table are in the prefix cache, and the tokens found cached at the latest admission
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # filled by the engine's output path
    output_logprobs: list[float] = field(default_factory=list)
    prompt_token_logprobs: list[float | None] | None = None  # first is None (no context)
    prompt_top_tokens: list[list[tuple[int, float]] | None] | None = None  # prompt_top_n_tokens; first None
    prompt_token_ranks: list[int | None] | None = None  # prompt_top_n_tokens: each prompt token's rank; first None
    first_token_time: float | None = None          # seconds, for TTFT
    # structured output (engine/grammar.py): the compile being waited on, then this sequence's matcher
    grammar_ticket: Any = None                      # CompileTicket while the grammar compiles
    grammar: Any = None                             # GrammarState once compiled
    beam_group: Any = None                          # BeamGroup of a beam-search request (engine/beam_search.py)
    # LoRA (engine/model/lora/): the LoraAdapter params.adapter named, resolved at admission (a running
    # request keeps it even if the adapter is unloaded meanwhile); its key salts the prefix-cache hashes
    adapter: Any = None
    # speculative decoding (engine/speculative/): tokens drafted for this step, verified as extra query positions
    # after the last token; cleared when the step settles (only accepted ones join output_token_ids)
    draft_token_ids: list[int] = field(default_factory=list)
    # images (params.multimodal): image index -> its encoded rows, kept from the first prefill chunk that reaches
    # it until the prompt is past it (engine/image_rows.py)
    image_embeds: dict[int, Any] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def in_beam_search(self) -> bool:
        """A beam of a search that has forked: its beams are scheduled together, one decode token each."""
        return self.beam_group is not None and self.beam_group.started

    @property
    def waiting_for_grammar(self) -> bool:
        """Its grammar is still compiling: the scheduler leaves it waiting, holding no KV blocks."""
        return self.grammar_ticket is not None and self.grammar is None


@dataclass
class BeamOutput:
    """One finished beam of a beam-search request (engine/beam_search.py), best first in RequestOutput.beams."""

    text: str
    tokens: list[TokenOutput]       # texts concatenate to `text`; log_prob is the processed log prob
    score: float                    # sum of log probs / len(tokens) ** length_penalty (transformers)
    cumulative_logprob: float       # sum of the tokens' log probs
    finish_reason: FinishReason


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step; the protocol formatters turn it into bytes.

    `new_tokens` are the tokens whose text was decided this step (text held back for a
    possible stop string is released later, one TokenOutput per generated token in order).
    `generated_text` is all released text so far: final once `finished` is True.
    """

    request_id: str
    new_tokens: list[TokenOutput]
    generated_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prompt_tokens: list[TokenOutput] | None = None   # decoder_input_details, on the first output
    error: str | None = None
    # the request ended before any token because what it asked for cannot be done (its grammar does not
    # compile, or not in time): a client error (4xx naming the constraint's field), not a generation failure
    invalid_request: bool = False
    # beam search: every finished beam, best first (the best is also new_tokens / generated_text); a beam
    # request reports only once, when the search ends
    beams: list[BeamOutput] | None = None
