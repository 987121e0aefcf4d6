"""Rope with LongRoPE's two factor sets (Phi-3 / Phi-3.5 / Phi-4-mini) and partial rotary.

LongRoPE (`rope_type` "longrope", spelled "su" in older Phi-3 configs) divides the frequencies by
`short_factor` while a sequence is at most `original_max_position_embeddings` long and by
`long_factor` once it is longer, and scales cos/sin by one attention factor either way; the
frequencies and that factor come from transformers' own init function, so they are its numbers.
Transformers picks the set per forward from the largest position it sees (`longrope_frequency_update`):
a whole prompt longer than the original length is rotated with the long factors, and so is every
later token, while a shorter prompt keeps the short ones until decoding passes the length.
The same rule here is per sequence and per step: a sequence longer than the original length (all
its known tokens, `ForwardBatch.seq_lens`, so a prompt prefilled in chunks counts whole) takes the
long set for this step's tokens. What differs: transformers' `generate` recomputes a sequence whose
decoding crosses the length (all of it then on the long set), while here its cached prefix stays as
computed, on the short set, as transformers' model itself does when fed token by token with a cache.
(The prefix cache keeps long sequences' blocks apart: `KVCacheSpec.rope_switch_length`.)
The two sets are one table, short rows [0, original) then long rows [original, original + P):
`rope_positions` turns positions into row indices once per step, so every layer (and the C decoder
stack) just reads the table at those rows.

Partial rotary (`partial_rotary_factor`, Phi-4-mini: 0.75) rotates the first `rotary_dim` dims of
each head and passes the rest through, as transformers does; the C rope kernel takes whole heads
only, so those heads take the torch path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.layers.fused_cpu import rotary_
from loraserve.layers.rotary import RotaryEmbedding, rope_parameters

LONGROPE_TYPES = ("longrope", "su")


class LongRoPERotaryEmbedding(RotaryEmbedding):
    """Rope for `rope_type` "default" or "longrope", over the first `rotary_dim` dims of each head.

    `head_dim` is the rotary width (the tables' width), as `RotaryEmbedding.head_dim` is, so callers
    that need whole-head rope (the decoder stack) see a partial one as another width. A subclass so
    that whatever takes a `RotaryEmbedding` (the loader's `cover`, the layers) takes it; it builds
    its own tables, hence no `RotaryEmbedding.__init__`."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        nn.Module.__init__(self)
        params = rope_parameters(hf_config)
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", *LONGROPE_TYPES):
            raise ValueError(
                f"rope_type {rope_type!r} is not supported natively (use model_impl='transformers')."
            )
        self.attn_head_dim = head_dim
        self.head_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
        if self.head_dim % 2 or not 0 < self.head_dim <= head_dim:
            raise ValueError(
                f"partial rotary over {self.head_dim} of {head_dim} dims is not supported natively."
            )
        self.long = rope_type in LONGROPE_TYPES
        if self.long:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.original = int(params["original_max_position_embeddings"])
            init, device = ROPE_INIT_FUNCTIONS["longrope"], torch.device("cpu")
            short, self._scaling = init(hf_config, device)
            long, _ = init(hf_config, device, seq_len=self.original + 1)
            self._short, self._long = short.float(), long.float()
        else:
            self.original = 0
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            self._short = self._long = 1.0 / (params["rope_theta"] ** exponents)
            self._scaling = 1.0
        self.num_positions = max_positions
        cos, sin = self._tables(max_positions)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows: the short set for positions [0, original), then the long (or only) set."""
        rows = []
        for inv_freq, count in ((self._short, self.original), (self._long, num_positions)):
            freqs = torch.outer(torch.arange(count, dtype=torch.float32), inv_freq)
            rows.append(torch.cat([freqs, freqs], dim=-1))
        emb = torch.cat(rows)
        return emb.cos() * self._scaling, emb.sin() * self._scaling

    def cover(self, num_positions: int) -> None:
        """Tables for at least `num_positions` positions (a max_model_len beyond the config's)."""
        if num_positions > self.num_positions:
            cos, sin = self._tables(num_positions)
            device = self.cos_table.device
            self.cos_table, self.sin_table = cos.to(device), sin.to(device)
            self.num_positions = num_positions

    def rope_positions(self, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The table rows of this step's tokens: position + original for the tokens of sequences longer
        than the original length (`batch.seq_lens`: the whole prompt counts while a chunk of it is
        prefilled), else the position."""
        if not self.long:
            return positions
        lengths = batch.seq_lens if batch.seq_lens is not None else batch.attn.context_lens_list
        long_seqs = [n > self.original for n in lengths]
        if not any(long_seqs):
            return positions
        if all(long_seqs):
            return positions + self.original
        flags = torch.tensor(long_seqs, dtype=torch.int64).repeat_interleave(
            torch.tensor(batch.attn.query_lens_list, dtype=torch.int64)
        )
        return positions + flags.to(positions.device) * self.original

    def apply_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rope on the first num_heads heads of every row of x, in place; `positions` are table rows
        (`rope_positions`). x [T, >= num_heads * head dim] with unit column stride."""
        if self.head_dim == self.attn_head_dim:
            rotary_(x, positions, self.cos_table, self.sin_table, num_heads, self.head_dim)
            return
        heads = x[:, : num_heads * self.attn_head_dim].unflatten(-1, (num_heads, self.attn_head_dim))
        rot = heads[..., : self.head_dim]
        cos = self.cos_table.index_select(0, positions).unsqueeze(1).to(x.dtype)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1).to(x.dtype)
        half = self.head_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        rot.copy_(rot * cos + rotated * sin)
