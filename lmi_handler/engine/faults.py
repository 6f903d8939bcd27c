"""Faults inside an engine step: isolate them to the sequences they hit, tell a dead engine, inject them for tests.

Owns StepGuard (one engine step; a failure ends only the sequences it can be pinned to, and it decides
whether the engine can still generate at all: the state is engine/health.py's) and the fault-injection
switch (`option.fault_injection`). The engine itself is unchanged: the guard drives Engine.step / Engine.abort
and parks sequences through the scheduler's own `park` / `restore`. What a dead engine means to clients
(503s, exiting for the supervisor) is the front end's.

Rules of isolation (issue 8, "Faults"):
1. A `SequenceFault` names the sequences it hit: those are aborted (KV blocks freed), the rest go on.
2. Any other exception cannot be pinned: the step is retried without the sequences this step newly
   admitted; if that works, each of those newest admissions is stepped alone and the ones that fail
   alone are failed (all of them if none does).
3. Else each running sequence is stepped alone; the ones that fail alone are failed. If none does (the
   fault needs the whole batch), the newest running sequence is failed. Never the whole batch.

Rules of health (issue 15): the engine is dead, for good, when
4. an exception is one no later step recovers from (`fatal_reason`: a CUDA error such as an illegal memory
   access or a device-side assert, which CUDA makes sticky; a torch.distributed error, i.e. a
   tensor-parallel rank gone), wherever in the step or its isolation it is raised; or
5. no step worked during isolation (every sequence failed, even alone) and a probe, a one-token sequence
   of the guard's own stepped with the batch emptied, fails too: the fault persists without any of the
   requests, so it is not theirs.
   An `EngineFatal` error (health.py: e.g. a tensor-parallel rank died, parallel/executor.RankFailed) is
   rule 4 by definition: nothing is isolated.
A fault that names its sequences (1), or stops when they are removed (2, 3, or a probe that works), stays
per-request. Requests refused before the engine (client errors, a full queue) never reach the guard.
"""
from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

from lmi_handler.engine.health import EngineDead, EngineFatal, EngineHealth, fatal_reason
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

PROBE_ID_PREFIX = "health-probe-"   # rule 5's own one-token sequences (the fault injector never picks them)


