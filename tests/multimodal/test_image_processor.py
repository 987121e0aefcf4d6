"""The processor stage (loraserve/multimodal/processor.py): each image's encoder inputs, hash and
placeholder positions out of the model's own Hugging Face processor (PIL path; Qwen2-VL's without its
torchvision-only video processor), M-RoPE positions as transformers computes them, and the rules the
scheduler and the prefix cache read off the result."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import transformers
from support.tiny_vlm import PLACEHOLDER, random_image, save_tiny_vlm

from loraserve.multimodal.inputs import ImageItem, MultiModalInputs
from loraserve.multimodal.media import MediaLimits
from loraserve.multimodal.processor import MultiModalProcessor

ARCHITECTURES = {
    "llava_next": "LlavaNextForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
}


@pytest.fixture(scope="module")
def processors(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str
) -> dict[str, tuple[str, MultiModalProcessor]]:
    out = {}
    for arch, architecture in ARCHITECTURES.items():
        path = str(tmp_path_factory.mktemp(arch))
        save_tiny_vlm(path, arch, tokenizer_dir)
        config = transformers.AutoConfig.from_pretrained(path)
        out[arch] = (
            path,
            MultiModalProcessor(path, config, architecture, MediaLimits(), images_per_prompt=2),
        )
    return out


def test_qwen2_vl_mrope_positions_are_transformers(processors: dict[str, Any]) -> None:
    path, processor = processors["qwen2_vl"]
    text = "<s>one " + PLACEHOLDER["qwen2_vl"] + " two " + PLACEHOLDER["qwen2_vl"] + " three"
    images = [random_image(48, 32, 1), random_image(24, 40, 2)]
    mm = processor.process(text, images)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.Qwen2VLModel(config)
    ids = torch.tensor([mm.prompt_token_ids])
    grids = torch.cat([image.data["image_grid_thw"] for image in mm.images])
    positions, deltas = model.get_rope_index(ids, (ids == config.image_token_id).int(), image_grid_thw=grids)
    assert mm.mrope_positions is not None and torch.equal(mm.mrope_positions, positions[:, 0])
    assert mm.mrope_delta == int(deltas[0, 0]) != 0
    # Each image's placeholders are its grid's merged patches (Qwen2VLProcessor's expansion).
    assert [image.num_tokens for image in mm.images] == [int(g.prod()) // 4 for g in grids]


@pytest.mark.parametrize("arch", ["llava_next", "idefics3", "gemma3", "qwen2_vl"])
def test_an_images_inputs_and_hash_do_not_depend_on_the_others_sent_with_it(
    processors: dict[str, Any], arch: str
) -> None:
    """A small image sent alone or after a larger one (whose crops or tiles pad a batch) is the same
    encoder input, hence the same content hash: what the embedding and prefix caches key by."""
    _, processor = processors[arch]
    small, large = random_image(30, 20, 3), random_image(64, 64, 4)
    alone = processor.process(f"<s>a {PLACEHOLDER[arch]}", [small]).images[0]
    second = processor.process(f"<s>a {PLACEHOLDER[arch]} b {PLACEHOLDER[arch]}", [large, small]).images[1]
    assert alone.content_hash == second.content_hash and alone.num_tokens == second.num_tokens
    assert alone.data.keys() == second.data.keys()
    assert all(torch.equal(alone.data[k], second.data[k]) for k in alone.data)
    other = processor.process(f"<s>a {PLACEHOLDER[arch]}", [random_image(30, 20, 5)]).images[0]
    assert other.content_hash != alone.content_hash


def test_placeholders_must_match_the_images(processors: dict[str, Any]) -> None:
    _, processor = processors["gemma3"]
    image = random_image(20, 20, 6)
    with pytest.raises(ValueError, match="may not contain the image token '<image_soft_token>'"):
        processor.process("<s><image_soft_token> a <start_of_image>", [image])
    with pytest.raises(ValueError):  # two placeholders, one image (the processor's own check)
        processor.process("<s><start_of_image><start_of_image>", [image])
    with pytest.raises(ValueError, match="at most 2 images"):
        processor.process("<s>" + "<start_of_image>" * 3, [image] * 3)


def test_idefics3_tiles_are_runs_of_one_image(processors: dict[str, Any]) -> None:
    _, processor = processors["idefics3"]
    mm = processor.process("<s>x <image> y", [random_image(64, 40, 7)])
    (image,) = mm.images
    assert len(image.runs) == 5 and image.num_tokens == 5 * 4  # 2x2 tiles and the global image, 4 tokens each
    assert image.data["pixel_values"].shape[:2] == (1, 5)
    rows = list(image.rows_in(0, len(mm.prompt_token_ids)))
    assert [row for _, row in rows] == list(range(20))
    assert [p for p, _ in rows] == [p for start, end in image.runs for p in range(start, end)]


def test_chunks_and_cache_keys_read_off_the_inputs() -> None:
    item = ImageItem("ab" * 32, {"pixel_values": torch.zeros(1)}, ((4, 8),))
    causal = MultiModalInputs(list(range(12)), (item,))
    both_ways = MultiModalInputs(list(range(12)), (item,), bidirectional=True)
    assert causal.clamp_chunk(0, 6) == 6  # LLaVA: an image may be split over steps
    assert both_ways.clamp_chunk(0, 6) == 4 and both_ways.clamp_chunk(4, 6) == 4  # Gemma-3: never
    assert both_ways.clamp_chunk(0, 8) == 8 and both_ways.clamp_chunk(5, 7) == 5
    assert causal.block_key(0, 4) == b"" and causal.block_key(4, 8) == causal.block_key(6, 12) != b""
    assert list(item.rows_in(6, 12)) == [(6, 2), (7, 3)]


def test_the_processor_pickles_as_its_arguments(processors: dict[str, Any]) -> None:
    """A --replicas ingress gets the replica's processor by pickle: rebuilt from the same files."""
    _, processor = processors["qwen2_vl"]
    copy = pickle.loads(pickle.dumps(processor))
    image = random_image(16, 16, 8)
    text = "<s>" + PLACEHOLDER["qwen2_vl"]
    assert copy.process(text, [image]).prompt_token_ids == processor.process(text, [image]).prompt_token_ids
