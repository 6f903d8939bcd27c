#!/usr/bin/env bash
# GPU check (issue 38, item 6): on a CUDA machine, within a budget of about 8 minutes, the engine on
# option.kernel_backend=triton (auto picks it on CUDA), the most telling steps first:
#   1. the Triton kernels' tests compiled, bitwise ones, CUDA-graph replay and gpu_memory_utilization among them,
#      and the kernels' timings against torch (benchmarks/gpu_kernels_check.py)            KERNELS_TIMEOUT 150
#   2. the 64 x 128 MT-bench workload in bf16 with a GPU user's defaults (decode steps as CUDA graphs, the KV
#      cache sized by option.gpu_memory_utilization=0.9), batch-1 decode, transformers' generate() (static batch
#      of 64) as the same-run peer and the bf16 matmul ceiling (benchmarks/bench.py)       BENCH_TIMEOUT 150
#   3. the same offline workload with option.enforce_eager=true (no graphs)                EAGER_TIMEOUT 70
#   4. LoRA: 64 requests over 4 adapters against the same 64 on the base, bf16
#      (benchmarks/ab.py lora; its line goes to gpu-bench.log)                             LORA_TIMEOUT 60
#   5. the engine's batch-invariance tests                                                 INVARIANCE_TIMEOUT 80
#   6. tensor parallelism across the visible GPUs, when there are two or more              60
#   7. the summary, with the GPU's read bandwidth (gpu_kernels_check.py --summary)         60, outside the budget
#   8. a C++ kernel's bad-shape refusal test alone (it crashed the 2026-12-04 image)       60
#      then the rest of the engine's tests with the time left                              TESTS_TIMEOUT 200
# Each step's timeout (the variable named, else the default) is cut to what is left of BUDGET_S (470 s); the
# last steps get what the first ones leave. vLLM's CPU build is not a GPU peer, so its phases are skipped.
# PROFILE=1 adds a cProfile of 64 sequences x 32 tokens before step 8 (PROFILE_TIMEOUT 90, outside the budget).
#
# Usage, from any folder:
#   bash benchmarks/gpu_check.sh            # on the CUDA machine; refuses (exit 2) without CUDA or a package
#   bash benchmarks/gpu_check.sh --prepare  # HERE, with network: fill .gpu-carry/ for a bare device machine
#   bash benchmarks/gpu_check.sh --help     # this text
# PYTHON picks the interpreter (default .venv/bin/python where there is one, else python3).
# Results go to $OUT when set (the device tool's folder), else to benchmarks/results/gpu-check/ (ignored by
# git; a run worth keeping goes to benchmarks/measurements/, as gpu-check-2026-12-04-h200/ did).
#
# Writes gpu-<UTC date>.json with device, offline_tok_s_invariant (graphs), offline_tok_s_eager
# (enforce_eager=true), graphs_vs_eager,
# batch1_tok_s, hf_tok_s, offline_vs_hf, lora_base_tok_s, lora_tok_s, lora_vs_base (target: at least 0.8),
# bandwidth_gb_s, matmul_bf16_tflop_s and invariance_bitwise (true when the Triton tests and the invariance tests
# all passed on the GPU), beside gpu-kernels-*.json, bench-*.json and the logs gpu-kernels.log, gpu-bench.log
# (the LoRA step's too), gpu-invariance.log and gpu-tests.log (7 files: the device tool brings back at most 8;
# the eager run's JSON stays in a temporary folder).
#
# On a machine set up with `make install model` nothing else is needed. A bare device machine (no network,
# its own python3 with torch/transformers/triton but not fastapi/uvicorn/pydantic, no model/) gets:
#   .gpu-carry/whl/    wheels of the missing packages, for CARRY_PYTHON (default 3.12, the 2026-12-04 image's
#                      Python; e.g. CARRY_PYTHON=3.11 bash benchmarks/gpu_check.sh --prepare): pure-Python
#                      wheels except pydantic-core, rpds-py and llguidance, built for that Python / the abi3
#                      ABI on manylinux x86_64. The run skips them, saying so, when its Python is another one;
#                      the check then needs those packages installed otherwise.
#   .gpu-carry/model/  the demo model's config, generation config, tokenizer and chat template (no weights:
#                      the 0.5 GB checkpoint is larger than what travels); the weights are then made
#                      RANDOM with the same shapes. Throughput does not depend on weight values (EOS is
#                      ignored), and the engine tests compare against transformers on the same weights,
#                      but the tests that need the real demo weights are deselected; the output says so.
# The workload's prompts are tracked (benchmarks/data/mt_bench_questions.jsonl) and travel with the tree.
# Pass .gpu-carry in the device tool's `carry` (.gitignore keeps it out of git).
#
# Status: the Triton backend, the CUDA graphs and gpu_memory_utilization have not run on a GPU yet (no device was
# lent since they were written); the earlier C++ / PyTorch path's run on an NVIDIA H200 left its logs in
# benchmarks/measurements/gpu-check-2026-12-04-h200/ (what they showed: docs/gpu.md). The tensor-parallel step
# (NCCL across the visible GPUs) is untested: no machine with two GPUs was lent.
set -uo pipefail
# the header above, without its '# '; --help prints it, a wrong argument its usage lines
header() { sed -n '2,/^set -uo pipefail/{/^#/s/^# \{0,1\}//p}' "$0"; }
bad_usage() { header | sed -n '/^Usage/,/^$/p' >&2; echo "gpu_check.sh: $1 (--help: the whole text)" >&2; exit 2; }
case "${1:-}" in
  ""|--prepare) ;;
  -h|--help) header; exit 0 ;;
  *) bad_usage "unknown argument '$1'" ;;
