"""Structured output: grammar specs compiled by llguidance off the engine loop, one matcher per constrained sequence.

Owns GrammarCompiler (worker threads, the compile cache keyed by spec, compile deadlines) and GrammarState (a
sequence's matcher: its bitmask row each step, the sampled token fed back, a fork for beams). Leaves applying
the masks to logits_controls.py and ending sequences to the engine's stop path.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from lmi_handler.engine.grammar_spec import GrammarError, first_lines, grammar_source
from lmi_handler.engine.logits_controls import bitmask_words
from lmi_handler.engine.sequence import Sequence, StructuredOutputSpec

CACHE_SIZE = 256   # compiled specs kept (least recently used dropped first)


def timeout_message(seconds: float) -> str:
    """The error of a compile past its limit: names the option and its value, and what a retry gets."""
    return (f"the grammar did not compile within option.structured_output_compile_timeout_s ({seconds:g} s); "
            "its compile goes on, and the same schema sent again once it is done is served from the cache")


@dataclass(frozen=True)
class CompiledGrammar:
    """A compile's result: the matcher (copied per sequence) and when the compile ended (time.monotonic() s)."""

    matcher: object
    finished_at: float


@dataclass
class CompileTicket:
    """A request's wait for its grammar: the shared compile, and when this request stops waiting."""

    spec: StructuredOutputSpec
    future: Future
    deadline: float            # time.monotonic() seconds
    timeout_s: float           # the limit the deadline came from (for the error message)

    def outcome(self, now: float, end_ids: tuple[int, ...]) -> "GrammarState | str | None":
        """The sequence's matcher once compiled (`end_ids`: its eos and stop ids), an error message if the
        compile failed or ran past the deadline, else None (still compiling). A compile that ended after this
        request's deadline fails it even if the engine looks only later: the outcome depends on when the compile
        ended, not on when the engine loop came round to ask."""
        if self.future.done():
            exc = self.future.exception()
            if exc is not None:
                return f"structured output: {exc}"
            compiled: CompiledGrammar = self.future.result()
            if compiled.finished_at > self.deadline:
                return f"structured output: {timeout_message(self.timeout_s)}"
            return GrammarState(compiled.matcher.deep_copy(), end_ids)
        if now >= self.deadline:
            return f"structured output: {timeout_message(self.timeout_s)}"
        return None


