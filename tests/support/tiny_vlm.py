"""Tiny random vision-language models shaped like the real configs, scaled down, with their processors
(the PIL image processors, tiny image sizes) and a chat template that places each family's image
placeholder: LLaVA-1.5 (CLIP tower, Llama), LLaVA-NeXT (CLIP, Mistral, any-resolution grid), Gemma-3
(SigLIP, pooled to mm_tokens_per_image, bidirectional image attention), Idefics3 (tiles, pixel-shuffle
connector, Llama) and Qwen2-VL (its ViT with 2x2 merging, Qwen2 with M-RoPE). Text: 2 layers of 64,
GQA 4:2; towers: 2 layers of 32; 4 to 16 tokens per image."""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoTokenizer

VLM_ARCHS = ("llava", "llava_next", "gemma3", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32
)
# What a chat template prints where an image goes (the processor's placeholder).
PLACEHOLDER = {
    "llava": "<image>",
    "llava_next": "<image>",
    "gemma3": "<start_of_image>",
    "idefics3": "<image>",
    "smolvlm": "<image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
_IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]
_SPECIAL = {
    "llava": ["<image>"],
    "llava_next": ["<image>"],
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "idefics3": _IDEFICS_TOKENS,
    "smolvlm": _IDEFICS_TOKENS,
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
}


def chat_template(placeholder: str) -> str:
    """The demo's template, with content parts: text parts printed, an image part as `placeholder`."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + placeholder + "{% elif "
        "p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def _tokenizer(arch: str, tokenizer_dir: str) -> Any:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL[arch]})
    if arch == "gemma3":  # Gemma3Processor reads these as the tokenizer's named special tokens
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok.backend_tokenizer,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="</s>",
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "image_token": "<image_soft_token>",
                "eoi_token": "<end_of_image>",
            },
        )
    tok.chat_template = chat_template(PLACEHOLDER[arch])
    return tok


def _config(arch: str, tok: Any) -> Any:
    vocab = len(tok)
    ids = tok.convert_tokens_to_ids
    if arch == "llava":
        return transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(vocab_size=vocab, **TEXT).to_dict(),
            vision_config=transformers.CLIPVisionConfig(image_size=56, patch_size=14, **CLIP).to_dict(),
            image_token_id=ids("<image>"),
            vision_feature_layer=-2,
        )
    if arch == "llava_next":
        return transformers.LlavaNextConfig(
            text_config=transformers.MistralConfig(vocab_size=vocab, sliding_window=None, **TEXT).to_dict(),
            vision_config=transformers.CLIPVisionConfig(image_size=28, patch_size=14, **CLIP).to_dict(),
            image_token_id=ids("<image>"),
            image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
            vision_feature_layer=-2,
        )
    if arch == "gemma3":
        from support.tiny_gemma import gemma_config

        text = gemma_config("gemma3", vocab).to_dict()
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        )
        return transformers.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=ids("<image_soft_token>"),
            boi_token_index=ids("<start_of_image>"),
            eoi_token_index=ids("<end_of_image>"),
        )
    if arch in ("idefics3", "smolvlm"):  # SmolVLM2's own classes (SmolVLM v1 checkpoints are Idefics3's)
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        )
        return (transformers.Idefics3Config if arch == "idefics3" else transformers.SmolVLMConfig)(
            text_config=transformers.LlamaConfig(vocab_size=vocab, **TEXT).to_dict(),
            vision_config=vision,
            scale_factor=2,
            image_token_id=ids("<image>"),
        )
    if arch == "qwen2_5_vl":  # window attention in the tower (2x2 merged patches a window), one full layer
        text = dict(
            TEXT,
            vocab_size=vocab,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        )
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            window_size=32,
            fullatt_block_indexes=[1],
        )
        return transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
    if arch == "qwen2_vl":
        text = dict(
            TEXT,
            vocab_size=vocab,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        )
        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            mlp_ratio=2,
            num_heads=2,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        return transformers.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
        )
    raise ValueError(arch)


def _save_processor(arch: str, path: str, tok: Any) -> None:
    """The processor's files (processor_config.json, the image processor's, the chat template)."""
    pil = transformers.models
    if arch == "llava":
        ip = pil.clip.image_processing_pil_clip.CLIPImageProcessorPil(
            size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
        )
        proc = transformers.LlavaProcessor(
            image_processor=ip,
            tokenizer=tok,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=tok.chat_template,
        )
    elif arch == "llava_next":
        ip = pil.llava_next.image_processing_pil_llava_next.LlavaNextImageProcessorPil(
            size={"shortest_edge": 28},
            crop_size={"height": 28, "width": 28},
            image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
        )
        proc = transformers.LlavaNextProcessor(
            image_processor=ip,
            tokenizer=tok,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=tok.chat_template,
        )
    elif arch == "gemma3":
        ip = pil.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
        proc = transformers.Gemma3Processor(
            image_processor=ip, tokenizer=tok, image_seq_length=4, chat_template=tok.chat_template
        )
    elif arch == "idefics3":
        ip = pil.idefics3.image_processing_pil_idefics3.Idefics3ImageProcessorPil(
            size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
        )
        proc = transformers.Idefics3Processor(
            image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=tok.chat_template
        )
    else:  # these processors hold a video processor, which needs torchvision: their files by hand
        if arch == "smolvlm":
            ip = pil.smolvlm.image_processing_pil_smolvlm.SmolVLMImageProcessorPil(
                size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
            )
            processor_config: dict[str, Any] = {"processor_class": "SmolVLMProcessor", "image_seq_len": 4}
        else:
            ip = pil.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
                min_pixels=16 * 16, max_pixels=48 * 48, patch_size=8, merge_size=2, temporal_patch_size=2
            )
            name = "Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor"
            processor_config = {"processor_class": name}
        ip.save_pretrained(path)
        tok.save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w", encoding="utf-8") as f:
            json.dump(processor_config, f)
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(tok.chat_template)
        return
    proc.save_pretrained(path)


def save_tiny_vlm(path: str, arch: str, tokenizer_dir: str, seed: int = 0) -> Any:
    """Save a tiny random `arch` model (float32) with its tokenizer and processor; returns the HF
    model (eval mode)."""
    tok = _tokenizer(arch, tokenizer_dir)
    config = _config(arch, tok)
    torch.manual_seed(seed)
    cls = {
        "llava": transformers.LlavaForConditionalGeneration,
        "llava_next": transformers.LlavaNextForConditionalGeneration,
        "gemma3": transformers.Gemma3ForConditionalGeneration,
        "idefics3": transformers.Idefics3ForConditionalGeneration,
        "smolvlm": transformers.SmolVLMForConditionalGeneration,
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    }[arch]
    model = cls(config).eval()
    with torch.no_grad():  # weights large enough that images move the outputs
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and arch == "gemma3":
                param.normal_(0.0, 0.3)
            elif param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _save_processor(arch, path, tok)
    return model


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def forged_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with a few bytes of pixel data: what a
    decompression bomb's header looks like, without the gigabytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
