"""option.model_id as a directory or a Hugging Face Hub id (model_source.py): served from a Hub cache laid out as
huggingface_hub lays it out, with HF_HUB_OFFLINE=1 (no network), and the start-up error of an id it lacks."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lmi_handler.config import Settings
from lmi_handler.model_source import hub_repo_id, is_hub_id, resolve_model
from tests.helpers import REPO, ServerProcess

COMMIT = "3f1c9e0a5b7d2e4f6a8b0c1d2e3f4a5b6c7d8e9f"    # a snapshot's name is its commit's 40 hex digits


def fill_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay `source`'s files out as huggingface_hub's cache holds a downloaded repository, under hf_home/hub:
    blobs/<sha256> (the content), snapshots/<commit>/<name> -> ../../blobs/<sha256> (relative symlinks),
    refs/<ref> (the commit). Returns the snapshot directory."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with its tokenizer (transformers' own classes)."""
    from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_llama(path, tie_word_embeddings=False)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def _offline_env(hf_home: Path) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.mark.parametrize("model_id, hub", [("org/name", True), ("Qwen/Qwen3-0.6B", True), ("model", False),
                                           ("./org/name", False), ("a/b/c", False), ("/abs/org", False),
                                           ("org/na--me", False), ("~/models/x", False)])
def test_a_hub_id_is_org_slash_name_and_anything_else_is_a_path(model_id, hub):
    assert is_hub_id(model_id) is hub


def test_an_existing_directory_wins_over_a_hub_id_of_the_same_spelling(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_repo_id("org/name", tmp_path) is None
    assert resolve_model("org/name", tmp_path) == tmp_path / "org" / "name"
    assert hub_repo_id("org/other", tmp_path) == "org/other"


def test_hf_model_id_names_the_model_when_the_properties_do_not_and_a_hub_id_is_its_served_name(tmp_path):
    settings = Settings.from_properties({"model_dir": str(tmp_path)}, environ={"HF_MODEL_ID": "org/name"})
    assert settings.model_id == "org/name" and settings.served_model_names == ("org/name",)
    given = Settings.from_properties({"model_id": "mine"}, environ={"HF_MODEL_ID": "org/name"})
    assert given.model_id == "mine" and given.served_model_names == ("mine",)


@pytest.mark.slow
def test_a_hub_id_starts_and_serves_from_a_prefilled_hub_cache_with_hf_hub_offline(tiny_model, tmp_path):
    """The Hub id in option.model_id, the cache under HF_HOME, HF_HUB_OFFLINE=1: the real server starts from the
    snapshot, answers /invocations, and serves under the id; option.revision names the snapshot by commit."""
    hf_home = tmp_path / "hf"
    fill_hub_cache(hf_home, "org/tiny-llama", tiny_model)
    options = {"model_id": "org/tiny-llama", "revision": COMMIT, "num_threads": "1", "kv_cache_bytes": str(16 << 20),
               "max_rolling_batch_size": "2"}
    with ServerProcess(options, tmp_path / "server.log", REPO / "serving.properties",
                       env=_offline_env(hf_home)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        answer = http.post("/invocations", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 4,
                                                                                           "details": True}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["details"]["generated_tokens"] == 4
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["org/tiny-llama"]
    assert "snapshots/" + COMMIT in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("model_id, revision, named", [
    ("org/missing", None, "option.model_id='org/missing'"),
    ("org/tiny-llama", "v2", "option.revision='v2'"),
])
def test_a_hub_id_or_revision_missing_from_the_cache_offline_stops_start_up_naming_it(tiny_model, tmp_path, model_id,
                                                                                       revision, named):
    hf_home = tmp_path / "hf"
    fill_hub_cache(hf_home, "org/tiny-llama", tiny_model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update(_offline_env(hf_home), OPTION_MODEL_ID=model_id)
    if revision:
        env["OPTION_REVISION"] = revision
    done = subprocess.run([sys.executable, "-m", "lmi_handler.cli", "serve", "--properties",
                           str(REPO / "serving.properties")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and named in error and "HF_HUB_OFFLINE" in error, error
