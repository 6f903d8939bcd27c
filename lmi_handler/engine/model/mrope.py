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

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MropePositions:
    """One sequence's M-RoPE positions: `prompt` (3, P) int64 for its P prompt tokens, `delta` for every later
    token (all three streams at p + delta)."""

    prompt: torch.Tensor
    delta: int

    def rows(self, start: int, n: int) -> torch.Tensor:
        """(3, n) int64: the streams of tokens [start, start + n) of the sequence (prompt or generated)."""
        head = self.prompt[:, start:start + n]
        if head.shape[1] == n:
            return head
        first = max(start, self.prompt.shape[1])
        tail = torch.arange(first, start + n, dtype=torch.int64) + self.delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)


def image_positions(start: int, grid_thw: tuple[int, int, int], spatial_merge_size: int) -> torch.Tensor:
    """(3, t * h * w / merge ** 2) int64: an image's tokens' streams (transformers' get_vision_position_ids with
    time_interval 1): row-major over the merged grid, each stream offset by `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]],
                    spatial_merge_size: int) -> MropePositions:
    """The positions of a prompt of `num_tokens` tokens whose images (in prompt order) are (first token, grid
    (t, h, w) in patches): image i takes tokens [first, first + t h w / merge²). Raises ValueError for images
    that overlap or run past the prompt."""
    chunks, pos, i = [], 0, 0
    for first, grid in images:
        if first < i:
            raise ValueError(f"an image at token {first} overlaps the one before it (which ends at {i})")
        chunks.append(torch.arange(pos, pos + first - i).expand(3, -1))
        pos += first - i
        tokens = image_positions(pos, grid, spatial_merge_size)
        chunks.append(tokens)
        pos += max(grid[1], grid[2]) // spatial_merge_size
        i = first + tokens.shape[1]
    if i > num_tokens:
        raise ValueError(f"the prompt's last image ends at token {i}, past its {num_tokens} tokens")
    chunks.append(torch.arange(pos, pos + num_tokens - i).expand(3, -1))
    prompt = torch.cat(chunks, dim=1).contiguous()
    delta = int(prompt.max()) + 1 - num_tokens if num_tokens else 0
    return MropePositions(prompt, delta)


class MropeSteps:
    """A runner's M-RoPE: each step's positions from its sequences' images (SamplingParams.multimodal, a
    vision.MultimodalPrompt whose images carry image_grid_thw), a prompt's streams computed once (kept while its
    MultimodalPrompt lives)."""

    def __init__(self, spatial_merge_size: int):
        self.merge = spatial_merge_size
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def streams(self, prompt) -> MropePositions:
        found = self._streams.get(prompt)
        if found is None:
            images = [(image.start, tuple(image.pixel_inputs["image_grid_thw"][0].tolist())) for image in prompt.images]
            found = self._streams[prompt] = mrope_positions(len(prompt.token_ids), images, self.merge)
        return found

    def step_positions(self, seqs: list, counts: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The step's positions from `positions` (T,) (each row's token index, prepare_host's, changed in place):
        (T,) while no row is at or past a prompt's first image, an image prompt's generated tokens moved by its
        delta; else (3, T), those rows' three streams (every other row's three the same: the rows of its (T,)
        position, bit for bit)."""
        rows: list[tuple[int, torch.Tensor]] = []
        row = 0
        for seq, n in zip(seqs, counts):
            prompt = seq.params.multimodal
            if prompt is not None and prompt.images:
                streams, start = self.streams(prompt), seq.num_computed_tokens
                if start >= streams.prompt.shape[1]:               # generated tokens: p + delta on all three
                    positions[row:row + n] += streams.delta
                elif start + n > prompt.images[0].start:         # from the first image on: its streams
                    rows.append((row, streams.rows(start, n)))
            row += n
        if not rows:
            return positions
        out = positions.expand(3, -1).clone()
        for row, streams in rows:
            out[:, row:row + streams.shape[1]] = streams
        return out
