"""An image part's bytes from where its URL points (data:, http(s), a local file) and decoded with Pillow, under the
options' bounds; each refusal names the part and why.

Owns the sources' rules (option.allow_remote_media, allowed_media_domains, allowed_local_media_path), the size,
time and pixel bounds and the image's content hash; what the model does with the picture is the processor's.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lmi_handler.config import MultimodalOptions
from lmi_handler.protocol.content import ImagePart
from lmi_handler.protocol.errors import RequestValidationError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")     # what Pillow decodes for us here


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image (RGB) and the hash of its pixels: the prefix cache's key for it."""

    image: object            # PIL.Image.Image, mode RGB
    content_hash: bytes      # BLAKE2b-256 of mode, size and pixels


def load_image(part: ImagePart, options: MultimodalOptions) -> LoadedImage:
    """The image `part` names, decoded. Raises RequestValidationError (400) naming the part: a URL of no allowed
    kind, a refused or failed fetch, too many bytes or pixels, bytes that are no image."""
    url = part.url.strip()
    scheme = urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        data = _data_url(part, url, options)
    elif scheme in ("http", "https"):
        data = _fetch(part, url, options)
    elif scheme == "file" or (scheme == "" and url.startswith("/")):
        data = _local_file(part, unquote(urlsplit(url).path) if scheme else url, options)
    else:
        raise part.error("the URL must be a data: URL (base64 PNG, JPEG or WebP), an http(s) URL or a local path "
                         f"under option.allowed_local_media_path, got {url[:60]!r}")
    return decode_image(part, data, options)


def _data_url(part: ImagePart, url: str, options: MultimodalOptions) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise part.error("a data: URL must be data:image/<format>;base64,<bytes>")
    if not header.startswith("image/"):
        raise part.error(f"a data: URL must hold an image (data:image/...), got data:{header[:40]}")
    if len(payload) * 3 // 4 > options.max_media_bytes:
        raise part.error(f"the image has more than option.max_media_bytes={options.max_media_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise part.error("the data: URL's base64 does not decode") from None


def _fetch(part: ImagePart, url: str, options: MultimodalOptions) -> bytes:
    """The bytes at an http(s) URL: allowed by the options, at most max_media_bytes, within the time bound."""
    import httpx

    if not options.allow_remote_media:
        raise part.error("http(s) images are refused on this server (option.allow_remote_media=false); send the "
                         "image inline as a data: URL")
    host = (urlsplit(url).hostname or "").lower()
    allowed = options.allowed_media_domains
    if allowed is not None and not any(host == d or host.endswith("." + d) for d in allowed):
        raise part.error(f"the host {host!r} is not in option.allowed_media_domains ({', '.join(allowed)})")
    timeout = httpx.Timeout(options.media_fetch_timeout_s)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False) as client, client.stream("GET", url) as reply:
            if reply.status_code != 200:
                raise part.error(f"fetching {url[:80]!r} answered HTTP {reply.status_code}")
            chunks, size = [], 0
            for chunk in reply.iter_bytes():
                size += len(chunk)
                if size > options.max_media_bytes:
                    raise part.error(f"the image has more than option.max_media_bytes={options.max_media_bytes} "
                                     "bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException:
        raise part.error(f"fetching {url[:80]!r} took longer than option.media_fetch_timeout_s="
                         f"{options.media_fetch_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise part.error(f"fetching {url[:80]!r} failed: {type(exc).__name__}: {str(exc)[:120]}") from None


def _local_file(part: ImagePart, path_text: str, options: MultimodalOptions) -> bytes:
    root = options.local_media_root()
    if root is None:
        raise part.error("local image paths are refused on this server (option.allowed_local_media_path is unset)")
    path = Path(path_text).resolve()
    if not path.is_relative_to(root):
        raise part.error(f"the path is outside option.allowed_local_media_path ({root})")
    if not path.is_file():
        raise part.error("no such file under option.allowed_local_media_path")
    if path.stat().st_size > options.max_media_bytes:
        raise part.error(f"the image has more than option.max_media_bytes={options.max_media_bytes} bytes")
    return path.read_bytes()


def decode_image(part: ImagePart, data: bytes, options: MultimodalOptions) -> LoadedImage:
    """`data` decoded into an RGB image: a format of IMAGE_FORMATS, at most option.max_image_pixels (checked on
    the header, before the pixels are decompressed). Raises RequestValidationError naming the part."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
            width, height = image.size
            if width * height > options.max_image_pixels:
                raise part.error(f"the image is {width} x {height} pixels, more than option.max_image_pixels="
                                 f"{options.max_image_pixels}")
            image = image.convert("RGB")
    except RequestValidationError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise part.error(f"the bytes are no image this server decodes ({', '.join(IMAGE_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise part.error(f"the image does not decode: {str(exc)[:120]}") from None
    digest = hashlib.blake2b(f"{image.mode}:{image.size}".encode(), digest_size=32)
    digest.update(image.tobytes())
    return LoadedImage(image, digest.digest())
