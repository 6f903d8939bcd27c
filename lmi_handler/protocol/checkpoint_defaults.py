"""The checkpoint's sampling defaults (generation_config.json) and the one rule that lets them fill a request's gaps.

Owns reading and checking the file's sampling values and deciding, by the request's kind, which of them stand in
for what a request leaves out; parsing a request is params.py's and openai.py's, option.generation_config config/'s.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.params import GenerationParameters
from lmi_handler.protocol.plan import Kind

logger = logging.getLogger(__name__)

# The generation_config.json keys read (vLLM's list, less max_new_tokens: LMI's schema fixes its own 30).
# Their names and ranges are GenerationParameters'. do_sample is not read, as in vLLM.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Kinds that take vLLM's rule: every value the request leaves out, whether or not it samples (OpenAI's schema,
# which LMI's chat form shares). The others (LMI text, dynamic lists, TGI, batch lines) keep their own schema's
# greedy default (DESIGN §3, §4) and take the checkpoint's values only when the request itself samples.
OPENAI_RULE_KINDS = (Kind.OPENAI_CHAT, Kind.OPENAI_COMPLETION, Kind.LMI_CHAT)


@dataclass(frozen=True)
class CheckpointDefaults:
    """The sampling values a checkpoint's generation_config.json recommends, checked against the request
    schema's ranges ({} when there is none, or option.generation_config=vllm)."""

    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, model_path: str | Path, mode: str = "auto") -> "CheckpointDefaults":
        """The defaults of the checkpoint at model_path; mode is option.generation_config (auto | vllm).
        A value the request schema would refuse is left out with a warning naming it; the file's other
        keys (eos ids: the engine's; do_sample, max_new_tokens) are not read here."""
        path = Path(model_path) / "generation_config.json"
        if mode == "vllm" or not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.warning("%s is not readable JSON (%s): no sampling defaults from it", path, exc)
            return cls()
        values = {key: value for key in SAMPLING_KEYS
                  if isinstance(data, dict) and (value := _checked(path, key, data.get(key))) is not None}
        if values:
            shown = ", ".join(f"{key}={value}" for key, value in values.items())
            logger.warning("sampling defaults from %s: %s. They stand in for values a request leaves out "
                           "(docs/model-sources.md); option.generation_config=vllm turns this off", path, shown)
        return cls(values)

    def apply(self, params: GenerationParameters, kind: Kind) -> GenerationParameters:
        """params with the checkpoint's values in place of those the request did not send.

        OpenAI routes and LMI chat (OPENAI_RULE_KINDS): every such value, as vLLM does (a checkpoint temperature
        turns the routes' default sampling at 1.0 into sampling at it). LMI text, dynamic lists, TGI and batch
        lines: only when the request samples (GenerationParameters.is_greedy, decided by what it sent): their
        schemas' default is greedy with repetition_penalty 1.0, and a checkpoint never changes a greedy answer.
        Beam search (num_beams > 1) takes none: it is deterministic and ignores sampling values.
        """
        if not self.values or params.num_beams > 1:
            return params
        if kind not in OPENAI_RULE_KINDS and params.is_greedy():
            return params
        missing = {key: value for key, value in self.values.items() if key not in params.model_fields_set}
        return params.model_copy(update=missing) if missing else params


def _checked(path: Path, key: str, value: Any) -> Any:
    """value as GenerationParameters stores it (top_k -1 -> 0), or None (absent, null, or refused: warned)."""
    if value is None:
        return None
    try:
        return getattr(GenerationParameters.parse({key: value}), key)
    except RequestValidationError as exc:
        logger.warning("%s: %s=%r is not used as a default (%s)", path, key, value, exc.message)
        return None
