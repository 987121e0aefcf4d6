"""Mixtral natively: Mistral's attention (GQA, a sliding window where the config sets one) with a
sparse MoE block on every layer; routing is softmax, top-k, then renormalised over the k chosen."""

from __future__ import annotations

from loraserve.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    mixtral = True
