"""A step's image rows: which flat rows of its prefill chunks are image positions, and their embeddings.

Owns when an image is encoded (the first chunk that reaches one of its positions; kept on the Sequence until its
prompt is past the image, so a chunked prefill encodes it once) and slicing the rows a chunk holds; the encoder is
engine/model/vision/'s, putting the rows into the input embeddings forward.py's.
"""
from __future__ import annotations

import torch

from lmi_handler.engine.sequence import Sequence


def step_image_rows(encoder, seqs: list[Sequence], counts: list[int],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows (K,) int64, embeddings (K, hidden)) on `device` for every image position this step computes, or None.

    Sequence j computes positions [c, c + counts[j]) (c = its num_computed_tokens) at flat rows starting at the
    sum of the counts before it; an image position p there is row (p - c) + that offset, its embedding the
    image's row for p. An image whose positions the sequence has all computed is dropped from its cache.
    """
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    offset = 0
    for seq, n in zip(seqs, counts):
        prompt = seq.params.multimodal
        start = seq.num_computed_tokens
        for k, image in enumerate(prompt.images if prompt is not None else ()):
            if image.end <= start:
                seq.image_embeds.pop(k, None)
                continue
            if image.start >= start + n:
                continue
            embeds = seq.image_embeds.get(k)
            if embeds is None:
                embeds = seq.image_embeds[k] = encoder.encode(image)          # (image.num_tokens, hidden)
            positions = torch.tensor(image.positions(), dtype=torch.int64)
            inside = (positions >= start) & (positions < start + n)
            rows.append(positions[inside] - start + offset)
            values.append(embeds[inside.to(embeds.device)])
        offset += n
    if not rows:
        return None
    return torch.cat(rows).to(device, non_blocking=True), torch.cat(values)
