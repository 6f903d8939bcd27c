"""Faults inside an engine step: isolate them to the sequences they hit, and inject them for tests.

Owns StepGuard (one engine step; a failure ends only the sequences it can be pinned to) and the
fault-injection switch (`option.fault_injection`). The engine itself is unchanged: the guard drives
Engine.step / Engine.abort and parks sequences by moving them out of the scheduler's queues.

Rules of isolation (issue 8, "Faults"):
1. A `SequenceFault` names the sequences it hit: those are aborted (KV blocks freed), the rest go on.
2. Any other exception cannot be pinned: the step is retried without the sequences this step newly
   admitted; if that works, each of those newest admissions is stepped alone and the ones that fail
   alone are failed (all of them if none does).
3. Else each running sequence is stepped alone; the ones that fail alone are failed. If none does (the
   fault needs the whole batch), the newest running sequence is failed. Never the whole batch.
4. An `EngineFatal` error is not isolated: the engine cannot step again (e.g. a tensor-parallel rank
   died: parallel/executor.RankFailed), so StepGuard re-raises it and its callers fail every request.
"""
from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

from lmi_handler.engine.sequence import RequestOutput, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class EngineFatal(RuntimeError):
    """An error after which the engine can run no step at all (every later step raises it again): not a
    fault of some sequences, so StepGuard never isolates it but raises it, and the server reports itself
    unhealthy (Engine.failure()). Subclasses: parallel/executor.RankFailed."""


