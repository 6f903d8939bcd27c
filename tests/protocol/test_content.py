"""protocol/content.py: chat content parts checked and named by their place, the images found in order, TGI's
markdown images, and messages as a vision-language chat template reads them."""
from __future__ import annotations

import pytest

from lmi_handler.protocol.content import (
    check_parts,
    image_parts,
    markdown_images,
    replace_markdown_images,
    template_message,
)
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}


def test_image_url_parts_are_taken_and_found_in_order_with_their_place():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look: "}, IMAGE,
                                             {"type": "image_url", "image_url": "https://example.com/b.png"}]}]
    request = ChatCompletionRequest.parse({"messages": messages})
    parts = request.image_parts()
    assert [(p.url, p.field, p.ordinal) for p in parts] == [
        ("data:image/png;base64,AAAA", "messages[1].content[1]", 1),
        ("https://example.com/b.png", "messages[1].content[2]", 2)]
    assert request.text_messages()[1]["content"] == "Look: "          # a text model's template: the text only
    assert request.text_messages(multimodal=True) == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "image"}]}]


@pytest.mark.parametrize(("message", "field", "why"), [
    ({"role": "user", "content": ["hi"]}, "messages[0].content[0]", "type is one of text, image_url"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0]", "needs a string `text`"),
    ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
     "messages[0].content[1]", 'needs "image_url": {"url"'),
    ({"role": "user", "content": [{"type": "input_audio"}]}, "messages[0].content[0]", "type is one of"),
    ({"role": "assistant", "content": [IMAGE]}, "messages[0].content[0]", "user messages only"),
])
def test_a_bad_content_part_is_a_400_naming_its_place(message, field, why):
    with pytest.raises(RequestValidationError) as info:
        check_parts([message])
    assert info.value.field == field and why in info.value.message and info.value.status_code == 400


def test_tgi_markdown_images_take_an_empty_alt_text_and_become_the_placeholder():
    text = "![](https://a.example/x.png)What is ![alt](https://b.example/y.png) this ![](data:image/png;base64,AA)?"
    assert [(p.url, p.field, p.ordinal) for p in markdown_images(text)] == [
        ("https://a.example/x.png", "inputs", 1), ("data:image/png;base64,AA", "inputs", 2)]
    assert replace_markdown_images(text, "<image>") == "<image>What is ![alt](https://b.example/y.png) this <image>?"


def test_a_message_without_content_is_an_empty_part_list_for_a_vision_template():
    assert template_message({"role": "assistant", "content": None}, multimodal=True)["content"] == []
    assert image_parts([{"role": "user", "content": "text only"}]) == []
