"""A request's images turned into a multimodal prompt: each image part loaded (media.py), counted against the
options' limits, and the model's processor run over the prompt text and the images.

Owns the request-side rules (option.limit_mm_per_prompt, the refusal of images by a text-only model naming it,
TGI's markdown images replaced by the model's placeholder) and the checkpoint's processor; the vision tower and
where the image rows go are engine/model/vision/'s, parsing the parts protocol/content.py's.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Callable

from lmi_handler.config import ConfigError, MultimodalOptions
from lmi_handler.engine.model.vision import MultimodalPrompt, VisionFamily, family_of
from lmi_handler.multimodal.media import LoadedImage, load_image
from lmi_handler.protocol.content import ImagePart, markdown_images, replace_markdown_images
from lmi_handler.protocol.errors import RequestValidationError, check_unicode

logger = logging.getLogger(__name__)


class MultimodalInputs:
    """The images side of one loaded model: its processor (None for a text-only model) and the options' limits.

    `processor` runs under `lock`: transformers' processors hold a tokenizer, which the service shares between
    request threads (a Rust tokenizer used from two threads at once can fail with "Already borrowed").
    """

    def __init__(self, options: MultimodalOptions, model_name: str, cfg: dict, lock: threading.Lock | None = None,
                 model_path=None):
        self.options, self.model_name = options, model_name
        self.model_type = cfg.get("model_type", "llama")
        self.family: VisionFamily | None = family_of(cfg)
        self.lock = lock or threading.Lock()
        self.processor = None
        if self.family is not None:
            self.processor = _load_processor(self.family, model_path if model_path is not None else options.model_path)

    @property
    def serves_images(self) -> bool:
        return self.family is not None

    @property
    def chat_template(self) -> str | None:
        """The processor's chat template (vision checkpoints keep it there), None when it has none."""
        if self.processor is None:
            return None
        template = self.processor.chat_template
        return template if isinstance(template, str) else None

    def inputs_text(self, text: str) -> str:
        """An `inputs` string as the processor reads it: TGI's `![](url)` as the model's image placeholder (a
        text-only model keeps the markdown as text, as TGI does)."""
        if self.family is None:
            return text
        return replace_markdown_images(text, self.family.image_placeholder(self.processor))

    def markdown_parts(self, text: str) -> list[ImagePart]:
        """TGI's `![](url)` images of an `inputs` string; none for a text-only model (the markdown is text)."""
        return markdown_images(text) if self.family is not None else []

    def tokenized(self, text: str, parts: list[ImagePart], field: str, encode: Callable[..., list[int]],
                  add_special_tokens: bool = True) -> tuple[str, list[int], MultimodalPrompt | None]:
        """(text, token ids, images) of one prompt: `encode`'s ids (the service's tokenizer, checking `field`'s
        text) when it has no image, else the processor's (TGI's markdown images of an `inputs` string written as
        the placeholder first). Raises RequestValidationError naming the field or the part."""
        self.check_parts(parts)          # a text-only model refuses images, naming itself
        if not parts:
            return text, encode(text, field, add_special_tokens=add_special_tokens), None
        check_unicode(text, field)
        processed = self.inputs_text(text) if field == "inputs" else text
        images = self.prompt(processed, parts, add_special_tokens)
        return text, list(images.token_ids), images

    def prompt(self, text: str, parts: list[ImagePart], add_special_tokens: bool) -> MultimodalPrompt:
        """The prompt of `text` (placeholders already in it, one per part) with the parts' images: loaded,
        counted, processed. Raises RequestValidationError (400) naming the part: an image sent to a text-only
        model, more than option.limit_mm_per_prompt images, an image that cannot be loaded or processed."""
        self.check_parts(parts)
        loaded = [load_image(part, self.options) for part in parts]
        return self._process(text, parts, loaded, add_special_tokens)

    def check_parts(self, parts: list[ImagePart]) -> None:
        """Raises RequestValidationError for images a text-only model is sent, or more than the limit."""
        if not parts:
            return
        if self.family is None:
            raise parts[0].error(f"the model {self.model_name!r} (model_type {self.model_type}) takes text only; "
                                 "images need a vision-language model (docs/images.md)")
        limit = self.options.limit_mm_per_prompt
        if len(parts) > limit:
            raise parts[limit].error(f"a prompt takes at most {limit} images (option.limit_mm_per_prompt), this "
                                     f"one has {len(parts)}")

    def _process(self, text: str, parts: list[ImagePart], loaded: list[LoadedImage],
                 add_special_tokens: bool) -> MultimodalPrompt:
        placeholder = self.family.image_placeholder(self.processor)
        if text.count(placeholder) != len(parts):
            field = parts[0].field if parts else "messages"
            raise RequestValidationError(field, f"Invalid prompt: {len(parts)} images but {text.count(placeholder)} "
                                         f"image placeholders ({placeholder!r}) in the rendered prompt: each image "
                                         "needs its place in the text")
        try:
            with self.lock:
                prompt = self.family.prepare(self.processor, text, [image.image for image in loaded],
                                             add_special_tokens)
        except (ValueError, TypeError) as exc:      # the processor refuses the picture (its size, its shape)
            raise parts[0].error(f"the model's processor cannot take it: {str(exc)[:160]}") from None
        images = tuple(replace(image, content_hash=source.content_hash)
                       for image, source in zip(prompt.images, loaded))
        return replace(prompt, images=images)


def _load_processor(family: VisionFamily, model_path):
    """The checkpoint's processor as its family loads it (PIL image processors: torchvision is not needed).
    Raises ConfigError."""
    try:
        return family.load_processor(model_path)
    except Exception as exc:  # noqa: BLE001 - any failure to build it is a start-up refusal naming why
        raise ConfigError(f"the vision-language checkpoint {model_path} has no processor transformers can load "
                          f"(processor_config.json / preprocessor_config.json): {exc}") from None
