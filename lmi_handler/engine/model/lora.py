"""LoRA adapters: PEFT checkpoints read and checked against the base model, the registry of loaded ones, and
the batched low-rank product each projection adds for its rows' adapters.

Owns the adapter files (adapter_config.json + adapter_model.safetensors), their limits (rank, modules,
shapes, allowed roots), which adapters are loaded (LRU past max_cpu_loras), `lora_delta` (the pure-PyTorch
product, the reference) and the stacks as the C++ decoder stack takes them (`LoraBatch.kernel_set`, for
kernels/lora.h's row-wise product); which adapter a request names is the protocol's, adding the terms after
each projection the forward's (`LoraBatch.add`, or the C++ stack itself).
"""
from __future__ import annotations

import json
import math
import re
import threading
import uuid
from collections import OrderedDict
from itertools import accumulate
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's names for a Llama-family model saved with save_pretrained (the adapter's own name removed)
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
# Fused projections of the base (Phi-3's checkpoints; our own forward's qkv and gate_up) and their parts
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TILE = 16                 # rows per bmm tile: a row's bits do not depend on how many rows share its step
CUDA_TILES_PER_CALL = 8   # CUDA: a fixed bmm batch count, so cuBLAS's kernel choice is fixed
# the projections the C++ decoder stack adds terms to, in LoraSet's order (kernels/lora.h)
KERNEL_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; `status_code` is the HTTP answer (400 bad adapter, 404 unknown
    name, 409 name taken, 503 no room), `field` the request field it names."""

    def __init__(self, message: str, status_code: int = 400, field: str = "adapter"):
        super().__init__(message)
        self.status_code, self.field = status_code, field


@dataclass(frozen=True)
class LoraLimits:
    """What an adapter may be: option.max_lora_rank, option.lora_target_modules (None = every projection the
    base has), option.max_cpu_loras, and the directories the run-time APIs may load from."""

    max_lora_rank: int = 16
    target_modules: tuple[str, ...] | None = None
    max_cpu_loras: int = 8
    allowed_roots: tuple[Path, ...] = ()


def base_module_shapes(config: Mapping) -> dict[str, tuple[int, int]]:
    """The base's LoRA-able projections from its config.json: name -> (in_features, out_features).

    Llama-family models have q/k/v/o and gate/up/down; Phi-3 stores q/k/v and gate/up fused (qkv_proj,
    gate_up_proj), so an adapter of it names those.
    """
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // num_heads
    q_out, kv_out = num_heads * head_dim, (config.get("num_key_value_heads") or num_heads) * head_dim
    shapes = {"o_proj": (q_out, hidden), "down_proj": (inter, hidden)}
    if config.get("model_type") == "phi3":
        return shapes | {"qkv_proj": (hidden, q_out + 2 * kv_out), "gate_up_proj": (hidden, 2 * inter)}
    return shapes | {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
                     "gate_proj": (hidden, inter), "up_proj": (hidden, inter)}


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: per (layer, module) A (r, in) and B (out, r) float32 CPU tensors and its scale.

    `key` is unique to this load (never reused, even for the same name loaded again), so the prefix cache
    keyed on it never serves K/V computed under another adapter or an older copy of this one.
    """

    name: str
    path: Path
    rank: int
    scale: float                                    # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes = field(default_factory=lambda: uuid.uuid4().bytes)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({module for _, module in self.weights}))


