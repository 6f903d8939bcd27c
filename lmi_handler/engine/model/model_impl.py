"""option.model_impl: which implementation runs a checkpoint (our layer description, or transformers' own model
with our paged attention), decided once from config.json, and the start-up refusals of what neither can serve.

Owns the choice (vLLM's `--model-impl` auto | native | transformers; its "vllm" is our "native") and its one-line
refusals: an encoder or encoder-decoder model, a checkpoint whose code ships in its repository
(trust_remote_code) without option.trust_remote_code, a model type transformers' AutoModelForCausalLM does not
know, a pre-quantized checkpoint for the fallback, and option.model_impl=native for a model without a layer
description. Leaves the native families to families.py and the transformers-backed model to fallback.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.encoder import ENCODER_TYPES

MODEL_IMPLS = ("auto", "native", "transformers")


@dataclass(frozen=True)
class ImplChoice:
    """The implementation chosen for one checkpoint, and why (one clause, for the start-up log)."""

    fallback: bool        # True: transformers' model with our paged attention (fallback.py); False: native
    why: str

    @property
    def name(self) -> str:
        return "transformers" if self.fallback else "native"


def choose_impl(cfg: dict, model_impl: str = "auto", trust_remote_code: bool = False) -> ImplChoice:
    """The implementation of the checkpoint whose config.json is `cfg` under option.model_impl.

    auto: native where families.py has the model_type, else the transformers fallback; native: the layer
    description only; transformers: the fallback for any model (a native family included: a way to check one
    against the other). Raises ConfigError (one line naming the model type and what is supported) for an
    encoder, a model transformers cannot build without remote code when option.trust_remote_code is off, a
    model type no AutoModelForCausalLM knows, or native without a family row.
    """
    from lmi_handler.engine.model.families import FAMILIES
    from lmi_handler.engine.model.vision import vision_model_types

    model_impl = (model_impl or "auto").strip().lower()
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"option.model_impl={model_impl!r}: must be one of {list(MODEL_IMPLS)}")
    model_type = cfg.get("model_type", "llama")
    native = sorted(FAMILIES)
    _refuse_encoder(cfg, model_type, native)
    if model_impl != "transformers" and (model_type in FAMILIES or model_type in vision_model_types()):
        return ImplChoice(False, f"model_type={model_type} has a layer description (option.model_impl={model_impl})")
    if model_impl == "native":
        raise ConfigError(f"config.json model_type={model_type!r} has no native implementation "
                          f"(option.model_impl=native); native: {native}; option.model_impl=auto or transformers "
                          "serves other decoder-only models through transformers")
    _refuse_unknown(cfg, model_type, native, trust_remote_code)
    if quant := cfg.get("quantization_config"):
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ConfigError(f"config.json model_type={model_type!r} with quantization_config (quant_method={method!r}): "
                          "pre-quantized checkpoints are not served, natively nor through transformers; serve the "
                          "unquantized checkpoint")
    if model_impl == "transformers":
        return ImplChoice(True, "option.model_impl=transformers")
    return ImplChoice(True, f"model_type={model_type} has no layer description (native: {', '.join(native)})")


def _refuse_encoder(cfg: dict, model_type: str, native: list[str]) -> None:
    """An encoder (transformers' masked-LM families: BERT, RoBERTa, XLM-R, ModernBERT, ...) or an
    encoder-decoder (T5, BART) cannot generate text here. Raises ConfigError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if cfg.get("is_encoder_decoder"):
        kind = "an encoder-decoder model"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not cfg.get("is_decoder"):
        kind = "an encoder-only model"
    else:
        return
    pooling = ""
    if model_type in ENCODER_TYPES:
        pooling = (f"; option.task=text-embedding, rerank or classification serves the encoders {list(ENCODER_TYPES)} "
                   "(docs/embeddings.md)")
    raise ConfigError(f"config.json model_type={model_type!r} is {kind}: text generation serves decoder-only "
                      f"models (natively: {', '.join(native)}; any other decoder-only model_type of transformers' "
                      f"AutoModelForCausalLM through option.model_impl=auto or transformers){pooling}")


def _refuse_unknown(cfg: dict, model_type: str, native: list[str], trust_remote_code: bool) -> None:
    """A model type transformers builds only with the checkpoint's own code (auto_map), unless
    option.trust_remote_code; one no AutoModelForCausalLM knows at all. Raises ConfigError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    remote = (cfg.get("auto_map") or {}).get("AutoModelForCausalLM")
    if remote and not trust_remote_code:
        raise ConfigError(f"config.json model_type={model_type!r} needs trust_remote_code (its modelling code "
                          f"{remote!r} ships in the checkpoint): set option.trust_remote_code=true to run that code, "
                          f"or serve a supported model (natively: {', '.join(native)}; or any decoder-only "
                          "model_type of transformers' AutoModelForCausalLM)")
    if not remote:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported: neither natively "
                          f"({', '.join(native)}) nor by transformers' AutoModelForCausalLM (and config.json has no "
                          "auto_map for trust_remote_code)")
