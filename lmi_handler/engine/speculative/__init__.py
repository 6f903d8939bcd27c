"""Speculative decoding that changes nothing but the speed: proposers draft, the target verifies in its own step.

Owns building the engine's Speculator from option.speculative_config (or speculative_draft_model), with the
start-up checks of a draft model (same tokenizer and vocabulary as the target); the parts are ngram.py and
draft.py (proposers), speculator.py (who drafts, settling, counts) and verify.py (the verify rows). A row
verifying k drafts is k + 1 query positions of the step (the model runner's chunk rows), sampled position by
position exactly as the plain decode would sample them; docs/speculative.md.
"""
from __future__ import annotations

from pathlib import Path

from lmi_handler.config import ConfigError, EngineConfig
from lmi_handler.engine.speculative.ngram import NgramProposer
from lmi_handler.engine.speculative.speculator import SpecDecodeStats, Speculator
from lmi_handler.engine.speculative.verify import VerifyRows, expand_rows, gather_logits

__all__ = ["SpecDecodeStats", "Speculator", "VerifyRows", "build_speculator", "expand_rows", "gather_logits"]


def build_speculator(config: EngineConfig, runner, tokenizer, max_model_len: int) -> Speculator | None:
    """The engine's Speculator for config.speculative (None when off). A draft model is loaded here, beside
    the target (`runner`: its dtype, device, block size and number of KV blocks). Raises ConfigError for a
    draft that is missing or does not share the target's tokenizer and vocabulary."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from lmi_handler.engine.speculative.draft import DraftModelProposer

        check_draft(spec.draft_model, config.model_path, runner.config.vocab_size, tokenizer)
        proposer = DraftModelProposer.load(spec.draft_model, runner, config)
    return Speculator(spec, proposer, max_model_len)


def check_draft(draft: Path, target: Path, target_vocab_size: int, tokenizer) -> None:
    """Refuse a draft checkpoint that is not there, or whose vocabulary or tokenizer differs from the target's
    (its drafted ids would mean other tokens). Raises ConfigError naming both checkpoints."""
    from transformers import AutoTokenizer

    from lmi_handler.engine.model_runner import read_model_config

    where = f"the speculative draft model {draft}"
    if not (Path(draft) / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json (option.speculative_config `model` / "
                          "option.speculative_draft_model: a checkpoint directory)")
    if Path(draft).resolve() == Path(target).resolve():
        return                                                  # the target drafting for itself
    vocab_size = read_model_config(draft).vocab_size
    if vocab_size != target_vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {vocab_size} ids, the target {target} {target_vocab_size}: "
                          "a draft must share the target's tokenizer and vocabulary")
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(draft))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where} has no tokenizer to compare with the target {target}'s: {exc}") from None
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{where} has another tokenizer than the target {target}: a draft must share the "
                          "target's tokenizer and vocabulary")
