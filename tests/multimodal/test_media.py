"""multimodal/media.py: an image part from a data: URL, an http(s) URL (a local server) or a file, under the
options' bounds; every refusal a 400 naming the part and why."""
from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from lmi_handler.config import MultimodalOptions
from lmi_handler.multimodal.media import load_image
from lmi_handler.protocol.content import ImagePart
from lmi_handler.protocol.errors import RequestValidationError


def _encoded(fmt: str, size=(12, 8), color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _part(url: str) -> ImagePart:
    return ImagePart(url, "messages[0].content[1]", 1)


def _refusal(url: str, options: MultimodalOptions | None = None) -> str:
    with pytest.raises(RequestValidationError) as info:
        load_image(_part(url), options or MultimodalOptions())
    err = info.value
    assert err.status_code == 400 and err.field == "messages[0].content[1]"
    assert err.message.startswith("Invalid image `messages[0].content[1]` (image 1 of the request): ")
    return err.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_base64_data_url_of_png_jpeg_or_webp_decodes_to_rgb_with_a_pixel_hash(fmt):
    loaded = load_image(_part(_data_url(_encoded(fmt), f"image/{fmt.lower()}")), MultimodalOptions())
    assert loaded.image.mode == "RGB" and loaded.image.size == (12, 8) and len(loaded.content_hash) == 32
    again = load_image(_part(_data_url(_encoded(fmt), f"image/{fmt.lower()}")), MultimodalOptions())
    other = load_image(_part(_data_url(_encoded(fmt, color=(1, 2, 3)), f"image/{fmt.lower()}")), MultimodalOptions())
    assert again.content_hash == loaded.content_hash != other.content_hash


@pytest.mark.parametrize(("url", "why"), [
    ("data:image/png;base64,@@@@", "base64 does not decode"),
    ("data:image/png," + "abc", "data:image/<format>;base64"),
    ("data:text/plain;base64,aGk=", "must hold an image"),
    (_data_url(b"not an image at all"), "no image this server decodes"),
    ("ftp://example.com/a.png", "must be a data: URL"),
    ("a.png", "must be a data: URL"),
])
def test_undecodable_or_unknown_urls_answer_400_naming_the_part_and_why(url, why):
    assert why in _refusal(url)


def test_an_image_past_the_byte_or_pixel_bounds_is_refused_before_decoding():
    big = _data_url(_encoded("PNG", size=(300, 300)))
    assert "option.max_media_bytes=1024" in _refusal(_data_url(b"x" * 2000), MultimodalOptions(max_media_bytes=1024))
    assert "300 x 300 pixels" in _refusal(big, MultimodalOptions(max_image_pixels=10_000))


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(1.0)
        status, body = (404, b"") if self.path == "/missing.png" else (200, _encoded("PNG"))
        if self.path == "/big.png":
            body = body + b"\0" * 4096
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):    # the client gave up first (the time bound's test)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_http_image_is_fetched_within_the_domain_size_and_time_bounds(image_host):
    assert load_image(_part(image_host + "/a.png"), MultimodalOptions()).image.size == (12, 8)
    allowed = MultimodalOptions(allowed_media_domains="127.0.0.1")
    assert load_image(_part(image_host + "/a.png"), allowed).image.size == (12, 8)
    assert "allow_remote_media=false" in _refusal(image_host + "/a.png", MultimodalOptions(allow_remote_media=False))
    assert "not in option.allowed_media_domains (example.com)" in _refusal(
        image_host + "/a.png", MultimodalOptions(allowed_media_domains="example.com"))
    assert "answered HTTP 404" in _refusal(image_host + "/missing.png")
    assert "option.max_media_bytes=1024" in _refusal(image_host + "/big.png", MultimodalOptions(max_media_bytes=1024))
    assert "media_fetch_timeout_s=0.2" in _refusal(image_host + "/slow.png", MultimodalOptions(media_fetch_timeout_s=0.2))


def test_a_local_path_is_read_only_under_the_allowed_directory(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(_encoded("PNG"))
    (tmp_path / "secret.png").write_bytes(_encoded("PNG"))
    options = MultimodalOptions(allowed_local_media_path=str(tmp_path / "ok"))
    assert load_image(_part(str(tmp_path / "ok" / "a.png")), options).image.size == (12, 8)
    assert load_image(_part(f"file://{tmp_path / 'ok' / 'a.png'}"), options).image.size == (12, 8)
    assert "outside option.allowed_local_media_path" in _refusal(str(tmp_path / "ok" / ".." / "secret.png"), options)
    assert "allowed_local_media_path is unset" in _refusal(str(tmp_path / "ok" / "a.png"))
