"""GenerationParameters: the /invocations `parameters` object: types, defaults, ranges, the greedy rule.

Turns into the engine's trusted SamplingParams; checks needing the model (context length) are the handler's.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from lmi_handler.engine.sequence import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputSpec
from lmi_handler.protocol import decoding, sequences
from lmi_handler.protocol.errors import RequestValidationError, from_pydantic

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
    "length_penalty": "a finite number (beam search: score = sum of log probs / length ** length_penalty)",
    "early_stopping": 'true, false or "never"',
    "min_tokens": "an integer >= 0 and <= max_new_tokens",
    "bad_words": "a list of non-empty strings",
    "allowed_token_ids": "a non-empty list of token ids",
    "logit_bias": "an object mapping token ids to numbers in [-100, 100]",
    "prompt_logprobs": f"an integer in [0, {MAX_TOP_N_TOKENS}]",
    "structured_outputs": "an object with one of json, regex, choice, grammar, json_object",
    "response_format": 'an object {"type": "text" | "json_object" | "json_schema", ...}',
    "grammar": 'an object {"type": "json" | "json_object" | "regex" | "json_schema", "value"}',
    "adapter_id": "a non-empty string (a loaded LoRA adapter's name)",
    "priority": f"an integer in [{INT64_MIN}, {INT64_MAX}] (lower is served first; other than 0 only under "
                "option.scheduling_policy=priority)",
}
RULES["stop"] = RULES["stop_sequences"]
RULES["ignore_eos_token"] = RULES["ignore_eos"]
RULES["min_length"] = RULES["min_tokens"]
RULES["bad_sequences"] = RULES["bad_words"]


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
    length_penalty: float = _finite(default=1.0, description="LMI/transformers beam search: a finished beam "
                                    "scores sum(log probs) / length ** length_penalty")
    early_stopping: bool | Literal["never"] = Field(False, description="LMI/transformers beam search: true "
                                                    "stops at num_beams finished beams; false / \"never\" "
                                                    "go on while a running beam could still win")
    # logits controls (engine/logits_controls.py)
    min_tokens: int = Field(0, ge=0, validation_alias=AliasChoices("min_tokens", "min_length"),
                            description="vLLM (TensorRT-LLM `min_length`): eos and stop ids banned before this")
    bad_words: list[str] | None = Field(None, validation_alias=AliasChoices("bad_words", "bad_sequences"),
                                        description="vLLM (TensorRT-LLM `bad_sequences`): strings never generated")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM: only these token ids may be generated")
    logit_bias: dict[str, float] | None = Field(None, description="OpenAI/vLLM: token id -> bias in [-100, 100] "
                                                "added to its logit")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS,
                                        description="vLLM: log probs of the prompt tokens with k alternatives")
    # structured output (protocol/decoding.py: one constraint per request, whichever field carries it)
    structured_outputs: Any = Field(None, description="vLLM/LMI: exactly one of json, regex, choice, grammar, "
                                    "json_object")
    response_format: Any = Field(None, description="OpenAI/LMI: text, json_object or json_schema")
    grammar: Any = Field(None, description="TGI: {type: json | json_object | regex | json_schema, value}")
    guided_json: Any = Field(None, description="legacy vLLM/LMI: a JSON schema")
    guided_regex: Any = Field(None, description="legacy vLLM/LMI: a regex the whole output matches")
    guided_choice: Any = Field(None, description="legacy vLLM/LMI: the output is exactly one of these strings")
    guided_grammar: Any = Field(None, description="legacy vLLM/LMI: a Lark or EBNF grammar")
    adapter_id: str | None = Field(None, min_length=1, description="TGI: the LoRA adapter that answers "
                                   "(service.py resolves it); None = the base model")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX, description="vLLM: lower is served first under "
                          "option.scheduling_policy=priority; other than 0 is refused under fcfs (service.py)")
    _constraint: tuple[str, StructuredOutputSpec] | None = PrivateAttr(None)
    _logit_bias: tuple[tuple[int, float], ...] = PrivateAttr(())
    _sent: frozenset[str] = PrivateAttr(frozenset())      # the keys as the client spelled them (aliases)

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

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None, info) -> list[int] | None:
        if value is not None and (any(i < 0 for i in value) or (info.field_name == "allowed_token_ids" and not value)):
            raise ValueError("bad token ids")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not w.strip() for w in value):
            raise ValueError("empty bad word")
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
        params._sent = frozenset(given)
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
        if self.min_tokens > self.max_new_tokens and "max_new_tokens" in self.model_fields_set:  # (chat without
            # max_tokens gets the rest of the context later: checked only against a length the client sent)
            name = "min_length" if "min_length" in self._sent else "min_tokens"
            raise RequestValidationError(prefix + name, f"Invalid parameter `{prefix}{name}`: must be <= "
                                         f"max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        self._logit_bias = decoding.logit_bias(self.logit_bias)
        self._constraint = decoding.structured_output(
            {name: getattr(self, name) for name in decoding.CONSTRAINT_FIELDS if getattr(self, name) is not None})
        if self.num_beams > 1:
            self._check_beam_search(prefix)

    def _check_beam_search(self, prefix: str) -> None:
        """num_beams > 1 is transformers' greedy beam search (engine/beam_search.py): it reports once, at its
        end, with the best beam; what it cannot honour is refused, naming the field."""
        if not self.is_greedy():
            name = "do_sample" if self.do_sample else "temperature"
            raise RequestValidationError(prefix + name, f"Invalid parameter `{prefix}{name}`: beam search "
                                         "(num_beams > 1) is deterministic here: send do_sample=false or leave "
                                         "the sampling parameters out")
        conflicts = {"n": self.n > 1 or (self.best_of or 1) > 1, "stop_sequences": bool(self.stop_sequences),
                     "top_n_tokens": self.num_top_tokens > 0}
        for name, given in conflicts.items():
            if given:
                raise RequestValidationError(prefix + name, f"Invalid parameter `{prefix}{name}`: not available "
                                             f"with num_beams > 1 (beam search; got num_beams={self.num_beams})")

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
        finish_reason stays `eos_token`. bad_words stay strings here (service.py turns them into token ids
        with the model's tokenizer). Raises RequestValidationError for n or best_of above 1 on a greedy
        request (see sequences.check_sampled).
        """
        if self.num_beams == 1:
            sequences.check_sampled(self.n, self.best_of, self.is_greedy())
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
            top_n_tokens=self.num_top_tokens,
            prompt_logprobs=self.decoder_input_details or self.prompt_logprobs is not None,
            prompt_top_n_tokens=self.prompt_logprobs or 0,
            logit_bias=self._logit_bias, min_tokens=self.min_tokens,
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids))) if self.allowed_token_ids else None,
            structured_output=self.constraint[1] if self.constraint else None,
            num_beams=self.num_beams, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            priority=self.priority)

    def with_constraint(self, field: str, spec: StructuredOutputSpec) -> "GenerationParameters":
        """A copy constrained to `spec` (tool_choice required / named: the tools' schemas, protocol/tools.py),
        named `field` in errors. Raises RequestValidationError when the request already sent a constraint."""
        if self._constraint is not None:
            sent = self._constraint[0]
            raise RequestValidationError(sent, f"Invalid parameter `{sent}`: one structured-output constraint per "
                                         f"request, and `{field}` already constrains the output (to the tools' "
                                         "schemas)")
        params = self.model_copy()
        params._constraint = (field, spec)
        return params

    @property
    def constraint(self) -> tuple[str, StructuredOutputSpec] | None:
        """(the field it came in, the spec) of the request's structured-output constraint, or None."""
        return self._constraint
