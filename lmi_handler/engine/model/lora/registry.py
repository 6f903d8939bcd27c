"""The loaded adapters by name: least recently used first, evicted past option.max_cpu_loras unless a running
request holds them."""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Mapping

from lmi_handler.engine.model.lora.adapters import LoraAdapter, LoraError, LoraLimits, load_adapter


class AdapterRegistry:
    """The loaded adapters by name, least recently used first (thread-safe: routes load while the engine runs).

    Loading past limits.max_cpu_loras evicts the least recently used adapter that no running request holds
    (`held()` names those, the engine's live sequences); when every one is held the load is refused (503).
    Unloading takes the name away at once; requests already running keep their LoraAdapter object.
    `sparse_layers`: the base's mixture-of-experts layers, whose MLPs an adapter may not name (load_adapter).
    """

    def __init__(self, config: Mapping, limits: LoraLimits, held: Callable[[], Iterable[str]] = tuple,
                 sparse_layers: frozenset[int] = frozenset()):
        self.config, self.limits, self.held, self.sparse_layers = dict(config), limits, held, sparse_layers
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.num_loads = self.num_evictions = 0

    def load(self, name: str, path: str | Path, check_root: bool = True) -> LoraAdapter:
        """Read, check and register an adapter. Raises LoraError: 400 a bad adapter, 409 the name is loaded,
        503 no room (every loaded adapter held). Nothing changes when it raises."""
        with self._lock:
            if name in self._adapters:
                raise LoraError(f"adapter {name!r} is already loaded (unload it first)", 409, "name")
        adapter = load_adapter(name, path, self.config, self.limits, check_root,      # slow part: unlocked
                               self.sparse_layers)
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