def load_adapter(name: str, path: str | Path, config: Mapping, limits: LoraLimits,
                 check_root: bool = True) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder and check it against the base's `config` (config.json as a dict).

    Raises LoraError (400) naming what is wrong: a bad name, a path outside limits.allowed_roots (when
    `check_root`), missing files, a config that is not plain LoRA, a rank over limits.max_lora_rank, a module
    the base lacks or option.lora_target_modules leaves out, a layer past the base's, a shape that does not
    match, an A without its B.
    """
    if not _ADAPTER_NAME.fullmatch(name or ""):
        raise LoraError(f"adapter name {name!r} is not 1-128 characters of [A-Za-z0-9._-] starting with a letter "
                        "or digit", field="name")
    folder = Path(path).expanduser().resolve()
    if check_root and not any(folder.is_relative_to(root.resolve()) for root in limits.allowed_roots):
        roots = ", ".join(str(r) for r in limits.allowed_roots) or "none"
        raise LoraError(f"adapter path {str(path)!r} is outside the allowed roots ({roots}; "
                        "option.lora_adapter_roots)", field="src")
    peft = _read_config(folder)
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{folder / CONFIG_FILE}: `r` must be a whole number >= 1 and `lora_alpha` a number, "
                        f"got r={rank!r}, lora_alpha={alpha!r}")
    if rank > limits.max_lora_rank:
        raise LoraError(f"adapter {name!r} has rank {rank}, over option.max_lora_rank={limits.max_lora_rank}")
    scale = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    weights = _read_weights(folder, name, rank, base_module_shapes(config), config["num_hidden_layers"], limits)
    return LoraAdapter(name, folder, rank, float(scale), weights)


def _read_config(folder: Path) -> dict:
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise LoraError(f"adapter folder {str(folder)!r} has no {needed.name} (PEFT's format: {CONFIG_FILE} "
                            f"+ {WEIGHTS_FILE})", field="src")
    try:
        peft = json.loads(config_path.read_text())
    except ValueError as exc:
        raise LoraError(f"{config_path} is not valid JSON: {exc}") from None
    refused = {"peft_type": peft.get("peft_type", "LORA") != "LORA", "use_dora": bool(peft.get("use_dora")),
               "fan_in_fan_out": bool(peft.get("fan_in_fan_out")), "bias": peft.get("bias", "none") != "none",
               "rank_pattern": bool(peft.get("rank_pattern")), "alpha_pattern": bool(peft.get("alpha_pattern")),
               "modules_to_save": bool(peft.get("modules_to_save"))}
    bad = [key for key, is_bad in refused.items() if is_bad]
    if bad:
        shown = ", ".join(f"{key}={peft.get(key)!r}" for key in bad)
        raise LoraError(f"{config_path}: only plain LoRA adapters are supported (peft_type LORA, no DoRA, "
                        f"fan_in_fan_out, bias, rank/alpha patterns or modules_to_save), got {shown}")
    return peft


def _read_weights(folder: Path, name: str, rank: int, shapes: dict[str, tuple[int, int]], num_layers: int,
                  limits: LoraLimits) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise LoraError(f"{folder / WEIGHTS_FILE} cannot be read as safetensors: {exc}") from None
    allowed = set(shapes) if limits.target_modules is None else set(shapes) & set(limits.target_modules)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name)
        if match is None:
            raise LoraError(f"adapter {name!r}: tensor {tensor_name!r} is not a LoRA A/B weight of a decoder "
                            "projection (PEFT names: base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight)")
        layer, module, half = int(match[1]), match[3], match[4]
        if module not in shapes:
            raise LoraError(f"adapter {name!r}: module {module!r} ({tensor_name}) is not one the base model has "
                            f"({', '.join(sorted(shapes))})")
        if module not in allowed:
            raise LoraError(f"adapter {name!r}: module {module!r} is not in option.lora_target_modules "
                            f"({', '.join(sorted(allowed))})")
        if layer >= num_layers:
            raise LoraError(f"adapter {name!r}: {tensor_name} names layer {layer}, the base has {num_layers}")
        in_features, out_features = shapes[module]
        want = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != want:
            raise LoraError(f"adapter {name!r}: {tensor_name} has shape {tuple(tensor.shape)}, the base model "
                            f"needs {want} (rank {rank})")
        halves.setdefault((layer, module), {})[half] = tensor.float().contiguous()
    lonely = [f"layer {layer} {module}" for (layer, module), pair in halves.items() if len(pair) != 2]
    if lonely or not halves:
        raise LoraError(f"adapter {name!r}: " + (f"lora_A without lora_B or the reverse at {', '.join(lonely)}"
                                                 if lonely else "holds no LoRA weights"))
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(halves.items())}


class AdapterRegistry:
    """The loaded adapters by name, least recently used first (thread-safe: routes load while the engine runs).

    Loading past limits.max_cpu_loras evicts the least recently used adapter that no running request holds
    (`held()` names those, the engine's live sequences); when every one is held the load is refused (503).
    Unloading takes the name away at once; requests already running keep their LoraAdapter object.
    """

    def __init__(self, config: Mapping, limits: LoraLimits, held: Callable[[], Iterable[str]] = tuple):
        self.config, self.limits, self.held = dict(config), limits, held
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.num_loads = self.num_evictions = 0

    def load(self, name: str, path: str | Path, check_root: bool = True) -> LoraAdapter:
        """Read, check and register an adapter. Raises LoraError: 400 a bad adapter, 409 the name is loaded,
        503 no room (every loaded adapter held). Nothing changes when it raises."""
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"adapter {name!r} is already loaded (unload it first)", 409, "name")
        adapter = load_adapter(name, path, self.config, self.limits, check_root)     # slow part: unlocked
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"adapter {name!r} is already loaded (unload it first)", 409, "name")
            if len(self._adapters) >= self.limits.max_cpu_loras:
                self._evict_one()
            self._adapters[name] = adapter
            self.num_loads += 1
        return adapter

    def _evict_one(self) -> None:
        held = set(self.held())
        victim = next((n for n in self._adapters if n not in held), None)
        if victim is None:
            raise LoraError(f"cannot load another adapter: all {len(self._adapters)} loaded ones "
                            f"(option.max_cpu_loras) are in use by running requests; retry later", 503)
        del self._adapters[victim]
        self.num_evictions += 1

    def unload(self, name: str) -> LoraAdapter:
        """Remove `name`. Raises LoraError (404) when it is not loaded."""
        with self._lock:
            if name not in self._adapters:
                raise LoraError(f"adapter {name!r} is not loaded", 404, "name")
            return self._adapters.pop(name)

    def get(self, name: str) -> LoraAdapter:
        """The adapter for a request, marked most recently used. Raises LoraError (404) naming it."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                loaded = ", ".join(map(repr, self._adapters)) or "none"
                raise LoraError(f"adapter {name!r} is not loaded (loaded: {loaded})", 404)
            self._adapters.move_to_end(name)
            return adapter

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def adapters(self) -> list[LoraAdapter]:
        """The loaded adapters, least recently used first (a copy)."""
        with self._lock:
            return list(self._adapters.values())


# ---- the batched product ------------------------------------------------------------------------------


@dataclass
class TileLayout:
    """Where each adapter row goes in lora_delta's tiles: rows grouped by slot, each slot's rows padded to whole
    TILE-row tiles. Made once per step (LoraBatch) so the projections' calls need no host sync."""

    rows: torch.Tensor          # (N,) int64 flat rows that have an adapter, grouped by slot
    slots: torch.Tensor         # (N,) int64 their slots
    place: torch.Tensor         # (N,) int64 their row in the tiles (num_tiles * TILE rows)
    tile_slot: torch.Tensor     # (num_tiles,) int64 each tile's slot
    num_tiles: int
    groups: tuple[tuple[int, int, int], ...] = ()   # (slot, first tile, tiles) of each slot used, host ints (CPU)


def tile_layout(row_slot: torch.Tensor) -> TileLayout | None:
    """The tiles of a step's rows (row_slot (T,) int64, -1 = base); None when no row has an adapter."""
    rows = torch.nonzero(row_slot >= 0).flatten()
    if rows.numel() == 0:
        return None
    slots = row_slot[rows]
    order = torch.argsort(slots, stable=True)
    rows, slots = rows[order], slots[order]
    used, counts = torch.unique_consecutive(slots, return_counts=True)
    tiles_per_slot = [-(-n // TILE) for n in counts.tolist()]       # host sync: the tile count sizes the tensors
    device = row_slot.device
    tile_slot = torch.repeat_interleave(used, torch.tensor(tiles_per_slot, device=device))
    first_tile = torch.tensor([0] + tiles_per_slot[:-1], device=device).cumsum(0)       # per used slot
    first_row = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
    group = torch.repeat_interleave(torch.arange(len(tiles_per_slot), device=device), counts)
    place = first_tile[group] * TILE + torch.arange(rows.numel(), device=device) - first_row[group]
    groups = ()
    if device.type == "cpu":                          # a CPU tensor's values are on the host already
        starts = [0] + list(accumulate(tiles_per_slot))[:-1]
        groups = tuple(zip(used.tolist(), starts, tiles_per_slot))
    return TileLayout(rows, slots, place, tile_slot, sum(tiles_per_slot), groups)


def lora_delta(x: torch.Tensor, row_slot: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
               scale: torch.Tensor, layout: TileLayout | None = None) -> torch.Tensor:
    """Each row's LoRA term against its own adapter: (x A_s^T) B_s^T * scale_s for s = row_slot[t], 0 for -1.

    x: (T, in); row_slot: (T,) int64 on x's device, -1 = the base (no adapter); a_stack: (num_slots, r_max, in);
    b_stack: (num_slots, out, r_max), ranks below r_max zero-padded; scale: (num_slots,); layout: tile_layout(
    row_slot), made here when not given. Returns (T, out) in x's dtype, computed in a_stack's dtype. Grouped:
    each slot's rows are gathered into zero-padded TILE-row tiles and all tiles go through one bmm against their
    slot's A then B (as linear.invariant_linear), so a row's bits depend only on itself and its adapter,
    never on the rows beside it.
    """
    out = torch.zeros(x.shape[0], b_stack.shape[1], dtype=x.dtype, device=x.device)
    layout = layout if layout is not None else tile_layout(row_slot)
    if layout is None:
        return out
    dtype = a_stack.dtype
    xt = torch.zeros(layout.num_tiles * TILE, x.shape[1], dtype=dtype, device=x.device)
    xt[layout.place] = x[layout.rows].to(dtype)
    tiles = xt.view(layout.num_tiles, TILE, -1)
    shrink = _tiled_bmm(tiles, a_stack, layout.tile_slot, layout.groups)         # (tiles, TILE, r_max)
    expand = _tiled_bmm(shrink, b_stack, layout.tile_slot, layout.groups)        # (tiles, TILE, out)
    delta = expand.view(layout.num_tiles * TILE, -1)[layout.place] * scale[layout.slots].to(dtype)[:, None]
    out[layout.rows] = delta.to(x.dtype)
    return out


def _tiled_bmm(tiles: torch.Tensor, stack: torch.Tensor, tile_slot: torch.Tensor,
               groups: tuple[tuple[int, int, int], ...] = ()) -> torch.Tensor:
    """tiles[i] @ stack[tile_slot[i]]^T for every tile: (n, TILE, k) x (num_slots, m, k) -> (n, TILE, m).
    CPU: one bmm per slot used (`groups`, TileLayout's), its weight broadcast over the slot's tiles (a stride-0
    view, as linear.tiled_matmul: MKL runs every tile through the same kernel whatever their number), so
    no tile copies its weight. CUDA: CUDA_TILES_PER_CALL tiles a call (the last padded), so the kernel cuBLAS
    picks never depends on n."""
    if tiles.device.type == "cpu" and groups:
        outs = [torch.bmm(tiles[first:first + n], stack[slot].t().expand(n, -1, -1)) for slot, first, n in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    weights = stack.index_select(0, tile_slot).transpose(1, 2)                # (n, k, m)
    if tiles.device.type == "cpu":
        return torch.bmm(tiles, weights)
    n, per = tiles.shape[0], CUDA_TILES_PER_CALL
    pad = -n % per
    tiles = torch.nn.functional.pad(tiles, (0, 0, 0, 0, 0, pad))
    weights = torch.nn.functional.pad(weights, (0, 0, 0, 0, 0, pad))
    outs = [torch.bmm(tiles[i:i + per], weights[i:i + per]) for i in range(0, n + pad, per)]
    return torch.cat(outs)[:n]


@dataclass
class LoraBatch:
    """One step's adapters, built once per step by the model runner: each row's slot and, per (layer,
    projection), the stacked A and B of the step's adapters (slot i = adapters[i]).

    Projection names are the base's (q_proj ...) or a fused one of FUSED (qkv_proj, gate_up_proj): a fused
    projection's A stacks its parts' A along the rank, its B places each part's B in its own rows and rank
    columns (block diagonal), so one lora_delta gives every part its own term, exactly.
    """

    row_slot: torch.Tensor                          # (T,) int64, -1 = base
    scale: torch.Tensor                             # (num_slots,)
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # the stacks as a kernel takes them (kernel_set, backend_stacks), made once per adapter set: shared by the
    # copies the runner makes of its kept LoraBatch each step (dataclasses.replace passes this dict on, not a copy)
    prepared: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, adapters: list[LoraAdapter], rows_per_seq: list[int], seq_adapter: list[int | None],
              shapes: dict[str, tuple[int, int]], device: torch.device, dtype: torch.dtype = torch.float32,
              fused: Iterable[str] = ()) -> "LoraBatch":
        """`adapters`: the step's distinct adapters (slot order); sequence j computes rows_per_seq[j] rows with
        slot seq_adapter[j] (None = base); `shapes`: base_module_shapes; `fused`: FUSED names the forward
        calls instead of their parts. Stacks in `dtype` on `device`."""
        slots = [-1 if s is None else s for s in seq_adapter]
        row_slot = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                           torch.tensor(rows_per_seq, dtype=torch.int64)).to(device, non_blocking=True)
        scale = torch.tensor([a.scale for a in adapters], dtype=dtype).to(device, non_blocking=True)
        keys = {key for a in adapters for key in a.weights}
        stacks = {}
        for layer, module in sorted(keys):
            stacks[(layer, module)] = _stack(adapters, layer, [module], shapes, device, dtype)
        for name in fused:
            parts = FUSED[name]
            for layer in sorted({layer for layer, module in keys if module in parts}):
                stacks[(layer, name)] = _stack(adapters, layer, list(parts), shapes, device, dtype)
        return cls(row_slot, scale, stacks)

    @cached_property
    def layout(self) -> TileLayout | None:
        """tile_layout(row_slot), made at the first add and then shared by every projection of the step; the
        C++ stack and the Triton kernel group the rows themselves and never ask for it."""
        return tile_layout(self.row_slot)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """y + this step's LoRA term for projection `module` of `layer` (y unchanged when no adapter of the
        step has it). x: (T, in) the projection's input, y: (T, out) its output."""
        stack = self.stacks.get((layer, module))
        if stack is None:
            return y
        return y + lora_delta(x, self.row_slot, stack[0], stack[1], self.scale, self.layout)


    def kernel_set(self, ops, num_layers: int):
        """These stacks as the C++ kernels' LoraSet (kernels/lora.h; `ops`: cpu_kernels()): per layer, A and B^T
        (float32, contiguous) of KERNEL_PROJECTIONS (the FUSED names and o/down_proj; None where no adapter of the
        set has one), and the scales. Made at the first call and kept with the set (`prepared`), so a step pays
        nothing for it."""
        made = self.prepared.get("cpu")
        if made is None or made[0] is not ops:
            layers = []
            for layer in range(num_layers):
                pairs: list[torch.Tensor | None] = []
                for module in KERNEL_PROJECTIONS:
                    stack = self.stacks.get((layer, module))
                    pairs += [None, None] if stack is None else [
                        stack[0].float().contiguous(), stack[1].float().transpose(1, 2).contiguous()]
                layers.append(pairs)
            made = self.prepared["cpu"] = (ops, ops.LoraSet(layers, self.scale.float().contiguous()))
        return made[1]

    def backend_stacks(self, prepare: Callable[[torch.Tensor, torch.Tensor], object]) -> dict:
        """These stacks as a backend's LoRA kernel takes them: (layer, projection) -> prepare(A, B) (`prepare`: the
        backend's lora_stack, which checks and lays them out). Made at the first call and kept with the set
        (`prepared`, as kernel_set), so a step's projections pay nothing for it."""
        made = self.prepared.get("backend")
        if made is None or made[0] is not prepare:
            made = self.prepared["backend"] = (prepare, {key: prepare(a, b) for key, (a, b) in self.stacks.items()})
        return made[1]


def _stack(adapters: list[LoraAdapter], layer: int, parts: list[str], shapes: dict[str, tuple[int, int]],
           device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A (num_slots, r_max * len(parts), in), B (num_slots, sum of the parts' out, r_max * len(parts))."""
    r_max = max(a.rank for a in adapters)
    in_features = shapes[parts[0]][0]
    outs = [shapes[p][1] for p in parts]
    a_stack = torch.zeros(len(adapters), r_max * len(parts), in_features, dtype=dtype)
    b_stack = torch.zeros(len(adapters), sum(outs), r_max * len(parts), dtype=dtype)
    for slot, adapter in enumerate(adapters):
        row = 0
        for i, part in enumerate(parts):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                a_stack[slot, i * r_max:i * r_max + a.shape[0]] = a
                b_stack[slot, row:row + outs[i], i * r_max:i * r_max + a.shape[0]] = b
            row += outs[i]
    return a_stack.to(device, non_blocking=True), b_stack.to(device, non_blocking=True)   # (no stream sync)


def linear_with_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora: LoraBatch | None, layer: int, module: str) -> torch.Tensor:
    """A plain Linear's forward with the step's adapters: x W^T (+ bias) + lora term. The reference the
    forward's hook (LoraBatch.add after its own linear) is tested against."""
    y = torch.nn.functional.linear(x, weight, bias)
    return y if lora is None else lora.add(y, x, layer, module)
