"""GenerationParameters: the /invocations `parameters` object: types, defaults, ranges, the greedy rule.

Turns into the engine's trusted SamplingParams; checks needing the model (context length) are the handler's.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmi_handler.engine.sequence import INT64_MAX, INT64_MIN, SamplingParams
from lmi_handler.protocol import sequences
from lmi_handler.protocol.errors import RequestValidationError, from_pydantic, show_value

logger = logging.getLogger(__name__)

# OpenAI `top_logprobs` is 0..20 and vLLM's default max_logprobs is 20: one bound for both APIs.
MAX_TOP_N_TOKENS = 20
# Ours: TGI's default --max-stop-sequences is 4 and OpenAI allows 4; LMI has none. 16 keeps LMI
# clients with a few more working while bounding the per-step stop-string work.
MAX_STOP_SEQUENCES = 16
MAX_TOP_K = (1 << 31) - 1  # beyond any vocabulary; keeps the engine's int64 tensors safe
# vLLM's _SAMPLING_EPS: a temperature below this is greedy (logits / 1e-40 overflow float32).
GREEDY_TEMPERATURE = 1e-5

# The allowed values in words, for error messages (type and range errors read the same).
RULES: dict[str, str] = {
    "do_sample": "true or false",
    "seed": f"an integer in [{INT64_MIN}, {INT64_MAX}]",
    "temperature": "a number >= 0 (below 1e-5 = greedy)",
    "repetition_penalty": "a number > 0 (1.0 = off)",
    "top_k": "an integer in [-1, 2147483647] (0 or -1 = off)",
    "top_p": "a number in (0, 1] (1.0 = off)",
    "max_new_tokens": "an integer >= 1",
    "details": "true or false",
    "return_full_text": "true or false",
    "stop_sequences": f"a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
    "decoder_input_details": "true or false",
    "min_p": "a number in [0, 1] (0 = off)",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "ignore_eos": "true or false",
    "stop_token_ids": "a list of integers >= 0",
    "include_stop_str_in_output": "true or false",
    "logprobs": f"an integer in [0, {MAX_TOP_N_TOKENS}]",
    "top_n_tokens": f"an integer in [0, {MAX_TOP_N_TOKENS}]",
    "skip_special_tokens": "true or false",
    "typical_p": "a number in (0, 1] (1.0 = off)",
    "truncate": "an integer >= 1 (prompt tokens kept, from the end)",
    "n": "an integer >= 1",
    "best_of": "an integer >= 1 and >= n",
    "num_beams": "an integer >= 1",
}
RULES["stop"] = RULES["stop_sequences"]
RULES["ignore_eos_token"] = RULES["ignore_eos"]


def _finite(**kw: Any) -> Any:
    return Field(allow_inf_nan=False, **kw)


class GenerationParameters(BaseModel):
    """LMI schema GenerationParameters plus the vLLM/TGI extras LMI users send (DESIGN §3).

    Strict JSON types: booleans are true/false only, integers reject 1.5 and "3", numbers
    accept integers. JSON null means "not given". Unknown keys are ignored with a warning (LMI).
    """

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True, frozen=True)

    do_sample: bool | None = Field(None, description="LMI: sample instead of greedy; None = not given "
                                   "(LMI >= 0.32 infers it from the sampling parameters, see is_greedy)")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="LMI: sampling seed, any int64 (negative allowed); None = random")
    temperature: float = _finite(default=1.0, ge=0.0, description="LMI: softmax temperature, >= 0; 0 = greedy")
    repetition_penalty: float = _finite(default=1.0, gt=0.0,
                                               description="LMI/vLLM: > 0; 1.0 = off; > 1 discourages repeats")
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="LMI: keep the k most likely tokens, >= 0; 0 = off "
                       "(vLLM's -1 = off is accepted and stored as 0); at most 2^31 - 1")
    top_p: float = _finite(default=1.0, gt=0.0, le=1.0, description="LMI: nucleus mass in (0, 1]; 1.0 = off")
    max_new_tokens: int = Field(30, ge=1, description="LMI: generated tokens at most, >= 1 (default 30); "
                                "the handler checks it against the model context")
    details: bool = Field(False, description="LMI: return `details` (finish_reason, tokens, ...)")
    return_full_text: bool = Field(False, description="LMI: prepend the prompt to generated_text")
    stop_sequences: list[str] | str | None = Field(
        None, validation_alias=AliasChoices("stop_sequences", "stop"),
        description=f"LMI (alias TGI/vLLM `stop`): up to {MAX_STOP_SEQUENCES} non-empty strings that end "
                    "generation; a single string is one stop sequence")
    decoder_input_details: bool = Field(False, description="LMI/TGI: return the prompt tokens with log probs "
                                        "(details.prefill)")
    min_p: float = _finite(default=0.0, ge=0.0, le=1.0,
                                  description="vLLM: drop tokens below min_p x the top probability, [0, 1]; 0 = off")
    presence_penalty: float = _finite(default=0.0, ge=-2.0, le=2.0, description="vLLM/OpenAI: [-2, 2]")
    frequency_penalty: float = _finite(default=0.0, ge=-2.0, le=2.0, description="vLLM/OpenAI: [-2, 2]")
    ignore_eos: bool = Field(False, validation_alias=AliasChoices("ignore_eos", "ignore_eos_token"),
                             description="vLLM (LMI alias ignore_eos_token): keep generating past eos")
    stop_token_ids: list[int] | None = Field(None, description="vLLM: token ids that end generation (>= 0)")
    include_stop_str_in_output: bool = Field(False, description="vLLM: keep the matched stop string in the text")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS,
                                 description="LMI vLLM: alternatives per token, [0, 20]; used when top_n_tokens "
                                             "is not given")
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS,
                                     description="TGI: alternatives returned per generated token, [0, 20]")
    skip_special_tokens: bool = Field(True, description="vLLM: leave special tokens out of the text")
    typical_p: float = _finite(default=1.0, gt=0.0, le=1.0,
                                      description="TGI/HF: locally typical mass in (0, 1]; 1.0 = off")
    truncate: int | None = Field(None, ge=1, description="TGI: keep only the last `truncate` prompt tokens")
    n: int = Field(1, ge=1, description="vLLM/OpenAI: sequences returned, >= 1")
    best_of: int | None = Field(None, ge=1, description="vLLM/TGI: sequences generated, >= n")
    num_beams: int = Field(1, ge=1, description="LMI vLLM: beam width, >= 1 (1 = no beam search)")

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return 0 if value == -1 else value  # vLLM: -1 = off; LMI: 0 = off

    @field_validator("stop_sequences")
    @classmethod
    def _stop_list(cls, value: list[str] | str | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES or any(s == "" for s in stops):
            raise ValueError("bad stop sequences")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError("negative token id")
        return value

    # ---- parsing --------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: dict | None, prefix: str = "") -> "GenerationParameters":
        """Validate a `parameters` object. None or {} gives the LMI defaults.

        `prefix` is prepended to field names in error messages (e.g. "parameters.").
        Raises RequestValidationError (status 400) for the first bad field.
        """
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise RequestValidationError.out_of_range(prefix.rstrip(".") or "parameters", data, "a JSON object")
        given = {key: value for key, value in data.items() if value is not None}
        cls._warn_unknown(given)
        try:
            params = cls.model_validate(given)
        except ValidationError as exc:
            raise from_pydantic(exc, RULES, prefix) from None
        params._check_cross_fields(prefix)
        return params

    @classmethod
    def known_names(cls) -> set[str]:
        names = set(cls.model_fields)
        for info in cls.model_fields.values():
            if isinstance(info.validation_alias, AliasChoices):
                names.update(str(choice) for choice in info.validation_alias.choices)
        return names

    @classmethod
    def _warn_unknown(cls, given: dict) -> None:
        unknown = sorted(set(given) - cls.known_names())
        if unknown:
            logger.warning("ignoring unknown generation parameters: %s", ", ".join(unknown))

    def _check_cross_fields(self, prefix: str) -> None:
        if self.best_of is not None and self.best_of < self.n:
            raise RequestValidationError(
                prefix + "best_of", f"Invalid parameter `{prefix}best_of`: must be >= n ({self.n}), got {self.best_of}")

    # ---- meaning --------------------------------------------------------------------------

    def is_greedy(self) -> bool:
        """LMI >= 0.32 rule (djl-serving#1645, #2676; case C12).

        An explicit do_sample=false, or temperature 0 (below GREEDY_TEMPERATURE, vLLM's epsilon:
        dividing logits by less would overflow to inf), means greedy. Otherwise do_sample=true or
        any sampling parameter given with an active value (temperature given at all, top_k > 0,
        top_p < 1, min_p > 0, typical_p < 1) means sampling. Nothing given means greedy (LMI default).
        """
        given = self.model_fields_set
        if self.do_sample is False or ("temperature" in given and self.temperature < GREEDY_TEMPERATURE):
            return True
        if self.do_sample:
            return False
        return not ("temperature" in given or self.top_k > 0 or self.top_p < 1.0
                    or self.min_p > 0.0 or self.typical_p < 1.0)

    def wants_details(self, tgi_compat: bool = False) -> bool:
        """`details` as given; when not given, on under tgi_compat (LMI output formatter default)."""
        return self.details if "details" in self.model_fields_set else tgi_compat

    @property
    def num_top_tokens(self) -> int:
        """Alternatives per token: top_n_tokens (TGI), else logprobs (LMI vLLM), else 0."""
        if self.top_n_tokens is not None:
            return self.top_n_tokens
        return self.logprobs or 0

    def to_sampling_params(self) -> SamplingParams:
        """The engine's trusted knobs for this request.

        The model's eos ids are not copied into stop_token_ids: the engine checks eos itself so that
        finish_reason stays `eos_token`. Raises RequestValidationError for num_beams above 1 (no beam search), and for n or
        best_of above 1 on a greedy request (see _check_single_sequence).
        """
        self._check_single_sequence()
        return SamplingParams(
            greedy=self.is_greedy(),
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, typical_p=self.typical_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, max_new_tokens=self.max_new_tokens,
            stop_sequences=tuple(self.stop_sequences or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            top_n_tokens=self.num_top_tokens, prompt_logprobs=self.decoder_input_details)

    def _check_single_sequence(self) -> None:
        """num_beams > 1 is refused (no beam search yet); n/best_of > 1 need sampling (sequences.check_sampled)."""
        if self.num_beams > 1:
            raise RequestValidationError(
                "num_beams", f"Invalid parameter `num_beams`: beam search is not supported, so num_beams "
                             f"must be 1, got {show_value(self.num_beams)}")
        sequences.check_sampled(self.n, self.best_of, self.is_greedy())
