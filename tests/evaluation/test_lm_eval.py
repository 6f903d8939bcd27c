"""lm-evaluation-harness itself against the real server: its `local-completions` model (token-id prompts, lists
of prompts, echo with logprobs and max_tokens 1, stop strings) scores the shipped tasks (tests/evaluation/tasks)
as its `hf` model does on the same weights, both in float32 on the CPU. Offline: the tasks' data ship here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow

TASKS_DIR = REPO / "tests" / "evaluation" / "tasks"
TASKS = ("lmi_multiple_choice", "lmi_capitals")
# Nothing may reach for the Hub: the harness's datasets and transformers read these at import, so they are set
# on the harness's own process
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# log probs of the same float32 weights through two implementations (ours, transformers'): summation order only
LOGLIKELIHOOD_TOLERANCE = 1e-3


def start_harness(out: Path, model: str, model_args: str, *options: str) -> subprocess.Popen:
    """`lm-eval run` on the shipped tasks, 4 requests per batch, started (its output under `out`)."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
               "--tasks", ",".join(TASKS), "--include_path", str(TASKS_DIR), "--batch_size", "4",
               "--output_path", str(out), "--log_samples", *options]
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    out.mkdir(parents=True)
    with open(out / "stderr.log", "w") as log:        # a file, not a pipe: neither run waits on a full pipe
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)


def harness_results(proc: subprocess.Popen, out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """A started harness run's (results by task, logged samples by task), once it exits 0."""
    assert proc.wait(timeout=900) == 0, (out / "stderr.log").read_text()[-4000:]
    (results_file,) = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                      for line in path.read_text().splitlines()] for task in TASKS}
    return json.loads(results_file.read_text())["results"], samples


@pytest.fixture(scope="module")
def harness_runs(fp32_server, model_dir, tmp_path_factory):
    """The harness's hf model on model/ and its local-completions model on the fp32 server, same tasks, the two
    runs side by side (each spends much of its time importing the harness)."""
    out = tmp_path_factory.mktemp("lm_eval")
    hf = start_harness(out / "hf", "hf", f"pretrained={model_dir},dtype=float32", "--device", "cpu")
    ours = start_harness(out / "ours", "local-completions",
                         f"model=model,base_url={fp32_server.url}/v1/completions,tokenizer={model_dir},"
                         "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    try:
        return harness_results(hf, out / "hf"), harness_results(ours, out / "ours")
    finally:
        for proc in (hf, ours):
            proc.kill()
            proc.wait()


def by_doc(samples: list[dict]) -> dict[int, dict]:
    return {sample["doc_id"]: sample for sample in samples}


def test_the_loglikelihood_task_scores_the_same_as_the_harness_hf_model(harness_runs):
    (hf_results, hf_samples), (our_results, our_samples) = harness_runs
    task = "lmi_multiple_choice"
    for metric in ("acc,none", "acc_norm,none"):
        assert our_results[task][metric] == hf_results[task][metric], metric
    hf_docs, our_docs = by_doc(hf_samples[task]), by_doc(our_samples[task])
    assert sorted(our_docs) == sorted(hf_docs) == list(range(20))
    for doc_id, sample in our_docs.items():
        ours = [resp[0] for resp in sample["resps"]]     # per choice [loglikelihood, is_greedy], logged as text
        theirs = [resp[0] for resp in hf_docs[doc_id]["resps"]]
        assert [float(r[0]) for r in ours] == pytest.approx([float(r[0]) for r in theirs],
                                                            abs=LOGLIKELIHOOD_TOLERANCE), doc_id
        assert [r[1] for r in ours] == [r[1] for r in theirs], doc_id
        assert sample["acc"] == hf_docs[doc_id]["acc"], doc_id


def test_the_generation_task_answers_the_same_text_and_score_as_the_harness_hf_model(harness_runs):
    (hf_results, hf_samples), (our_results, our_samples) = harness_runs
    task = "lmi_capitals"
    assert our_results[task]["exact_match,strip"] == hf_results[task]["exact_match,strip"]
    assert our_results[task]["exact_match,strip"] > 0          # the task is one the demo model partly answers
    hf_docs = by_doc(hf_samples[task])
    for doc_id, sample in by_doc(our_samples[task]).items():
        assert sample["resps"] == hf_docs[doc_id]["resps"], doc_id