class SequenceFault(RuntimeError):
    """An error inside a step that knows which sequences it hit (engine request ids)."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = list(request_ids)


def failure_message(exc: BaseException) -> str:
    """The error text a failed request's client sees (its stream's last line, or the error body)."""
    return f"internal error during generation: {type(exc).__name__}: {exc}"


class StepGuard:
    """Runs Engine.step(); on an exception ends only the sequences the fault is pinned to, unless the
    engine is dead (module rules).

    `step()` returns (outputs, failed): the step's RequestOutputs and {engine request id: error message}
    of the sequences it ended (already aborted, their blocks freed). Raises EngineDead once the engine is
    dead (every sequence aborted; the caller fails every request in flight), then on every later call;
    raises the error itself if isolation fails in a way that is not fatal.
    """

    def __init__(self, engine, health: EngineHealth | None = None):
        self.engine = engine
        self.health = health or EngineHealth()
        self._steps_ok = 0      # steps that worked during the current isolation

    def step(self) -> tuple[list[RequestOutput], dict[str, str]]:
        self.health.check()
        try:
            return self._guarded_step()
        except EngineDead:
            self._drop_all()
            raise
        except Exception as exc:  # isolation itself failed: dead if fatal, else the caller's
            reason = fatal_reason(exc)
            if reason is None:
                raise
            self._drop_all()
            raise self.health.mark_dead(reason) from exc

    def _guarded_step(self) -> tuple[list[RequestOutput], dict[str, str]]:
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
            return self._isolate_or_die(fault, running_before, computed)
        except Exception as exc:  # any bug in a step is isolated; only a dead engine is fatal
            logger.exception("engine step failed; isolating the sequences it hit")
            self._restore(computed)
            return self._isolate_or_die(exc, running_before, computed)

    def check_failure(self, exc: BaseException) -> None:
        """After a failure outside step() (a dynamic batch's whole generate call): raise EngineDead if the
        engine is dead (rule 4, or rule 5's probe fails); else return, and the caller fails what it ran."""
        self.health.check()
        try:
            self._die_if_fatal(exc)
            self._die_if_probe_fails(exc)
        except EngineDead:
            self._drop_all()
            raise

    # ---- health --------------------------------------------------------------------------------

    def _isolate_or_die(self, exc: BaseException, running_before: set[str],
                        computed: dict[int, tuple[Sequence, int]]) -> tuple[list[RequestOutput], dict[str, str]]:
        self._die_if_fatal(exc)
        self._steps_ok = 0
        result = self._isolate(exc, running_before, computed)
        if self._steps_ok == 0:       # every sequence failed, even alone: is the fault theirs at all?
            self._die_if_probe_fails(exc)
        return result

    def _die_if_fatal(self, exc: BaseException) -> None:
        reason = fatal_reason(exc)
        if reason is not None:
            self._die(reason)

    def _die_if_probe_fails(self, exc: BaseException) -> None:
        probe_error = self._probe()
        if probe_error is not None:
            self._die(f"every step fails, even with the batch emptied ({type(exc).__name__}: {exc}; a one-token "
                      f"probe step failed with {type(probe_error).__name__}: {probe_error})")

    def _probe(self) -> BaseException | None:
        """Step a one-token sequence of our own with every other sequence set aside; the error if it fails.

        None also when the probe could not be scheduled (no free KV block): inconclusive counts as alive.
        """
        engine = self.engine
        probe_id = f"{PROBE_ID_PREFIX}{uuid.uuid4().hex}"
        with self._parked(list(engine.scheduler.running)):
            try:
                engine.add_request(probe_id, [engine.eos_token_ids[0]], SamplingParams(max_new_tokens=1))
                engine.step()
                return None
            except Exception as exc:  # noqa: BLE001 - the probe's failure is the verdict
                self._die_if_fatal(exc)
                return exc
            finally:
                engine.abort(probe_id)

    def _die(self, reason: str) -> None:
        """Mark the engine dead and raise EngineDead; the public entry points then drop every sequence
        (outside any parked state), and their clients get the death as their error."""
        raise self.health.mark_dead(reason)

    def _drop_all(self) -> None:
        try:
            self.engine.abort_all()
        except Exception:  # bookkeeping on a dead engine; the death is what matters
            logger.exception("dropping the sequences of a dead engine failed")

    # ---- isolation -----------------------------------------------------------------------------

    def _isolate(self, exc: BaseException, running_before: set[str],
                 computed: dict[int, tuple[Sequence, int]]) -> tuple[list[RequestOutput], dict[str, str]]:
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

    def _try_without(self, parked: list[Sequence], computed: dict[int, tuple[Sequence, int]]) -> list[RequestOutput] | None:
        """One step with `parked` (and every waiting sequence) set aside; None (state restored) if it fails.

        A fatal error (rule 4) ends the isolation: the engine is dead (raises EngineDead)."""
        with self._parked(parked):
            if not self.engine.scheduler.running:   # nothing left to step: proves nothing (rule 5 counts steps)
                return []
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the caller decides who failed
                self._restore(computed)
                self._die_if_fatal(exc)
                return None
        self._steps_ok += 1
        return outputs

    @contextmanager
    def _parked(self, seqs: list[Sequence]) -> Iterator[None]:
        """Take `seqs` out of the running queue and hold the waiting queue back; both come back after."""
        scheduler = self.engine.scheduler
        parked = scheduler.park(seqs)
        try:
            yield
        finally:
            scheduler.restore(parked)

    def _fail(self, request_ids: list[str], message: str) -> dict[str, str]:
        for request_id in request_ids:
            self.engine.abort(request_id)   # leaves both queues, frees its KV blocks
        return {request_id: message for request_id in request_ids}

    def _snapshot(self) -> dict[int, tuple[Sequence, int]]:
        """Every queued sequence's computed count, by identity (a beam search's beams share a request id)."""
        scheduler = self.engine.scheduler
        return {id(seq): (seq, seq.num_computed_tokens) for seq in list(scheduler.running) + list(scheduler.waiting)}

    def _restore(self, computed: dict[int, tuple[Sequence, int]]) -> None:
        """Undo a failed step's progress: tokens it claimed to compute are computed again next time.

        Only running sequences with blocks keep a count; one preempted meanwhile restarts from 0 anyway.
        """
        for seq, num_computed in computed.values():
            if seq.status is SequenceStatus.RUNNING and seq.block_table:
                seq.num_computed_tokens = min(num_computed, seq.num_computed_tokens)


# ---- fault injection (tests) --------------------------------------------------------------------

FAULT_RULE_HELP = ("option.fault_injection: rules separated by ';', each [KIND:]STAGE@TARGET with KIND 'pinned' "
                   "(the error names the sequence), 'broken' (from then on every step fails: the engine is broken "
                   "for good) or 'cuda' (as broken, raising CUDA's sticky illegal-memory-access error), STAGE "
                   "'prefill' or 'decode:N' (N >= 1: the step computing output token N+1) and TARGET "
                   "'id=<request id>' or a text the prompt contains, e.g. 'decode:4@Water is', 'broken:prefill@Zebras'")

FaultKind = Literal["plain", "pinned", "broken", "cuda"]
FAULT_KINDS: tuple[str, ...] = ("pinned", "broken", "cuda")   # the prefixes; none = plain

# The text torch raises after an illegal memory access (CUDA keeps the context in this state for good).
INJECTED_CUDA_ERROR = ("CUDA error: an illegal memory access was encountered (injected by option.fault_injection)")


class InjectedFault(RuntimeError):
    """The error the fault-injection switch raises (unpinned: the guard must find its sequence)."""


@dataclass(frozen=True)
class FaultRule:
    """One fault-injection rule: which sequences fail, at which stage, and how (see FAULT_RULE_HELP)."""

    stage: Literal["prefill", "decode"]
    decode_step: int | None = None
    marker: str | None = None          # a substring of the prompt text
    request_id: str | None = None      # an engine request id (n / best_of members: "<id>#j" match too)
    kind: FaultKind = "plain"

    @property
    def pinned(self) -> bool:
        """Raise a SequenceFault naming the sequence, not a plain error."""
        return self.kind == "pinned"

    @property
    def breaks_engine(self) -> bool:
        """From the moment it hits, every step fails (whatever it holds), as on a dead device."""
        return self.kind in ("broken", "cuda")

    @classmethod
    def parse_all(cls, text: str) -> list["FaultRule"]:
        """Parse `option.fault_injection`. Raises ValueError (with FAULT_RULE_HELP) for a malformed rule."""
        return [cls.parse(part) for part in text.split(";") if part.strip()]

    @classmethod
    def parse(cls, text: str) -> "FaultRule":
        spec, sep, target = text.strip().partition("@")
        kind, colon, rest = spec.partition(":")
        if colon and kind in FAULT_KINDS:
            spec = rest
        else:
            kind = "plain"
        stage, _, step = spec.partition(":")
        if not sep or not target or stage not in ("prefill", "decode") or (stage == "decode") != step.isdigit() \
                or (step and int(step) < 1):
            raise ValueError(f"bad fault rule {text!r}; {FAULT_RULE_HELP}")
        request_id = target[len("id="):] if target.startswith("id=") else None
        return cls(stage, int(step) if step else None, None if request_id else target, request_id, kind)  # type: ignore[arg-type]

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

    One of the scheduler's `fault_hooks`: right after scheduling (blocks reserved, before the
    forward pass) it raises InjectedFault (or SequenceFault for pinned rules) when a scheduled sequence
    matches, so the error surfaces inside Engine.step as a model failure would. Once a `broken` or `cuda`
    rule has hit, every step that schedules anything raises (`broken_by` says which request broke it).
    """

    def __init__(self, engine, rules: list[FaultRule]):
        self.engine = engine
        self.rules = rules
        self.prompts: dict[str, tuple[Sequence, str]] = {}   # request id -> (its sequence, prompt text)
        self.broken_by: tuple[FaultRule, str] | None = None  # (the rule, its request id) once broken
        engine.scheduler.fault_hooks.append(self._check)

    def _check(self, out: SchedulerOutput) -> None:
        for seq in out.seqs:
            if seq.request_id.startswith(PROBE_ID_PREFIX):   # the guard's probe is nobody's request
                continue
            for rule in self.rules:
                if self.broken_by is None and rule.hits(seq, self._prompt_text(seq)):
                    if rule.breaks_engine:
                        self.broken_by = (rule, seq.request_id)
                        break
                    message = f"injected fault ({rule.stage}) for request {seq.request_id}"
                    if rule.pinned:
                        raise SequenceFault(message, [seq.request_id])
                    raise InjectedFault(message)
        if self.broken_by is not None and out.seqs:
            rule, request_id = self.broken_by
            if rule.kind == "cuda":
                raise RuntimeError(INJECTED_CUDA_ERROR)
            raise InjectedFault(f"injected fault: the engine is broken for good (since request {request_id}'s "
                                f"{rule.stage})")

    def _prompt_text(self, seq: Sequence) -> str:
        known = self.prompts.get(seq.request_id)
        if known is None or known[0] is not seq:   # ids may come back (client-chosen x-request-id)
            if len(self.prompts) > 4096:
                self.prompts = {rid: pair for rid, pair in self.prompts.items() if rid in self.engine.seqs}
            known = self.prompts[seq.request_id] = (seq, self.engine.tokenizer.decode(seq.prompt_token_ids))
        return known[1]