class GrammarCompiler:
    """Compiles specs to llguidance matchers on worker threads; compiles are cached by spec.

    llguidance drops the GIL while it builds a grammar, so the engine loop keeps stepping while a large
    schema compiles. The tokenizer table (~1 s for a 49k vocabulary) is built on the first compile, on a
    worker. `vocab_size` is the logits width: ids past the
    tokenizer's vocabulary are never allowed.
    A compile past its deadline fails only the requests waiting on it; the compile itself runs on (llguidance's
    resource limits bound it) and its result serves later requests with the same spec.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], compile_timeout_s: float,
                 max_workers: int = 2):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[StructuredOutputSpec, Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._lltok = None
        self._lltok_lock = threading.Lock()
        self._executor = None

    def submit(self, spec: StructuredOutputSpec) -> CompileTicket:
        """Start (or join) the compile of `spec`; returns at once. Thread-safe."""
        with self._cache_lock:
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._pool.submit(self._compile, spec)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
        return CompileTicket(spec, future, time.monotonic() + self.compile_timeout_s, self.compile_timeout_s)

    def validate(self, spec: StructuredOutputSpec) -> None:
        """Compile `spec` now (or wait for its compile), for a 400 before the request is queued; the result is
        cached, so the request's own compile is then immediate. Blocks the caller up to compile_timeout_s:
        call it where waiting is fine (a request thread), never on the engine loop, which has add_request's
        asynchronous path instead. Raises GrammarError (malformed, unsupported, or past the time limit)."""
        ticket = self.submit(spec)
        try:
            compiled = ticket.future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise GrammarError(timeout_message(self.compile_timeout_s)) from None
        if compiled.finished_at > ticket.deadline:       # this thread woke late: the compile itself ran past
            raise GrammarError(timeout_message(self.compile_timeout_s))

    def wait_any(self, tickets: list[CompileTicket], timeout_s: float) -> None:
        """Block up to timeout_s seconds until one of the compiles ends (the engine has nothing else to run)."""
        for ticket in tickets[:1]:
            try:
                ticket.future.result(timeout=max(0.0, min(timeout_s, ticket.deadline - time.monotonic())))
            except (FutureTimeout, Exception):  # noqa: BLE001 - outcome() reports it
                pass

    def tokenizer_info(self):
        """llguidance's tokenizer table, built once (thread-safe)."""
        with self._lltok_lock:
            if self._lltok is None:
                import llguidance.hf

                # the grammar's end token is the model's eos (what ends a sequence here), not the tokenizer's
                eos = self.eos_token_ids[0] if self.eos_token_ids else self.tokenizer.eos_token_id
                self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            return self._lltok

    def _compile(self, spec: StructuredOutputSpec):
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer_info(), grammar_source(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(first_lines(matcher.get_error()))
        return CompiledGrammar(matcher, time.monotonic())

    def fill_bitmask(self, seqs: list[Sequence], prefixes: list[list[int]] | None = None) -> torch.Tensor:
        """(len(seqs), W) int32 on CPU: row i allows what seqs[i]'s grammar accepts next, after the tokens
        prefixes[i] (a verify row's drafts before it, engine/speculative/: consumed, the mask taken, rolled back;
        the speculator keeps only drafts the grammar accepts). Where the grammar may end, the model's eos ids and
        the row's stop_token_ids are allowed too (they end the sequence)."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = bitmask_words(self.vocab_size)
        bitmask = torch.zeros(len(seqs), words, dtype=torch.int32)
        ahead = [i for i, prefix in enumerate(prefixes or ()) if prefix]
        plain = [(s.grammar.matcher, i) for i, s in enumerate(seqs) if not (prefixes and prefixes[i])]
        # llguidance writes row i at data_ptr + i * 4 * words, on its own threads (what its torch helper does,
        # without importing that helper's torch.compile kernels)
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), 4 * words, len(seqs))
        for i in ahead:
            matcher = seqs[i].grammar.matcher
            matcher.consume_tokens(prefixes[i])
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), 4 * words)
            matcher.rollback(len(prefixes[i]))
        eos = self.tokenizer_info().eos_token
        may_end = ((bitmask[:, eos // 32] >> (eos % 32)) & 1).nonzero().flatten().tolist()   # one test for all rows
        for i in may_end:   # only rows whose grammar may end here: set their other end ids
            for token in self.eos_token_ids + seqs[i].params.stop_token_ids:
                _set_bit(bitmask[i], token)
        return bitmask


def _set_bit(row: torch.Tensor, token: int) -> None:
    word = int(row[token // 32]) | (1 << (token % 32))
    row[token // 32] = word - (1 << 32) if word >= 1 << 31 else word


class GrammarState:
    """One sequence's matcher and its end ids (the model's eos ids and the request's stop_token_ids).
    `advance` feeds it the sampled token; `fork` copies it for a new beam."""

    def __init__(self, matcher, end_ids: tuple[int, ...]):
        self.matcher = matcher
        self.end_ids = frozenset(end_ids)

    def advance(self, token_id: int) -> tuple[bool, str | None]:
        """Feed the token just sampled. Returns (ended, error): ended when the token is an end id (eos or
        a stop id, which the mask allows only where the grammar may end: the sequence ends there, even under
        ignore_eos); error is a message when the grammar rejected the token (the sequence then fails). A grammar
        with nothing left to add allows only the end ids, so the next token ends it."""
        if token_id in self.end_ids:
            return True, None
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            return False, f"structured output: the grammar rejected token {token_id}: " \
                          f"{first_lines(self.matcher.get_error(), 200)}"
        return False, None

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), tuple(self.end_ids))
