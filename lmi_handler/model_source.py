"""Model sources: option.model_id as a local directory or a Hugging Face Hub id, made a local directory once.

Owns the rule that tells the two apart and the Hub download (huggingface_hub.snapshot_download, which reads its
own HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE / HF_TOKEN); the settings that name the model are config/model.py's.
"""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# What a snapshot needs of a repository: configs, safetensors weights, tokenizer files, the chat template.
# Other weight formats (*.bin, *.pth, GGUF, ONNX) that many repositories also hold are never read here.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# Schemes LMI also accepts in model_id that this server does not fetch from
REMOTE_SCHEMES = ("s3://", "gs://", "http://", "https://", "djl://")


class ModelSourceError(ValueError):
    """option.model_id (or option.revision) names no model this server can reach; the message names the option
    (config/ raises it on as its ConfigError)."""


def local_model_dir(model_id: str, model_dir: str | Path) -> Path:
    """Where model_id points on this machine: itself when absolute, else under model_dir (it may not exist)."""
    path = Path(model_id).expanduser()
    return path if path.is_absolute() else Path(model_dir) / path


def is_hub_id(model_id: str) -> bool:
    """model_id has the form of a Hub repository id, `org/name` (huggingface_hub's own rule for each part:
    letters, digits, `-`, `_`, `.`, at most 96 characters, no `--` or `..`). A bare `name` is taken for a
    directory (the default `model` is one): the Hub's few ids without an org redirect to one with it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model_id.startswith((".", "~")) or model_id.count("/") != 1:
        return False
    try:
        validate_repo_id(model_id)
    except HFValidationError:
        return False
    return True


def hub_repo_id(model_id: str, model_dir: str | Path) -> str | None:
    """The Hub repository model_id names, or None when it is a local path (an existing directory wins over a
    Hub id of the same spelling, as in LMI and vLLM; so does any absolute path)."""
    local = local_model_dir(model_id, model_dir)
    if local.exists() or Path(model_id).expanduser().is_absolute() or not is_hub_id(model_id):
        return None
    return model_id


def resolve_model(model_id: str, model_dir: str | Path, revision: str | None = None) -> Path:
    """The local directory of the model option.model_id names: the directory itself, or the Hub repository's
    snapshot (downloaded into the Hub cache, or found there: with HF_HUB_OFFLINE=1, or when the Hub cannot be
    reached, a pre-filled cache serves with no network). `revision`: a branch, tag or commit of a Hub id.

    A local path is returned as it is (loading it reports what is missing there).
    Raises ModelSourceError naming option.model_id (and option.revision where it is at fault): a remote URL, a
    repository or revision that is neither cached nor reachable, a snapshot without config.json.
    """
    if model_id.startswith(REMOTE_SCHEMES):
        raise ModelSourceError(f"option.model_id={model_id!r}: remote URLs are not fetched here; give a local "
                          "directory or a Hugging Face Hub id (org/name)")
    repo_id = hub_repo_id(model_id, model_dir)
    if repo_id is None:
        return local_model_dir(model_id, model_dir)
    path = _download(repo_id, revision, local_model_dir(model_id, model_dir))
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"option.model_id={model_id!r}: the Hub snapshot at {path} has no config.json")
    return path


def _download(repo_id: str, revision: str | None, local: Path) -> Path:
    """snapshot_download of repo_id's HUB_FILES, errors turned into ModelSourceError naming the id."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    shown = f"option.model_id={repo_id!r}" + (f" (option.revision={revision!r})" if revision else "")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise ModelSourceError(f"{shown}: not a directory ({local} does not exist) and not in the Hugging Face cache "
                          f"at {constants.HF_HUB_CACHE} ({offline}); download it there first (e.g. "
                          f"`hf download {repo_id}` with the same HF_HOME), or name a model directory") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"option.revision={revision!r}: no such revision of {repo_id!r} on the Hub") from None
    except GatedRepoError:
        raise ModelSourceError(f"{shown}: the repository is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{shown}: no such repository on the Hub (or it is private: set HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(f"{shown}: the download failed: {exc}") from None
    logger.info("model %s%s: Hub snapshot %s", repo_id, f"@{revision}" if revision else "", path)
    return path
