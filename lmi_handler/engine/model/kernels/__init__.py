"""Batch-invariant CPU kernels (C++, built on first use), their packed weights and their pure-PyTorch
references.

build.py owns the lazy build, the fallback when no C++ compiler works and the CPU's bf16 support;
packing.py the packed-weight layouts (float32, bfloat16, int8) and the linear over them; reference.py
the pure-PyTorch references the kernels are tested against. Deciding which layers use them is
llama.py's and attention.py's.
"""
from lmi_handler.engine.model.kernels.build import (  # noqa: F401
    STALE_LOCK_S,
    build_extension,
    bf16_dot_form,
    bf16_form_name,
    built_kernels,
    clear_stale_build_lock,
    cpu_kernels,
    empty_huge,
)
from lmi_handler.engine.model.kernels.packing import (  # noqa: F401
    ARENA_ALIGN,
    KINDS,
    PANEL,
    PackedWeight,
    fused_add_rmsnorm,
    fused_rope_kv_write,
    fused_silu_mul,
    pack_weight,
    packed_linear,
    packed_linear_silu,
    panel_arena,
    panels_shape,
    quantize_int8,
    row_argmax,
)
from lmi_handler.engine.model.kernels.reference import (  # noqa: F401
    reference_add_rmsnorm,
    reference_linear,
    reference_linear_bf16,
    reference_linear_int8,
    reference_rope_kv_write,
    reference_silu_mul,
)
