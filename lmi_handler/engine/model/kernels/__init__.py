"""Batch-invariant float32 CPU kernels (C++, built on first use) and their pure-PyTorch references.

Owns the packed-weight layout, the lazy build and the fallback when no C++ compiler works; leaves
deciding which layers use them to llama.py and attention.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 32   # output columns per packed panel; must equal PANEL in cpu_kernels.cpp
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_state: dict = {}


def cpu_kernels():
    """The compiled extension module, or None when it cannot be built (logged once as a warning).

    Built with torch.utils.cpp_extension.load (-O3 -march=native -ffp-contract=off -fopenmp) into
    torch's extension cache on first call (the name carries the source hash) (-ffp-contract=off: a * b + c stays two roundings, as in
    PyTorch's elementwise ops); later processes reuse the cached build unless the source changed.
    """
    if "module" not in _state:
        _state["module"] = _build(_SOURCE, _module_name(_SOURCE))
    return _state["module"]


def _module_name(source: Path) -> str:
    """The extension's name carries a hash of its source: checkouts of different versions on one machine
    (a CI clone beside a working tree) never load each other's build from torch's shared cache."""
    import hashlib

    return "lmi_cpu_kernels_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12]


STALE_LOCK_S = 600.0   # a build takes about a minute here; a lock this old was left by a killed build


def clear_stale_build_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> bool:
    """Wait while `build_dir`/lock is held by a build younger than `max_age_s` seconds (as torch itself
    would), then remove it if it is still there; True when a stale lock was removed.

    torch.utils.cpp_extension serialises builds with that file and waits for it to go away, forever: a
    build killed part-way (SIGKILL, a CI timeout) would otherwise hang every later start of the engine.
    The file's mtime is when its build began.
    """
    lock = Path(build_dir) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False
        if age >= max_age_s:
            break
        time.sleep(min(poll_s, max_age_s - age))
    log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build(source: Path, name: str):
    """Compile `source` as extension `name`; None (and a warning) when that fails."""
    from torch.utils.cpp_extension import _get_build_directory, load

    start = time.perf_counter()
    try:
        clear_stale_build_lock(Path(_get_build_directory(name, verbose=False)))
        module = load(name=name, sources=[str(source)],
                      extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:     # no compiler, no ninja, a build error: the PyTorch paths still work
        log.warning("C++ CPU kernels unavailable, using the PyTorch fallback: %s", exc)
        return None
    if module.PANEL != PANEL:
        raise RuntimeError(f"cpu_kernels.cpp PANEL={module.PANEL} but the wrapper expects {PANEL}")
    log.info("C++ CPU kernels ready in %.1f s (vector width %d)", time.perf_counter() - start,
             module.VECTOR_WIDTH)
    return module


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight (out_features, in_features) repacked for `packed_linear`.

    panels: (ceil(out_features / PANEL), in_features, PANEL) float32, contiguous; panel p holds
    output columns p*PANEL .. p*PANEL+PANEL-1 (zero-padded past out_features), k-major, so the
    kernel streams one panel from start to end per row block.
    """

    panels: torch.Tensor
    out_features: int

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the original weight (an embedding lookup on a tied lm_head): (len(ids), in)."""
        return self.panels[ids // PANEL, :, ids % PANEL]

    def unpack(self) -> torch.Tensor:
        """The original (out_features, in_features) weight (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor in 2 MiB-aligned memory marked for transparent huge pages.

    For the large, streamed buffers (packed weights, the KV cache): with 4 KiB pages each page is a
    TLB miss, and under a hypervisor each miss walks two page tables (measured on this project's
    2-core VM: a 425 MiB stream read at 17.6 GB/s with 4 KiB pages, 23.2 GB/s with huge pages).
    Falls back to torch.empty for other dtypes or devices, when `huge_pages` is False (option.huge_pages,
    LMI_HUGE_PAGES=0: config.py), or when the C++ kernels
    are not built: it never builds them itself, so the plain (option.batch_invariant=false) path compiles
    nothing; the batch-invariant path builds them before packing its weights. Where THP is off the
    kernel ignores the advice. Contents are what torch.empty gives: zero_() or copy_() before use.
    """
    if (dtype != torch.float32 or torch.device(device).type != "cpu" or not huge_pages
            or (module := _state.get("module")) is None):
        return torch.empty(shape, dtype=dtype, device=device)
    return module.empty_huge(list(shape))


def pack_weight(weight: torch.Tensor, huge_pages: bool = True) -> PackedWeight:
    """(out, in) float32 CPU weight -> PackedWeight (in huge-page memory, see empty_huge). Holds one extra
    copy only while packing. `huge_pages`: see empty_huge."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, num_panels * PANEL - out_features))
    panels = empty_huge(num_panels, in_features, PANEL, dtype=weight.dtype, device=weight.device, huge_pages=huge_pages)
    panels.copy_(padded.view(num_panels, PANEL, in_features).transpose(1, 2))
    return PackedWeight(panels=panels, out_features=out_features)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias), each output one FMA chain over k = 0..in-1: a row's bits do not depend on
    the other rows. x: (M, in) float32 CPU -> (M, out) float32. Needs cpu_kernels() not None."""
    return cpu_kernels().linear(x, weight.panels, weight.out_features, bias)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-PyTorch reference for packed_linear: x @ weight.T (+ bias) in float64, cast to x's dtype."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


def fused_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then weight * x / sqrt(mean(x^2) + eps) per row, in one pass.

    x, delta: (T, N) float32 CPU, x contiguous; weight: (N,) float32. Returns (T, N). The residual
    add is bitwise PyTorch's; the norm is transformers' LlamaRMSNorm in float32 except for the order
    of the sum of squares (a rounding-level difference). Row-wise: a row's bits depend on it alone.
    """
    return cpu_kernels().add_rmsnorm(x, delta, weight, eps)


def fused_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                        num_kv_heads: int) -> torch.Tensor:
    """RoPE (rotate-half) on q and k of fused qkv rows; rotated k and v stored at their cache slots.

    qkv: (T, (H + 2 KVH) D) float32 contiguous (q, then k, then v); cos, sin: (T, D) float32;
    caches: (num_blocks, block_size, KVH, D) contiguous, written in place; slot_mapping: (T,) int64.
    Returns q: (T, H, D). Bitwise the same as reference_rope_kv_write (same float operations).
    Raises: RuntimeError on mismatched shapes or a slot outside the cache.
    """
    return cpu_kernels().rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) rows: (T, 2I) float32 contiguous -> (T, I)."""
    return cpu_kernels().silu_mul(gate_up)


def reference_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for fused_add_rmsnorm: (new x, normed) without touching x."""
    x = x if delta is None else x + delta
    xf = x.float()
    return x, weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                            num_kv_heads: int) -> torch.Tensor:
    """PyTorch reference for fused_rope_kv_write (split, rotate-half RoPE, index_copy_ into the caches)."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q = rope(q.reshape(-1, num_heads, head_dim))
    k = rope(k.reshape(-1, num_kv_heads, head_dim))
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.reshape(-1, num_kv_heads, head_dim))
    return q


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch reference for fused_silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
