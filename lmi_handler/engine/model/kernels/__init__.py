"""Batch-invariant CPU kernels (C++, built on first use), their packed weights and their pure-PyTorch
references.

build.py owns the lazy build, the fallback when no C++ compiler works and what the CPU offers;
packing.py the packed-weight layouts (float32, bfloat16, int8); bf16_form.py which form multiplies
bfloat16 panels (and its probes); ops.py the Python calls of the kernels (the linear over the panels, the
fused row-wise ops); reference.py the pure-PyTorch references the kernels are tested against. The C++
sources beside them: linear.h and its linear_*.h (the linear by instruction family, one driver),
attention.h, rowwise.h (the row-wise ops), decoder_stack.h and stack_linear.h (the fused decoder stack, its
layers' weights by role), linear_quant.h (4-/8-bit codes), vmath.h, lora.h, bitmask.h, common.h; cpu_kernels.cpp,
families.cpp, quant.cpp and moe.cpp the translation units. Deciding which layers use them is the model's backends' (backends/cpp.py).
Modules import one way: build <- packing <- bf16_form <- ops (tests/test_repository.py checks the package
has no import cycle).
"""
from lmi_handler.engine.model.kernels.bf16_form import (  # noqa: F401
    BF16_AMX,
    BF16_DOT_MODES,
    BF16_DP,
    BF16_FMA,
    bf16_dot_form,
    bf16_form_name,
    choose_bf16_dot,
)
from lmi_handler.engine.model.kernels.build import (  # noqa: F401
    STALE_LOCK_S,
    build_extension,
    built_kernels,
    clear_stale_build_lock,
    cpu_kernels,
    empty_huge,
    native_bf16_cpu,
)
from lmi_handler.engine.model.kernels.ops import (  # noqa: F401
    fused_add_rmsnorm,
    fused_rope_kv_write,
    fused_silu_mul,
    packed_linear,
    packed_linear_silu,
    row_argmax,
)
from lmi_handler.engine.model.kernels.packing import (  # noqa: F401
    ARENA_ALIGN,
    KINDS,
    PANEL,
    PackedWeight,
    pack_weight,
    panel_arena,
    panels_shape,
    quantize_int8,
)
from lmi_handler.engine.model.kernels.reference import (  # noqa: F401
    reference_add_rmsnorm,
    reference_linear,
    reference_linear_bf16,
    reference_linear_int8,
    reference_rope_kv_write,
    reference_silu_mul,
)