esac
if (( $# > 1 )); then bad_usage "one argument at most, got $#"; fi
cd "$(dirname "$0")/.."
# the device tool brings back at most 8 files from $OUT: logs, JSON; benchmarks/results/gpu-check/ is git-ignored
OUT_DIR=${OUT:-benchmarks/results/gpu-check}
CARRY=${GPU_CARRY:-.gpu-carry}   # GPU_CARRY: another folder (the tests point it at an empty one)
T0=$(date +%s)
# left N: N seconds, or what is left of BUDGET_S when that is less (never under 10)
left() { local l=$(( ${BUDGET_S:-470} - ($(date +%s) - T0) )); (( l > $1 )) && l=$1; (( l < 10 )) && l=10; echo "$l"; }

if [[ "${1:-}" == "--prepare" ]]; then
  set -e
  carry_python=${CARRY_PYTHON:-3.12}
  rm -rf "$CARRY/whl"
  mkdir -p "$CARRY/whl" "$CARRY/model"
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    if [[ -e model/$f ]]; then cp -L "model/$f" "$CARRY/model/"; fi
  done
  # the packages the device image of the 2026-12-04 run lacked (it had the rest the check needs); pure-Python
  # wheels except pydantic-core and rpds-py (built per CPython version) and llguidance (abi3)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$carry_python" --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$CARRY/whl" \
    fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection prometheus-client \
    python-multipart opentelemetry-api typing-extensions javaproperties 'llguidance>=1.8' jsonschema \
    jsonschema-specifications referencing rpds-py
  echo "$carry_python" > "$CARRY/whl/python-version"
  echo "wheels for Python $carry_python in $CARRY/whl; pass $CARRY in the device tool's carry"
  du -sh "$CARRY"
  exit 0
fi

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G "$CARRY/whl/*.whl" > /dev/null; then
  py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  carried=$(cat "$CARRY/whl/python-version" 2>/dev/null || echo "?")
  if [[ "$carried" == [0-9]* && "$carried" != "$py_version" ]]; then
    echo "$CARRY/whl holds wheels for Python $carried, this is Python $py_version ($PY): not installed; the check" \
      "needs those packages installed otherwise (or --prepare with CARRY_PYTHON=$py_version)"
  elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/whl/*.whl > /tmp/gpu-carry-pip.log 2>&1; then
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  else
    echo "$CARRY/whl's wheels (made for Python $carried) did not install on Python $py_version ($PY):" \
      "$(tail -1 /tmp/gpu-carry-pip.log | sed 's/^ERROR: //') (pip's output: /tmp/gpu-carry-pip.log); going on" \
      "without them: the check needs those packages installed otherwise"
  fi
fi

"$PY" - <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "triton", "transformers", "safetensors", "pydantic", "fastapi", "uvicorn", "httpx",
                       "psutil", "pytest", "matplotlib") if importlib.util.find_spec(m) is None]
problems = []
if "torch" not in missing:
    import torch
    triton = "missing" if "triton" in missing else importlib.import_module("triton").__version__
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}"
          + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "") + f"; triton {triton}")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build, no CUDA device visible" if torch.version.cuda else "CPU build"
        problems.append(f"CUDA is not available (torch {torch.__version__}, {build})")
if missing:
    problems.append(f"missing packages: {', '.join(missing)}")
if problems:
    sys.exit(f"cannot run the GPU check with {sys.executable}: {'; '.join(problems)}")
EOF

mkdir -p "$OUT_DIR"
echo "results go to $OUT_DIR"

DESELECT=()
if [[ ! -f model/model.safetensors ]]; then
  if [[ ! -f $CARRY/model/config.json ]]; then
    echo "no model/model.safetensors and no $CARRY/model/: run 'make model' (or --prepare here and carry $CARRY)"; exit 2
  fi
  echo "model/: RANDOM weights with the demo model's config (the real checkpoint did not travel)"
  mkdir -p model && cp "$CARRY"/model/* model/
  "$PY" - <<'EOF' || exit 2
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained("model")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
save_file(state, "model/model.safetensors", metadata={"format": "pt"})
EOF
  # these compare against the real weights' known outputs or need the real checkpoint's behaviour
  DESELECT=(-m "not slow")
fi

echo "== the Triton kernels compiled: tests/engine/triton (bitwise ones included), timings against torch =="
start=$(date +%s)
kernels_timeout=$(left "${KERNELS_TIMEOUT:-150}")
timeout "$kernels_timeout" "$PY" benchmarks/gpu_kernels_check.py --out "$OUT_DIR" \
  --tests-timeout-s $(( kernels_timeout > 60 ? kernels_timeout - 40 : kernels_timeout )) 2>&1 \
  | tee "$OUT_DIR/gpu-kernels.log"
kern_rc=${PIPESTATUS[0]}
echo "Triton kernels: exit $kern_rc in $(( $(date +%s) - start )) s"

echo "== benchmark, bf16, kernel_backend=triton, CUDA graphs, gpu_memory_utilization=0.9: offline, batch-1, transformers' generate() =="
start=$(date +%s)
BENCH_DIR=$(mktemp -d)      # bench.py writes a .png beside its .json: only the .json is kept
# bench.py sets option.kv_cache_bytes; gpu_memory_utilization set too sizes the cache as a GPU user's default does
timeout "$(left "${BENCH_TIMEOUT:-150}")" "$PY" benchmarks/bench.py --dtype bfloat16 --offline-rounds 1 --threads 4 \
  --option kernel_backend triton --option gpu_memory_utilization 0.9 --hf-batch-sizes 64 --out-dir "$BENCH_DIR" \
  --skip vllm,llamacpp,structured,batch_runner,ours_server,ours_batch1_int8,peak_end \
  --phase-timeout-s 120 2>&1 | tee "$OUT_DIR/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}
BENCH_JSON=$(ls -t "$BENCH_DIR"/bench-*.json 2>/dev/null | head -1)
if [[ -n "$BENCH_JSON" ]]; then cp "$BENCH_JSON" "$OUT_DIR/"; fi
echo "benchmark: exit $bench_rc in $(( $(date +%s) - start )) s"

echo "== the same offline workload with option.enforce_eager=true (every step eager, no CUDA graphs) =="
start=$(date +%s)
EAGER_DIR=$(mktemp -d)
timeout "$(left "${EAGER_TIMEOUT:-70}")" "$PY" benchmarks/bench.py --dtype bfloat16 --offline-rounds 1 --threads 4 \
  --option kernel_backend triton --option gpu_memory_utilization 0.9 --option enforce_eager true \
  --out-dir "$EAGER_DIR" --skip peak,vllm,llamacpp,structured,batch_runner,ours_server,ours_batch1,hf \
  --phase-timeout-s 60 2>&1 | tee -a "$OUT_DIR/gpu-bench.log"
eager_rc=${PIPESTATUS[0]}
EAGER_JSON=$(ls -t "$EAGER_DIR"/bench-*.json 2>/dev/null | head -1)
echo "benchmark, enforce_eager: exit $eager_rc in $(( $(date +%s) - start )) s"

echo "== LoRA (issue 41): 64 requests over 4 adapters against the same 64 on the base, bf16, auto = triton =="
# benchmarks/ab.py lora: the Triton LoRA kernel in the engine (its bitwise tests ran with the kernel tests above);
# its result line goes to gpu-bench.log, where the summary reads lora_base_tok_s, lora_tok_s and lora_vs_base
start=$(date +%s)
timeout "$(left "${LORA_TIMEOUT:-60}")" "$PY" benchmarks/ab.py lora --dtype bf16 --rounds 2 --threads 4 2>&1 \
  | tee -a "$OUT_DIR/gpu-bench.log"
lora_rc=${PIPESTATUS[0]}
echo "LoRA throughput: exit $lora_rc in $(( $(date +%s) - start )) s" | tee -a "$OUT_DIR/gpu-bench.log"

echo "== batch invariance on CUDA (the tests that compare a row alone and in a batch; auto = triton on CUDA) =="
start=$(date +%s)
timeout "$(left "${INVARIANCE_TIMEOUT:-80}")" "$PY" -m pytest -q -p no:cacheprovider --tb=short "${DESELECT[@]}" \
  tests/engine/test_engine.py tests/engine/test_attention.py tests/engine/test_forward.py \
  -k "bitwise or invariant or alone or tiled or per_sequence" 2>&1 | tee "$OUT_DIR/gpu-invariance.log"
inv_rc=${PIPESTATUS[0]}
echo "invariance tests: exit $inv_rc in $(( $(date +%s) - start )) s"

echo "== tensor parallelism across the visible GPUs (NCCL), when there are two or more =="
# the largest degree <= the GPU count the demo model takes (its 9 heads: 3); with 2 GPUs, a tiny random Llama
# at degree 2 instead. Greedy tokens of Engine at that degree against degree 1, on the same weights, in bf16.
timeout "$(left 60)" "$PY" - <<'EOF' 2>&1 | tee -a "$OUT_DIR/gpu-invariance.log"
import sys, tempfile, torch
from lmi_handler.config import EngineConfig, ParallelConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.model.loader import args_from_config, read_config
from lmi_handler.engine.parallel.layout import degree_problems
from lmi_handler.engine.sequence import SamplingParams
gpus = torch.cuda.device_count()
if gpus < 2:
    print(f"{gpus} GPU visible: tensor parallelism across GPUs skipped"); sys.exit(0)
a = args_from_config(read_config("model"))
degree = max(d for d in range(1, gpus + 1) if not degree_problems(a.num_heads, a.num_kv_heads, a.intermediate_size, a.vocab_size, d))
model = "model"
if degree == 1:
    from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer
    model, degree = tempfile.mkdtemp(), 2
    build_tiny_llama(model, tie_word_embeddings=False); build_tiny_tokenizer().save_pretrained(model)
prompts = [[1, 17, 300, 45, 9], [1, 250, 7], [1, 5, 6, 7, 8, 9, 10, 11]]
def tokens(d):
    engine = Engine(EngineConfig(model_path=model, dtype="bfloat16", device_id=0, max_num_seqs=8, max_num_batched_tokens=256,
                                 max_model_len=None, block_size=16, kv_cache_bytes=256 << 20, parallel=ParallelConfig(d, 60.0, None)))
    out = engine.generate([(f"r{i}", p, SamplingParams(max_new_tokens=16)) for i, p in enumerate(prompts)])
    if d > 1:
        engine.runner.close()
    return [[t.id for o in outs for t in o.new_tokens] for outs in out.values()]
one, many = tokens(1), tokens(degree)
print(f"TP={degree} on {model}: greedy tokens equal to TP=1 on {sum(a == b for a, b in zip(one, many))}/{len(one)} prompts")
sys.exit(0 if one == many else 1)
EOF
tp_rc=${PIPESTATUS[0]}
echo "tensor parallelism: exit $tp_rc"

echo "== the summary: gpu-<UTC date>.json (and the GPU's read bandwidth, measured here) =="
KERNELS_JSON=$(ls -t "$OUT_DIR"/gpu-kernels-*.json 2>/dev/null | head -1)
timeout 60 "$PY" benchmarks/gpu_kernels_check.py --summary "$OUT_DIR" --kernels-json "${KERNELS_JSON:-}" \
  --bench-json "${BENCH_JSON:-}" --bench-eager-json "${EAGER_JSON:-}" --rc kernels="$kern_rc" \
  --rc invariance="$inv_rc" --rc bench="$bench_rc" --rc bench_eager="$eager_rc" --rc tensor_parallel="$tp_rc" \
  --rc lora="$lora_rc"
sum_rc=$?
echo "summary: exit $sum_rc"

if [[ "${PROFILE:-0}" == 1 ]]; then
echo "== where a step's time goes on CUDA: the default engine (auto = triton), 64 sequences x 32 tokens =="
timeout "${PROFILE_TIMEOUT:-90}" "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT_DIR/gpu-bench.log"
import cProfile, io, pstats, time, torch
from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.sequence import SamplingParams
prompts = [[1] + [(7 * i + 13 * j) % 40000 + 100 for j in range(60 + i)] for i in range(64)]
engine = Engine(EngineConfig(model_path="model", dtype="bfloat16", device_id=0, max_num_seqs=64,
                             max_num_batched_tokens=4096, max_model_len=None, block_size=16,
                             kv_cache_bytes=1 << 30, enable_prefix_caching=False))
params = SamplingParams(max_new_tokens=32, ignore_eos=True)
engine.generate([(f"w{i}", p, params) for i, p in enumerate(prompts[:4])])      # warm-up
torch.cuda.synchronize(); t = time.perf_counter()
prof = cProfile.Profile(); prof.enable()
engine.generate([(f"r{i}", p, params) for i, p in enumerate(prompts)])
prof.disable(); torch.cuda.synchronize(); dt = time.perf_counter() - t
print(f"64 x 32 tokens in {dt:.2f} s = {64 * 32 / dt:.0f} tok/s (cProfile on)")
buf = io.StringIO(); pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
print(buf.getvalue()[-3500:])
PYEOF
echo "profile: exit ${PIPESTATUS[0]}"
fi

echo "== every engine test on CUDA with the time left (${DESELECT[*]:-all of tests/engine}) =="
# a C++ kernel's refusal (TORCH_CHECK) crashed the whole process on the device image of 2026-12-04 (torch
# 2.11.0+cu130 and its g++): run alone first so that a crash is seen, then the rest without it
crash=tests/engine/test_kernels.py::test_bad_shapes_are_refused_with_a_message
timeout "$(left 60)" "$PY" -m pytest -q -p no:cacheprovider "$crash" > "$OUT_DIR/gpu-tests.log" 2>&1
echo "a C++ kernel's refusal, alone: exit $? (139: the process crashed)" | tee -a "$OUT_DIR/gpu-tests.log"
start=$(date +%s)
timeout "$(left "${TESTS_TIMEOUT:-200}")" "$PY" -m pytest -q -p no:cacheprovider --tb=line tests/engine \
  "${DESELECT[@]}" --deselect "$crash" --ignore tests/engine/triton 2>&1 | tee -a "$OUT_DIR/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: exit $tests_rc in $(( $(date +%s) - start )) s (124: cut at the budget)"
exit $(( kern_rc != 0 || inv_rc != 0 || tp_rc != 0 || bench_rc != 0 || eager_rc != 0 || sum_rc != 0 \
  || (tests_rc != 0 && tests_rc != 124) ))
