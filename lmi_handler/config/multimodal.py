"""The multimodal part of the settings: where a request's images may come from and how many and how large.

Owns option.limit_mm_per_prompt, allow_remote_media, allowed_media_domains, allowed_local_media_path and the
fetch and size bounds; loading and checking an image is lmi_handler/multimodal/'s (docs/images.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, field_validator

from lmi_handler.config.base import Options, split_keys


class MultimodalOptions(Options):
    """Images: where they may come from, how many a prompt takes and how large each may be."""

    limit_mm_per_prompt: int = Field(8, ge=0, le=1024)
    """Images one prompt (one chat request, one `inputs` string) may carry, [0, 1024]; more answers 400. vLLM's
    JSON form {"image": N} is read too. 0 refuses every image."""
    allow_remote_media: bool = True
    """Fetch http(s) image URLs (vLLM fetches them too). false: an http(s) image answers 400 naming this option;
    data: URLs and allowed local files still work."""
    allowed_media_domains: tuple[str, ...] | None = None
    """Comma-separated host names an http(s) image may come from (a name also allows its subdomains); unset:
    any host (vLLM's --allowed-media-domains)."""
    allowed_local_media_path: str | None = None
    """A directory whose files a request may name as images (file:// URLs or plain absolute paths); unset:
    local paths answer 400 (vLLM's --allowed-local-media-path). Relative paths start at model_dir."""
    media_fetch_timeout_s: float = Field(10.0, gt=0, le=600)
    """Seconds an http(s) image fetch may take in all, (0, 600]; past it the request answers 400."""
    max_media_bytes: int = Field(20 * 1024 * 1024, ge=1024)
    """Bytes one image may have (encoded: a data: URL's decoded bytes, a download, a file), >= 1024; default
    20 MiB."""
    max_image_pixels: int = Field(64 * 1024 * 1024, ge=1)
    """Pixels (width x height) one decoded image may have, >= 1; default 64 Mi (a PNG that decompresses past
    it answers 400 before it is decoded)."""

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _vllm_form(cls, value):
        """vLLM's {"image": N} (as JSON text or a dict): the image count."""
        if isinstance(value, str) and value.strip().startswith("{"):
            value = json.loads(value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"image"})
            if unknown:
                raise ValueError(f"only images are served: {unknown} cannot be limited here")
            return value.get("image", 8)
        return value

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _domains(cls, value):
        if isinstance(value, str):
            return tuple(d.lower().lstrip(".") for d in split_keys(value)) or None
        return value

    def local_media_root(self) -> Path | None:
        """option.allowed_local_media_path resolved (relative to model_dir), or None when unset."""
        if not self.allowed_local_media_path:
            return None
        path = Path(self.allowed_local_media_path)
        return (path if path.is_absolute() else Path(self.model_dir) / path).resolve()
