"""The engine's Sampler picking through the Triton backend's log_softmax, greedy and seeded_sample (a CUDA
step's sampling on the device; here under Triton's interpreter) against the CPU sampler: the same tokens for
the same seeds and positions, greedy and sampled rows mixed, with the filters; log-probs to rounding. And an
engine on kernel_backend=triton samples with them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.sampler import Sampler, SamplingMetadata
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.device_syncs import DeviceSyncs
from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")

VOCAB = 300     # not a multiple of the kernels' 1024-wide vocabulary chunk: the masked tail is exercised


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", [1, 2, 3 + i], p)
        seq.output_token_ids = [5] * (i % 3)          # positions 0, 1, 2, ...
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("mix", ["all_greedy", "all_sampled", "mixed"])
def test_sampling_through_the_triton_ops_picks_the_cpu_samplers_tokens(mix, device):
    knobs = [dict(temperature=0.7, seed=3), dict(temperature=1.3, top_k=20, seed=-9),
             dict(temperature=1.0, top_p=0.9, seed=2**40), dict(temperature=0.5, min_p=0.05, seed=7),
             dict(temperature=1.0, seed=3)]
    params = [SamplingParams(greedy=False, top_n_tokens=2, **k) for k in knobs]
    if mix != "all_sampled":
        params = [dataclasses.replace(p, greedy=True) if mix == "all_greedy" or i % 2 else p
                  for i, p in enumerate(params)]
    torch.manual_seed(0)
    logits = torch.randn(len(params), VOCAB) * 3
    seqs = _seqs(params)
    cpu = Sampler()(logits, SamplingMetadata.from_sequences(seqs, VOCAB, torch.device("cpu")))
    on_device = logits.to(device)
    with DeviceSyncs(device) as probe:       # the pick on the device never waits for it (but top_p's check)
        probe.on_device(on_device)
        ours = Sampler(tb)(on_device, SamplingMetadata.from_sequences(seqs, VOCAB, device))
    assert {s.function for s in probe.syncs} == ({"apply_top_p"} if mix != "all_greedy" else set()), probe.syncs
    assert ours.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    torch.testing.assert_close(ours.logprobs.cpu(), cpu.logprobs, rtol=0, atol=1e-5)
    assert ours.top_ids.cpu().tolist() == cpu.top_ids.tolist()


def test_a_seeded_rows_draw_through_the_triton_ops_is_the_same_alone_and_in_a_batch(device):
    params = [SamplingParams(greedy=False, temperature=0.9, seed=s) for s in (5, 6, 7)]
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB, device=device)
    seqs = _seqs(params)
    batch = Sampler(tb)(logits, SamplingMetadata.from_sequences(seqs, VOCAB, device)).token_ids.cpu()
    alone = [Sampler(tb)(logits[i:i + 1], SamplingMetadata.from_sequences(seqs[i:i + 1], VOCAB, device))
             .token_ids.item() for i in range(3)]
    assert batch.tolist() == alone


def test_an_engine_on_kernel_backend_triton_samples_with_the_triton_ops(tmp_path, device):
    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = EngineConfig(model_path=tmp_path, dtype="float32", device_id=0 if device.type == "cuda" else -1,
                          max_num_seqs=2, max_num_batched_tokens=16, max_model_len=None, block_size=4,
                          kv_cache_bytes=1 << 20, kernel_backend="triton")
    engine = Engine(config, tokenizer=build_tiny_tokenizer())
    assert engine.sampler.ops is tb
    config_torch = dataclasses.replace(config, kernel_backend="torch")
    reference = Engine(config_torch, tokenizer=build_tiny_tokenizer())
    assert reference.sampler.ops is None
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.8, seed=42, greedy=False)

    def tokens(e: Engine) -> list[int]:
        out = e.generate([("r", [1, 30, 31, 32], dataclasses.replace(params))])
        return [t.id for o in out["r"] for t in o.new_tokens]

    assert tokens(engine) == tokens(reference)
