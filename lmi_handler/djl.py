"""Input / Output of the DJL handler contract: djl_python's when importable, else our own twins.

Owns the byte formats of DESIGN §2 (batch_NNN keys, binary_encode); what a request means is
protocol/'s business and what to answer is handler.py's.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Iterator

from lmi_handler.protocol.errors import GENERATION_ERROR_CODE


class CaseInsensitiveDict(dict):
    """str -> str map whose lookups ignore case, as the front end's properties do (DESIGN §2)."""

    def __init__(self, data: dict[str, str] | None = None):
        super().__init__()
        self._lower: dict[str, str] = {}
        for key, value in (data or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self._lower[key.lower()] = key

    def _real(self, key: str) -> str | None:
        return key if dict.__contains__(self, key) else self._lower.get(key.lower())

    def __getitem__(self, key: str) -> str:
        real = self._real(key)
        if real is None:
            raise KeyError(key)
        return super().__getitem__(real)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._real(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        real = self._real(key)
        return default if real is None else super().__getitem__(real)


class PairList:
    """An ordered list of (key, value) pairs, as djl_python keeps Input/Output content."""

    def __init__(self, pairs: list[tuple[str, Any]] | None = None):
        self.pairs: list[tuple[str, Any]] = list(pairs or [])

    def add(self, key: str, value: Any) -> None:
        self.pairs.append((key, value))

    def get(self, key: str) -> Any:
        for k, v in self.pairs:
            if k == key:
                return v
        return None

    def key_at(self, index: int) -> str:
        return self.pairs[index][0]

    def value_at(self, index: int) -> Any:
        return self.pairs[index][1]

    def get_keys(self) -> list[str]:
        return [k for k, _ in self.pairs]

    def get_values(self) -> list[Any]:
        return [v for _, v in self.pairs]

    def size(self) -> int:
        return len(self.pairs)

    def is_empty(self) -> bool:
        return not self.pairs

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


class OwnInput:
    """One call's input: `properties` (str -> str, case-insensitive) and `content` (PairList of bytes).

    A batched call has the property `batch_size`; item i's keys are `batch_{i:03d}.{name}`
    (djl_python takes the index from characters 6-8 and the name from character 10 on).
    """

    def __init__(self, properties: dict[str, str] | None = None, content: PairList | None = None):
        self.properties = CaseInsensitiveDict(properties)
        self.content = content if content is not None else PairList()

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        return self.properties.get(key)

    def get_content(self) -> PairList:
        return self.content

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list["OwnInput"]:
        """Split a batched call into one OwnInput per item, in index order (djl_python's parser rule)."""
        if not self.is_batch():
            return [self]
        items = [OwnInput() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if key.startswith("batch_") and len(key) > 10 and key[6:9].isdigit():
                items[int(key[6:9])].properties[key[10:]] = value
        for key, value in self.content:
            if key.startswith("batch_") and len(key) > 10 and key[6:9].isdigit():
                items[int(key[6:9])].content.add(key[10:], value)
        return items

    def get_as_bytes(self, key: str | None = None) -> bytes:
        if self.content.is_empty():
            return b""
        value = self.content.get(key) if key else self.content.value_at(0)
        if value is None:
            return b""
        return value.encode("utf-8") if isinstance(value, str) else bytes(value)

    def get_as_string(self, key: str | None = None) -> str:
        return self.get_as_bytes(key).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        return json.loads(self.get_as_bytes(key))


class OwnOutput:
    """One call's answer: code, message, properties and content pairs (DESIGN §2 byte formats)."""

    def __init__(self, code: int = 200, message: str = "OK"):
        self.code = code
        self.message = message
        self.properties: dict[str, str] = {}
        self.content = PairList()
        self.stream_content: tuple[Iterator, Any] | None = None

    def set_code(self, code: int) -> "OwnOutput":
        self.code = code
        return self

    def set_message(self, message: str) -> "OwnOutput":
        self.message = message
        return self

    def add_property(self, key: str, value: str) -> "OwnOutput":
        self.properties[key] = value
        return self

    def error(self, error: str, code: int = GENERATION_ERROR_CODE, message: str = "prediction failure") -> "OwnOutput":
        """Mark the whole call failed; the body is {"code", "message", "error"}."""
        self.code = code
        self.message = message
        self.content = PairList()
        self.add_as_json({"code": code, "message": message, "error": error})
        return self

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> "OwnOutput":
        """Store `value` under `key` (or "data"), as `batch_{i}.{key}` when `batch_index` is given."""
        if key is None:
            key = "data"
        if batch_index is not None:
            key = f"batch_{batch_index}.{key}"
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif isinstance(value, bytearray):
            value = bytes(value)
        elif not isinstance(value, bytes):
            value = json.dumps(value).encode("utf-8")
        self.content.add(key, value)
        return self

    def add_as_json(self, value: Any, key: str | None = None, batch_index: int | None = None) -> "OwnOutput":
        self.add_property("content-type", "application/json")
        return self.add(json.dumps(value, ensure_ascii=False).encode("utf-8"), key, batch_index)

    def add_stream_content(self, stream: Iterator, output_formatter: Any = None) -> "OwnOutput":
        self.stream_content = (stream, output_formatter)
        return self

    @staticmethod
    def binary_encode(data: dict[str, Any]) -> bytes:
        """Pack a str -> str map: big-endian short count, then (int length, UTF-8 bytes) per key and value."""
        parts = [struct.pack(">h", len(data))]
        for key, value in data.items():
            for item in (key, value):
                raw = item.encode("utf-8") if isinstance(item, str) else str(item).encode("utf-8")
                parts.append(struct.pack(">i", len(raw)))
                parts.append(raw)
        return b"".join(parts)


def binary_decode(raw: bytes) -> dict[str, str]:
    """Inverse of `binary_encode` (what the front end does with each rolling-batch entry)."""
    (count,), offset = struct.unpack_from(">h", raw, 0), 2
    result: dict[str, str] = {}
    for _ in range(count):
        pair = []
        for _ in range(2):
            (length,) = struct.unpack_from(">i", raw, offset)
            offset += 4
            pair.append(raw[offset:offset + length].decode("utf-8"))
            offset += length
        result[pair[0]] = pair[1]
    return result


try:  # inside a real DJL container its classes must be the ones used (DESIGN §2)
    from djl_python.inputs import Input  # type: ignore
    from djl_python.outputs import Output  # type: ignore
except ImportError:  # pragma: no cover - depends on the environment
    Input = OwnInput  # type: ignore[misc,assignment]
    Output = OwnOutput  # type: ignore[misc,assignment]
