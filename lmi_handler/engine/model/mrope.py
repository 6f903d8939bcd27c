"""M-RoPE's position streams of a prompt (Qwen2-VL, Qwen2.5-VL): temporal, height and width, per token.

Owns where each prompt token sits on the three streams (transformers' Qwen2VLModel.get_rope_index for images)
and the streams of any slice of a sequence's tokens, prompt or generated (MropePositions.rows). Leaves the
rotary arithmetic to spec.py (RopeSpec.mrope_section, mrope_cos_sin_rows) and forward.DecoderModel, and the
image grids to the processor (engine/model/vision/qwen2_vl.py).

    text   t0 t1 [img: grid (1, 4, 6) merged 2x2 -> 2 x 3 tokens] t2 ...
    T      0  1   2 2 2 2 2 2                                     5
    H      0  1   2 2 2 3 3 3                                     5
    W      0  1   2 3 4 2 3 4                                     5
An image's tokens start every stream at the next text position; the text after it continues from
start + max(merged height, merged width). Generated token p (p >= the prompt's length) sits at p + delta
on all three, delta = the prompt's largest position + 1 - its length (transformers' rope_deltas).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MropePositions:
    """One sequence's M-RoPE positions: `prompt` (3, P) int64 for its P prompt tokens, `delta` for every later
    token (all three streams at p + delta). A prompt without images has prompt = arange(P) on each stream
    and delta 0: (T,) positions, today's."""

    prompt: torch.Tensor
    delta: int

    def rows(self, start: int, n: int) -> torch.Tensor:
        """(3, n) int64: the streams of tokens [start, start + n) of the sequence (prompt or generated)."""
        num_prompt = self.prompt.shape[1]
        head = self.prompt[:, start:start + n]
        if head.shape[1] == n:
            return head
        first = max(start, num_prompt)
        tail = torch.arange(first, start + n, dtype=torch.int64) + self.delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)

    def is_text(self, start: int, n: int) -> bool:
        """Whether tokens [start, start + n) sit at equal positions on the three streams (no image token), so a
        (T,) position p + offset(start) serves them: offset is 0 in the prompt's text before its first image
        and delta after the prompt."""
        return start >= self.prompt.shape[1] or bool((self.prompt[:, start:start + n] == self.prompt[0, start]
                                                      + torch.arange(min(n, self.prompt.shape[1] - start))).all())


def image_positions(start: int, grid_thw: tuple[int, int, int], spatial_merge_size: int) -> torch.Tensor:
    """(3, t * h * w / merge ** 2) int64: an image's tokens' streams (transformers' get_vision_position_ids with
    time_interval 1): row-major over the merged grid, each stream offset by `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def mrope_positions(token_ids: list[int], image_token_id: int, image_grids: list[tuple[int, int, int]],
                    spatial_merge_size: int) -> MropePositions:
    """The prompt's M-RoPE positions (module docstring). The image tokens are image_token_id's runs, consumed
    one image at a time in order: image i takes t * h * w / merge ** 2 tokens of image_grids[i] (t, h, w in
    patches). Raises ValueError when the image tokens and the grids disagree in number."""
    chunks, pos, i, image = [], 0, 0, 0
    ids = torch.tensor(token_ids, dtype=torch.int64)
    is_image = (ids == image_token_id).tolist()
    while i < len(token_ids):
        if not is_image[i]:
            j = i
            while j < len(token_ids) and not is_image[j]:
                j += 1
            chunks.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if image >= len(image_grids):
            raise ValueError(f"the prompt holds more image tokens than its {len(image_grids)} images take")
        grid = image_grids[image]
        tokens = image_positions(pos, grid, spatial_merge_size)
        if not all(is_image[i:i + tokens.shape[1]]) or i + tokens.shape[1] > len(token_ids):
            raise ValueError(f"image {image} (grid {tuple(grid)}) needs {tokens.shape[1]} image tokens in a row")
        chunks.append(tokens)
        pos += max(grid[1], grid[2]) // spatial_merge_size
        i, image = i + tokens.shape[1], image + 1
    if image != len(image_grids):
        raise ValueError(f"the prompt's image tokens take {image} of its {len(image_grids)} images")
    prompt = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.int64)
    delta = int(prompt.max()) + 1 - len(token_ids) if len(token_ids) else 0
    return MropePositions(prompt.contiguous(), delta)
