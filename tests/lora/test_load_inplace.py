"""load_inplace (vLLM PR #31326): an adapter's weights replaced under the same name.

Offline (`LoRARequest(..., load_inplace=True)`, the same id) and in the engine (`replace_lora`, a new
id, as the server does): new requests get the new weights with a new prefix-cache salt, requests
already running finish on the old weights, the pin moves over, a failed reload changes nothing.
Oracle: the same engine serving each adapter's files under a name of its own.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from loraserve import LLM, SamplingParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.errors import LoRAAdapterError
from loraserve.lora.request import LoRARequest

# Longer than two KV blocks, so that a second run of the prompt would reuse cached blocks.
PROMPT = list(range(10, 50))
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def two_adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two adapters of the same shape (a training step apart, say) with different weights."""
    from loraserve.demo.random_model import save_peft_adapter

    root = tmp_path_factory.mktemp("inplace")
    paths = (str(root / "step1"), str(root / "step2"))
    for seed, path in enumerate(paths):
        save_peft_adapter(hf_model(tiny_model("llama")), path, 70 + seed, tiny_model("llama"), r=8, lora_alpha=32,
                          target_modules=["q_proj", "v_proj", "o_proj"])
    return paths


def run(llm: LLM, lora: LoRARequest | None) -> list[int]:
    return list(llm.generate([PROMPT], PARAMS, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids)


def test_offline_reload_in_place(tiny_model: Any, two_adapters: tuple[str, str], tmp_path: Any) -> None:
    step1, step2 = two_adapters
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=4)
    ref1, ref2 = run(llm, LoRARequest("ref1", 1, step1)), run(llm, LoRARequest("ref2", 2, step2))
    assert ref1 != ref2
    # A training loop rewrites one folder and reloads it under the same name and id.
    live = str(tmp_path / "live")
    shutil.copytree(step1, live)
    assert run(llm, LoRARequest("policy", 3, live)) == ref1
    assert run(llm, LoRARequest("policy", 3, live)) == ref1  # the prompt's blocks come from the cache now
    shutil.rmtree(live)
    shutil.copytree(step2, live)
    assert run(llm, LoRARequest("policy", 3, live)) == ref1  # without load_inplace: the loaded weights
    assert run(llm, LoRARequest("policy", 3, live, load_inplace=True)) == ref2  # no stale cached KV
    assert llm.add_lora(LoRARequest("policy", 3, step1, load_inplace=True))  # another path, same id
    assert run(llm, LoRARequest("policy", 3, step1)) == ref1
    assert not llm.add_lora(LoRARequest("policy", 3, step2))  # registered: a new path needs load_inplace
    with pytest.raises(LoRAAdapterError, match="already registered"):
        run(llm, LoRARequest("policy", 3, step2))
    assert [r.lora_name for r in llm.list_loras()].count("policy") == 1


def test_running_requests_finish_on_the_old_weights(tiny_model: Any, two_adapters: tuple[str, str]) -> None:
    step1, step2 = two_adapters
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=3, max_cpu_loras=6)
    engine = llm.engine
    ref1, ref2 = run(llm, LoRARequest("ref1", 1, step1)), run(llm, LoRARequest("ref2", 2, step2))
    old = LoRARequest("policy", 10, step1)
    engine.add_lora(old)
    assert engine.pin_lora(10)
    engine.add_request("before", PROMPT, PARAMS, old)
    engine.step()
    engine.step()  # "before" is decoding on the old weights
    assert engine.replace_lora(10, LoRARequest("policy", 11, step2))
    engine.add_request("after", PROMPT, PARAMS, old)  # resolved the name just before the reload
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    assert outputs == {"before": ref1, "after": ref2}
    assert engine.lora_removed(10).done()
    assert [r.lora_int_id for r in engine.list_loras() if r.lora_name == "policy"] == [11]
    assert engine.lora is not None and engine.lora.stats()["lora_num_pinned"] == 1
    assert not engine.pin_lora(11)  # the pin moved to the new weights


def test_a_failed_reload_changes_nothing(tiny_model: Any, two_adapters: tuple[str, str], tmp_path: Any) -> None:
    step1, _ = two_adapters
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2)
    ref1 = run(llm, LoRARequest("policy", 1, step1))
    with pytest.raises(LoRAAdapterError, match="No adapter found"):
        llm.add_lora(LoRARequest("policy", 1, str(tmp_path / "missing"), load_inplace=True))
    with pytest.raises(LoRAAdapterError, match="No adapter found"):
        llm.engine.replace_lora(1, LoRARequest("policy", 2, str(tmp_path / "missing")))
    assert run(llm, LoRARequest("policy", 1, step1)) == ref1
    assert [r.lora_int_id for r in llm.list_loras()] == [1]


def test_the_same_id_is_not_replaced_under_running_requests(
    tiny_model: Any, two_adapters: tuple[str, str]
) -> None:
    step1, step2 = two_adapters
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), dtype="float32", enable_lora=True))
    engine.add_request("r", PROMPT, PARAMS, LoRARequest("policy", 1, step1))
    with pytest.raises(LoRAAdapterError, match="used by running requests"):
        engine.add_lora(LoRARequest("policy", 1, step2, load_inplace=True))
    engine.abort_request("r")
    assert engine.add_lora(LoRARequest("policy", 1, step2, load_inplace=True))


def test_overwritten_folder_with_a_small_host_cache(
    tiny_model: Any, two_adapters: tuple[str, str], tmp_path: Any
) -> None:
    """A trainer overwrites the adapter's folder, then reloads it in place while a request runs on the
    old weights, with room for only two adapters in host memory. The old copy in memory is the only
    one left: other loads must not evict it, so the running request finishes on it (never a reload of
    the overwritten files, a 409)."""
    step1, step2 = two_adapters
    reference = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=4)
    ref1, ref2 = run(reference, LoRARequest("ref1", 1, step1)), run(reference, LoRARequest("ref2", 2, step2))
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    )
    live = str(tmp_path / "live")
    shutil.copytree(step1, live)
    old = LoRARequest("policy", 10, live)
    engine.add_request("before", PROMPT, PARAMS, old)
    engine.step()
    engine.step()  # "before" is decoding on the old weights
    shutil.rmtree(live)
    shutil.copytree(step2, live)
    engine.prefetch_lora(LoRARequest("policy", 11, live), also_keep=(10,))  # what the server does first
    assert engine.replace_lora(10, LoRARequest("policy", 11, live))
    engine.add_request("other", PROMPT, PARAMS, LoRARequest("other", 12, step1))  # needs room too
    engine.add_request("after", PROMPT, PARAMS, LoRARequest("policy", 11, live))
    outputs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.error or list(output.outputs[0].token_ids)
    assert outputs == {"before": ref1, "other": ref1, "after": ref2}


def test_no_room_for_both_copies_refuses_the_reload(tiny_model: Any, two_adapters: tuple[str, str]) -> None:
    """With one adapter of host memory and the old weights still running, an in-place reload cannot
    hold both copies: it is refused (the old weights keep serving), never evicting the running copy."""
    step1, step2 = two_adapters
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    )
    engine.add_request("before", PROMPT, PARAMS, LoRARequest("policy", 10, step1))
    engine.step()
    with pytest.raises(LoRAAdapterError):
        engine.prefetch_lora(LoRARequest("policy", 11, step2), also_keep=(10,))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.error
    assert finished == {"before": None}
