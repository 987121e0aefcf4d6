"""The adapters the benchmarks write straight to disk (benchmarks.synthetic_adapters) are real PEFT
adapters: PEFT reads every tensor of the file, and loraserve computes PEFT's logprobs with them."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from safetensors.torch import load_file

from benchmarks.synthetic_adapters import adapter_name, write_adapters
from loraserve import LLM, SamplingParams
from loraserve.lora.request import LoRARequest


def test_written_once_per_name(tiny_model: Any, tmp_path: Any) -> None:
    path = tiny_model("llama")
    root = str(tmp_path / "adapters")
    assert write_adapters(path, root, [3, 3, 5], rank=4) == 2
    assert write_adapters(path, root, [5, 7], rank=4) == 1
    assert sorted(os.listdir(root)) == [adapter_name(i) for i in (3, 5, 7)]


def test_written_adapter_matches_peft(tiny_model: Any, tmp_path: Any) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    root = str(tmp_path / "adapters")
    write_adapters(path, root, [3], rank=4)
    adapter = os.path.join(root, adapter_name(3))
    prompt = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(0)).tolist()

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter)
    state = model.state_dict()
    for key, tensor in load_file(os.path.join(adapter, "adapter_model.safetensors")).items():
        # PEFT starts lora_B at zero: a key it did not recognise would leave it there.
        assert torch.equal(state[key.replace(".weight", ".default.weight")], tensor.float()), key
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
        with model.disable_adapter():
            base = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    assert (ref - base).abs().max().item() > 1e-3  # the adapter changes the output: the check below can fail

    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, lora_request=LoRARequest("z", 1, adapter),
                          use_tqdm=False)
    for pos in range(1, len(prompt)):
        ours = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert math.isclose(ours, ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4), pos
