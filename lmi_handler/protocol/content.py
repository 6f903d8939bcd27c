"""Chat content parts and TGI's markdown images: which parts a message may hold, where its images are, and the
messages as a chat template reads them.

Owns the shapes (OpenAI's text and image_url parts; TGI's `![](url)` in `inputs`) and naming a part in errors
(`messages[0].content[1]`); fetching and decoding an image is lmi_handler/multimodal/'s, expanding it into
tokens the model's processor's.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from lmi_handler.protocol.errors import RequestValidationError, show_value

# TGI's rule (router/src/validation.rs): an image is `![](url)`, alt text empty, the URL up to the first ")"
MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)]*)\)")
PART_TYPES = ("text", "image_url")


@dataclass(frozen=True)
class ImagePart:
    """One image a request carries: its URL (data:, http(s), file:// or a path) and how errors name it."""

    url: str
    field: str        # e.g. "messages[0].content[1]" or "inputs"
    ordinal: int      # 1 for the request's first image

    def error(self, why: str, status_code: int = 400) -> RequestValidationError:
        """The 400 for this image: the part's place and why."""
        return RequestValidationError(self.field, f"Invalid image `{self.field}` (image {self.ordinal} of the "
                                      f"request): {why}", status_code)


def is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def check_parts(messages: list[dict[str, Any]]) -> None:
    """Every list content's parts: text parts {"type": "text", "text"} and image parts {"type": "image_url",
    "image_url": {"url", "detail"?}} (or the URL as a string), images in user messages only. Raises
    RequestValidationError naming the part (`messages[i].content[j]`)."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise RequestValidationError(field, f"Invalid content part `{field}`: must be an object whose type is "
                                             f"one of {', '.join(PART_TYPES)}, got {show_value(part)}")
            if kind == "text" and not is_text_part(part):
                raise RequestValidationError(field, f"Invalid content part `{field}`: a text part needs a string "
                                             "`text`")
            if kind == "image_url":
                _image_url(part, field)
                if message.get("role") != "user":
                    raise RequestValidationError(field, f"Invalid content part `{field}`: images are taken in user "
                                                 f"messages only, not in a {message.get('role')} message")


def _image_url(part: dict, field: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestValidationError(field, f"Invalid content part `{field}`: an image_url part needs "
                                     '"image_url": {"url": "data:..." or "http(s)://..."}')
    return url


def image_parts(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The images of checked messages (check_parts), in order."""
    found: list[ImagePart] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") == "image_url":
                field = f"messages[{i}].content[{j}]"
                found.append(ImagePart(_image_url(part, field), field, len(found) + 1))
    return found


def markdown_images(text: str) -> list[ImagePart]:
    """TGI's markdown images in an `inputs` string, in order."""
    return [ImagePart(m.group(1), "inputs", n + 1) for n, m in enumerate(MARKDOWN_IMAGE.finditer(text))]


def replace_markdown_images(text: str, placeholder: str) -> str:
    """`text` with each `![](url)` written as the model's image placeholder (TGI: the image in its place)."""
    return MARKDOWN_IMAGE.sub(lambda _: placeholder, text)


def template_message(message: dict[str, Any], multimodal: bool = False) -> dict[str, Any]:
    """A message as chat templates expect it. Text models: text parts joined into one string. Vision-language
    models (`multimodal`): content always a list of parts, {"type": "text", "text"} and {"type": "image"} (the
    templates of Idefics3 / SmolVLM, LLaVA and Qwen2-VL write their image placeholder for it; vLLM's "openai"
    content format). Both: a legacy `function` message as `tool`, tool calls' JSON arguments as objects."""
    content = message.get("content")
    if multimodal:
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        out = {**message, "content": [{"type": "image"} if p.get("type") == "image_url" else
                                      {"type": "text", "text": p["text"]} for p in parts]}
    else:
        out = {**message, "content": "".join(p["text"] for p in content if is_text_part(p)) if isinstance(content, list)
               else content or ""}
    if out["role"] == "function":          # legacy function result
        out["role"] = "tool"
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_with_argument_object(call) for call in calls]
    return out


def _with_argument_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
