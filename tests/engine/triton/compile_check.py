"""Compile every Triton kernel of the backend for a CUDA target, without a GPU (ptxas ships in triton's wheel):
catches what the interpreter accepts but the compiler refuses. Run in a process without TRITON_INTERPRET
(under it, triton.jit gives interpreted functions, which do not compile):

    python -m tests.engine.triton.compile_check [ARCH ...]     # default 90 (H100/H200); prints one line a kernel
"""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lmi_handler.engine.model.backends.triton import attention, lora, matmul, moe, rowwise, sampling

# the demo model's shapes (SmolLM2-135M): 9 heads over 3 KV heads of 64, hidden 576, MLP 1536
ATTENTION = {"GROUP": 3, "GROUP_PAD": 4, "HEAD_DIM": 64, "DIM_PAD": 64, "SEQ_CHUNK": attention.SEQ_CHUNK, "TILE": attention.KV_TILE}
LINEAR = {"HAS_BIAS": True, "BLOCK_M": matmul.BLOCK_M, "BLOCK_N": matmul.BLOCK_N, "BLOCK_K": matmul.BLOCK_K}
POINTERS = ("k_cache", "v_cache", "k", "v", "q", "out", "x", "weight", "bias", "residual", "residual_out", "cos",
            "sin", "gate_up", "logits")


def cases(dt: str):
    """(kernel, non-default argument types, constexpr values); arguments not named are i32, pointers *dt."""
    idx = {"slot_mapping": "*i64", "block_tables": "*i32", "context_lens": "*i32", "cu_seqlens_q": "*i32"}
    yield attention._store_kv_kernel, idx, {"NUM_HEADS": 3, "HEAD_DIM": 64, "HEADS_PAD": 4, "DIM_PAD": 64}
    for window, softcap, sinks in ((False, False, False), (True, True, False), (True, False, True)):
        yield attention._paged_attention_kernel, {**idx, "scale": "fp32", "softcap": "fp32", "sinks": "*fp32"}, \
            {**ATTENTION, "USE_WINDOW": window, "USE_SOFTCAP": softcap, "USE_SINKS": sinks}
    yield matmul._linear_kernel, {}, {**LINEAR, "WIDEN": dt == "fp32"}
    yield moe._grouped_kernel, {"sorted_pairs": "*i32", "block_expert": "*i32"}, {k: v for k, v in LINEAR.items()
                                                                              if k != "HAS_BIAS"} | {"WIDEN": dt == "fp32"}
    yield rowwise._rms_norm_kernel, {"eps": "fp32", "weight_offset": "fp32"}, {"HAS_RESIDUAL": True, "BLOCK": 1024}
    yield rowwise._rope_kernel, {}, {"HEAD_DIM": 64, "HEADS_PAD": 16, "DIM_PAD": 64}
    for gelu in (False, True):
        yield rowwise._act_mul_kernel, {}, {"GELU": gelu, "BLOCK": rowwise.ACT_BLOCK}
    yield rowwise._clamped_swiglu_kernel, {"alpha": "fp32", "limit": "fp32"}, {"BLOCK": rowwise.ACT_BLOCK}
    yield sampling._log_softmax_kernel, {"out": "*fp32"}, {"BLOCK": sampling.VOCAB_BLOCK}
    for seeded in (False, True):
        yield sampling._argmax_kernel, {"out": "*i64", "scores": "*fp32", "seeds": "*i64", "positions": "*i64"}, \
            {"SEEDED": seeded, "BLOCK": sampling.VOCAB_BLOCK}
    yield lora._lora_kernel, {"y": f"*{dt}", "row_slot": "*i64", "a_stack": "*fp32", "b_stack": "*fp32",
                              "scale": "*fp32"}, \
        {"BLOCK_M": lora.BLOCK_M, "BLOCK_N": lora.BLOCK_N, "BLOCK_K": lora.BLOCK_K, "BLOCK_R": 16}


def compile_all(arch: int) -> list[str]:
    done = []
    for dt in ("bf16", "fp32"):
        for kernel, types, constexprs in cases(dt):
            signature = {p.name: "constexpr" if p.name in constexprs else types.get(
                p.name, f"*{dt}" if p.name in POINTERS else "i32") for p in kernel.params}
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32))
            done.append(f"sm_{arch} {dt} {kernel.__name__} {constexprs}")
    return done


if __name__ == "__main__":
    for arch in [int(a) for a in sys.argv[1:]] or [90]:
        print("\n".join(compile_all(arch)))
