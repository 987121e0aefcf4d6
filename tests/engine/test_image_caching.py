"""What the engine keeps of images, and how it splits their prompts: the prefix cache keys placeholder
tokens by their image (the same prompt ids with another image reuse no KV of the image's blocks), the
image-embedding cache serves a repeated image without the tower (and never across tower-adapter
versions), chunked prefill splits a LLaVA image over steps but never a Gemma-3 one (whose tokens
attend both ways), and a text-only model refuses images by name. Oracle: transformers / PEFT."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.tiny_vlm import random_image, save_tiny_vlm
from support.vlm_oracle import generate, hf_inputs, peft_vlm, processor_of, save_vlm_adapters

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.lora.request import LoRARequest

NUM_NEW = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("llava"))
    hf = save_tiny_vlm(path, "llava", tokenizer_dir, seed=7)
    adapters = save_vlm_adapters(hf, "llava", str(tmp_path_factory.mktemp("llava-adapters")), path)
    return {"path": path, "hf": hf, "adapters": adapters, "processor": processor_of(path)}


def _prompt(text: str, image: Any) -> dict[str, Any]:
    return {"prompt": text, "multi_modal_data": {"image": [image]}}


def _reference(case: dict[str, Any], text: str, image: Any, arch: str = "llava") -> list[int]:
    with torch.no_grad():
        out = case["hf"].generate(
            **hf_inputs(case["processor"], arch, text, [image]),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, -NUM_NEW:].tolist()


def test_prefix_cache_keys_image_tokens_by_their_image(llava: dict[str, Any]) -> None:
    llm = LLM(llava["path"], dtype="float32", block_size=4, kv_cache_memory_bytes=16 << 20)
    text = "<s>a long enough prompt about <image> and what it shows"
    first, other = random_image(40, 30, 1), random_image(40, 30, 2)
    out_first, out_other, out_again = (
        llm.generate([_prompt(text, image)], PARAMS, use_tqdm=False)[0] for image in (first, other, first)
    )
    assert out_first.prompt_token_ids == out_other.prompt_token_ids  # the same placeholder tokens
    start = out_first.prompt_token_ids.index(llm.engine.mm_processor.feature_id)
    assert out_other.num_cached_tokens == start // 4 * 4  # the blocks before the image only
    assert list(out_other.outputs[0].token_ids) == _reference(llava, text, other)
    assert out_again.num_cached_tokens == (len(out_first.prompt_token_ids) - 1) // 4 * 4
    assert out_again.outputs[0].token_ids == out_first.outputs[0].token_ids
    stats = llm.engine.stats()
    # The repeated image was not encoded again: its first prefill's blocks were all cached but one.
    assert stats["images_received"] == 3 and stats["images_encoded"] == 2


def test_chunked_prefill_splits_an_image_over_steps(llava: dict[str, Any]) -> None:
    """16 image tokens in chunks of 8 (the embedding cache too small to keep them: each chunk encodes
    the image again) answer as the whole prompt does."""
    llm = LLM(
        llava["path"],
        dtype="float32",
        max_num_batched_tokens=8,
        mm_embedding_cache_bytes=1,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=16 << 20,
    )
    text, image = "<s>look at <image> carefully", random_image(50, 40, 3)
    out = llm.generate([_prompt(text, image)], PARAMS, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _reference(llava, text, image)
    assert llm.engine.stats()["images_encoded"] >= 2  # one image, encoded in more than one step


def test_embedding_cache_serves_repeats_and_never_a_reloaded_tower_adapter(
    llava: dict[str, Any], tmp_path: Any
) -> None:
    """An adapter with tower terms keys the embeddings by its version: after load_inplace with new
    weights the same image is encoded again and answered as PEFT answers the new version."""
    folder = str(tmp_path / "tower")
    save_peft_adapter(
        llava["hf"], folder, 11, llava["path"], r=8, lora_alpha=16, target_modules=["q_proj", "fc1"]
    )
    llm = LLM(
        llava["path"],
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        enable_tower_connector_lora=True,
        kv_cache_memory_bytes=16 << 20,
        enable_prefix_caching=False,
    )
    text, image = "<s>what is <image> here", random_image(40, 40, 4)
    request = LoRARequest("tower", 1, folder)
    base_twice = llm.generate([_prompt(text, image)] * 2, PARAMS, use_tqdm=False)
    assert base_twice[0].outputs[0].token_ids == base_twice[1].outputs[0].token_ids
    assert llm.engine.stats()["images_encoded"] == 1  # the batch's second request found it cached
    first = llm.generate([_prompt(text, image)], PARAMS, lora_request=request, use_tqdm=False)[0]
    assert llm.engine.stats()["images_encoded"] == 2  # the adapter's tower: another encoding
    llm.generate([_prompt(text, image)], PARAMS, lora_request=request, use_tqdm=False)
    assert llm.engine.stats()["images_encoded"] == 2  # ... kept under the adapter's version
    save_peft_adapter(
        llava["hf"], folder, 12, llava["path"], r=8, lora_alpha=16, target_modules=["q_proj", "fc1"]
    )
    assert llm.engine.add_lora(LoRARequest("tower", 1, folder, load_inplace=True))
    second = llm.generate([_prompt(text, image)], PARAMS, lora_request=request, use_tqdm=False)[0]
    assert llm.engine.stats()["images_encoded"] == 3
    oracle = peft_vlm("llava", llava["path"], {"v2": folder})
    tokens, logprobs = generate(oracle, "v2", hf_inputs(llava["processor"], "llava", text, [image]), NUM_NEW)
    ours = [step[t].logprob for step, t in zip(second.outputs[0].logprobs, second.outputs[0].token_ids)]
    assert (
        list(second.outputs[0].token_ids) == tokens and max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-4
    )
    assert ours != [step[t].logprob for step, t in zip(first.outputs[0].logprobs, first.outputs[0].token_ids)]


def test_gemma3_images_stay_whole_in_a_chunk(tmp_path: Any, tokenizer_dir: str) -> None:
    """Gemma-3's image tokens see each other: a chunk never ends inside an image (the answer is the
    whole prompt's), and an image longer than the step's token budget is refused at once."""
    path = str(tmp_path / "gemma3")
    hf = save_tiny_vlm(path, "gemma3", tokenizer_dir, seed=5)
    case = {"hf": hf, "processor": processor_of(path)}
    text, image = "<s>see <start_of_image> here", random_image(40, 30, 6)
    llm = LLM(
        path,
        dtype="float32",
        max_num_batched_tokens=9,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=16 << 20,
    )
    chunks: list[int] = []  # the steps' prefill chunks: 9 tokens would end inside the image at 7..10
    run = llm.engine.runner.execute
    llm.engine.runner.execute = lambda scheduled, slots: (
        chunks.append(scheduled[0].num_new_tokens) or run(scheduled, slots)
    )
    out = llm.generate([_prompt(text, image)], PARAMS, use_tqdm=False)[0]
    assert chunks[:3] == [7, 9, 1]
    assert list(out.outputs[0].token_ids) == _reference(case, text, image, "gemma3")
    small = LLM(path, dtype="float32", max_num_batched_tokens=3, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        small.generate([_prompt(text, image)], PARAMS, use_tqdm=False)


def test_a_text_only_model_refuses_images_by_name(tiny_model: Any) -> None:
    llm = LLM(tiny_model("llama"), dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM\) takes text only"):
        llm.generate([_prompt("hello", random_image(8, 8, 0))], PARAMS, use_tqdm=False)
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}
    ]
    with pytest.raises(ValueError, match="takes text only"):
        llm.chat(messages, PARAMS, use_tqdm=False)