class SequenceFault(RuntimeError):
    """An error inside a step that knows which sequences it hit (engine request ids)."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = list(request_ids)


def failure_message(exc: BaseException) -> str:
    """The error text a failed request's client sees (its stream's last line, or the error body)."""
    return f"internal error during generation: {type(exc).__name__}: {exc}"


class StepGuard:
    """Runs Engine.step(); on an exception ends only the sequences the fault is pinned to (module rules).

    `step()` returns (outputs, failed): the step's RequestOutputs and {engine request id: error message}
    of the sequences it ended (already aborted, their blocks freed). Raises EngineFatal as it came (rule 4),
    and anything else only if isolation itself fails.
    """

    def __init__(self, engine):
        self.engine = engine

    def step(self) -> tuple[list[RequestOutput], dict[str, str]]:
        engine = self.engine
        running_before = {seq.request_id for seq in engine.scheduler.running}
        computed = self._snapshot()
        try:
            return engine.step(), {}
        except EngineFatal:
            raise                   # nothing to isolate: no step can run (rule 4)
        except SequenceFault as fault:
            self._restore(computed)
            logger.error("engine step failed for %s: %s", fault.request_ids, fault)
            hit = [rid for rid in fault.request_ids if rid in engine.seqs]
            if hit:
                return [], self._fail(hit, failure_message(fault))
            return self._isolate(fault, running_before, computed)
        except Exception as exc:  # any bug in a step is isolated, never fatal
            logger.exception("engine step failed; isolating the sequences it hit")
            self._restore(computed)
            return self._isolate(exc, running_before, computed)

    # ---- isolation -----------------------------------------------------------------------------

    def _isolate(self, exc: BaseException, running_before: set[str],
                 computed: dict[str, int]) -> tuple[list[RequestOutput], dict[str, str]]:
        scheduler, message = self.engine.scheduler, failure_message(exc)
        newest = [seq for seq in scheduler.running if seq.request_id not in running_before]
        if newest:
            outputs = self._try_without(newest, computed)
            if outputs is not None:
                culprits = self._alone(newest, outputs) or [s.request_id for s in newest]
                logger.error("the step works without the newest admissions: failing %s", culprits)
                return outputs, self._fail(culprits, message)
        outputs = []
        culprits = self._alone(list(scheduler.running), outputs)
        if not culprits and scheduler.running:
            culprits = [scheduler.running[-1].request_id]   # the fault needs the batch: fail the newest one
        logger.error("failing %s after the step failed", culprits)
        return outputs, self._fail(culprits, message)

    def _alone(self, seqs: list[Sequence], outputs: list[RequestOutput]) -> list[str]:
        """Step each of `seqs` on its own (their outputs join `outputs`); the ids of those that fail alone."""
        scheduler, culprits = self.engine.scheduler, []
        for seq in seqs:
            if seq.request_id not in self.engine.seqs or seq.status is not SequenceStatus.RUNNING:
                continue
            alone = self._try_without([s for s in scheduler.running if s is not seq], self._snapshot())
            if alone is None:
                culprits.append(seq.request_id)
            else:
                outputs.extend(alone)
        return culprits

    def _try_without(self, parked: list[Sequence], computed: dict[str, int]) -> list[RequestOutput] | None:
        """One step with `parked` (and every waiting sequence) set aside; None (state restored) if it fails."""
        with self._parked(parked):
            try:
                return self.engine.step()
            except Exception:  # noqa: BLE001 - the caller decides who failed
                self._restore(computed)
                return None

    @contextmanager
    def _parked(self, seqs: list[Sequence]) -> Iterator[None]:
        """Take `seqs` out of the running queue and hold the waiting queue back; both come back after."""
        scheduler = self.engine.scheduler
        order = {id(seq): i for i, seq in enumerate(scheduler.running)}
        ids = {id(seq) for seq in seqs}
        parked = [seq for seq in scheduler.running if id(seq) in ids]
        scheduler.running[:] = [seq for seq in scheduler.running if id(seq) not in ids]
        waiting, scheduler.waiting = scheduler.waiting, deque()
        try:
            yield
        finally:
            back = [seq for seq in parked if seq.status is SequenceStatus.RUNNING]
            scheduler.running[:] = sorted(scheduler.running + back, key=lambda s: order.get(id(s), len(order)))
            scheduler.waiting.extend(waiting)   # preempted during the step first, then the held-back ones

    def _fail(self, request_ids: list[str], message: str) -> dict[str, str]:
        for request_id in request_ids:
            self.engine.abort(request_id)   # leaves both queues, frees its KV blocks
        return {request_id: message for request_id in request_ids}

    def _snapshot(self) -> dict[str, int]:
        return {rid: seq.num_computed_tokens for rid, seq in self.engine.seqs.items()}

    def _restore(self, computed: dict[str, int]) -> None:
        """Undo a failed step's progress: tokens it claimed to compute are computed again next time.

        Only running sequences with blocks keep a count; one preempted meanwhile restarts from 0 anyway.
        """
        for rid, seq in self.engine.seqs.items():
            if seq.status is SequenceStatus.RUNNING and seq.block_table and rid in computed:
                seq.num_computed_tokens = min(computed[rid], seq.num_computed_tokens)


# ---- fault injection (tests) --------------------------------------------------------------------

FAULT_RULE_HELP = ("option.fault_injection: rules separated by ';', each [pinned:]STAGE@TARGET with STAGE "
                   "'prefill' or 'decode:N' (N >= 1: the step computing output token N+1) and TARGET "
                   "'id=<request id>' or a text the prompt contains, e.g. 'decode:4@Water is'")


class InjectedFault(RuntimeError):
    """The error the fault-injection switch raises (unpinned: the guard must find its sequence)."""


@dataclass(frozen=True)
class FaultRule:
    """One fault-injection rule: which sequences fail, at which stage (see FAULT_RULE_HELP)."""

    stage: Literal["prefill", "decode"]
    decode_step: int | None = None
    marker: str | None = None          # a substring of the prompt text
    request_id: str | None = None      # an engine request id (n / best_of members: "<id>#j" match too)
    pinned: bool = False               # raise a SequenceFault naming the sequence, not a plain error

    @classmethod
    def parse_all(cls, text: str) -> list["FaultRule"]:
        """Parse `option.fault_injection`. Raises ValueError (with FAULT_RULE_HELP) for a malformed rule."""
        return [cls.parse(part) for part in text.split(";") if part.strip()]

    @classmethod
    def parse(cls, text: str) -> "FaultRule":
        spec, sep, target = text.strip().partition("@")
        pinned = spec.startswith("pinned:")
        spec = spec[len("pinned:"):] if pinned else spec
        stage, _, step = spec.partition(":")
        if not sep or not target or stage not in ("prefill", "decode") or (stage == "decode") != step.isdigit() \
                or (step and int(step) < 1):
            raise ValueError(f"bad fault rule {text!r}; {FAULT_RULE_HELP}")
        request_id = target[len("id="):] if target.startswith("id=") else None
        return cls(stage, int(step) if step else None, None if request_id else target, request_id, pinned)  # type: ignore[arg-type]

    def hits(self, seq: Sequence, prompt_text: str) -> bool:
        """Whether `seq`, scheduled this step, fails under this rule."""
        if self.request_id is not None:
            if seq.request_id != self.request_id and not seq.request_id.startswith(self.request_id + "#"):
                return False
        elif self.marker not in prompt_text:
            return False
        if self.stage == "prefill":
            return seq.num_computed_tokens < seq.num_prompt_tokens
        return seq.num_computed_tokens >= seq.num_prompt_tokens and seq.num_output_tokens == self.decode_step


class FaultInjector:
    """Makes the engine step fail for the sequences the rules pick, every time they reach that stage.

    Installed over `engine.scheduler.schedule`: right after scheduling (blocks reserved, before the
    forward pass) it raises InjectedFault (or SequenceFault for pinned rules) when a scheduled sequence
    matches, so the error surfaces inside Engine.step as a model failure would.
    """

    def __init__(self, engine, rules: list[FaultRule]):
        self.engine = engine
        self.rules = rules
        self.prompts: dict[str, tuple[Sequence, str]] = {}   # request id -> (its sequence, prompt text)
        self.schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self._schedule

    def _schedule(self):
        out = self.schedule()
        for seq in out.seqs:
            for rule in self.rules:
                if rule.hits(seq, self._prompt_text(seq)):
                    message = f"injected fault ({rule.stage}) for request {seq.request_id}"
                    if rule.pinned:
                        raise SequenceFault(message, [seq.request_id])
                    raise InjectedFault(message)
        return out

    def _prompt_text(self, seq: Sequence) -> str:
        known = self.prompts.get(seq.request_id)
        if known is None or known[0] is not seq:   # ids may come back (client-chosen x-request-id)
            if len(self.prompts) > 4096:
                self.prompts = {rid: pair for rid, pair in self.prompts.items() if rid in self.engine.seqs}
            known = self.prompts[seq.request_id] = (seq, self.engine.tokenizer.decode(seq.prompt_token_ids))
        return known[1]
