"""Versioned adapter names, as the serving layer resolves them (`adapter_versions`, fake engine):
name@digest-prefix and name@label address one version, the plain name the newest, retention keeps
two, unknown versions are vLLM-style 404s, the version rule of the Ray router, `LoRARequest.version`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from support.fake_engine import FakeEngine, write_adapter

from loraserve.entrypoints.openai.serving.adapter_versions import (
    KEEP_VERSIONS,
    AdapterVersion,
    AdapterVersions,
    check_label,
    split_version,
)
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from loraserve.entrypoints.openai.serving.serving_models import BaseModelPath, OpenAIServingModels
from loraserve.entrypoints.ray.affinity import HOST, SLOT, rank_replicas, replica_load
from loraserve.lora.request import LoRARequest, version_key


def version(name: str, lora_id: int, digest: str, label: str | None = None) -> AdapterVersion:
    return AdapterVersion(LoRARequest(name, lora_id, f"/x/{lora_id}", version=digest), digest, label)


def test_split_version() -> None:
    assert split_version("pol@v3") == ("pol", "v3")
    assert split_version("a@b@c") == ("a@b", "c")  # the last '@' separates the version
    assert split_version("pol") == ("pol", None)
    assert split_version("pol@") == ("pol@", None) and split_version("@x") == ("@x", None)


def test_labels_are_checked() -> None:
    assert check_label("step-7") == "step-7" and check_label(None) is None
    for bad in ("", "-x", "a b", "x" * 65, "deadbeef", "0123456789"):
        with pytest.raises(APIError) as info:
            check_label(bad)
        assert info.value.status == 400 and info.value.param == "version"


def test_publish_keeps_the_newest_two_and_finds_by_label_or_prefix() -> None:
    versions = AdapterVersions()
    digests = [f"{i:x}" * 64 for i in range(1, 5)]
    retired = [versions.publish(version("pol", i + 1, d, f"s{i}")) for i, d in enumerate(digests)]
    assert [len(r) for r in retired] == [0, 0, 1, 1]  # every publish beyond two retires the oldest
    assert [v.digest for v in versions.held("pol")] == digests[-KEEP_VERSIONS:]
    assert versions.find("pol", "s3").digest == digests[3]
    assert versions.find("pol", digests[2][:8].upper()).label == "s2"  # a prefix, any case
    assert [v.key for v in versions.older()] == [version_key("pol", digests[2])]
    with pytest.raises(APIError) as info:
        versions.find("pol", "s0")  # retired
    assert info.value.status == 404
    assert info.value.message.startswith("The model `pol@s0` does not exist")
    assert digests[3][:12] in info.value.message and "(s3)" in info.value.message
    with pytest.raises(APIError) as short:
        versions.find("pol", digests[3][:7])  # under 8 digits: not a digest prefix
    assert short.value.status == 404


def test_an_ambiguous_prefix_is_a_400() -> None:
    versions = AdapterVersions()
    versions.publish(version("pol", 1, "ab" * 8 + "1" * 48))
    versions.publish(version("pol", 2, "ab" * 8 + "2" * 48))
    with pytest.raises(APIError) as info:
        versions.find("pol", "abababab")
    assert info.value.status == 400 and "ambiguous" in info.value.message
    assert versions.find("pol", "ab" * 8 + "2").request.lora_id == 2


def test_lora_request_version_is_a_digest_prefix() -> None:
    request = LoRARequest("pol", 1, "/x", version="ABCDEF012345")
    assert request.version == "abcdef012345" and request.version_key == "pol@abcdef012345"
    assert LoRARequest("pol", 1, "/x").version_key == "pol"
    for bad in ("abc", "xyz12345", "v3"):
        with pytest.raises(ValueError, match="prefix of the adapter's content digest"):
            LoRARequest("pol", 1, "/x", version=bad)


def test_the_router_counts_only_the_version_asked_for() -> None:
    old, new = version_key("pol", "1" * 64), version_key("pol", "2" * 64)
    reports = {
        "stale": {"time": 100.0, "residency": {old: SLOT}},  # holds only the previous version
        "fresh": {"time": 100.0, "residency": {new: HOST}},
        "cold": {"time": 100.0, "residency": {}},
    }
    queue = {"stale": 0, "fresh": 3, "cold": 1}
    loads = [replica_load(rid, queue[rid], reports[rid], new) for rid in reports]
    assert {load.replica_id: load.residency for load in loads} == {"stale": None, "fresh": HOST, "cold": None}
    assert rank_replicas(loads) == [["fresh"], ["stale", "cold"]]
    # Without the new version anywhere, the previous one's holder is just the least loaded replica.
    without = [replica_load(rid, queue[rid], reports[rid], new) for rid in ("stale", "cold")]
    assert all(load.residency is None for load in without)
    # The old version itself still goes to its holder; the router's own send counts within the grace.
    assert rank_replicas([replica_load(r, queue[r], reports[r], old) for r in reports])[0] == ["stale"]
    sent = replica_load("cold", 1, reports["cold"], new, sent_at=100.5, grace_s=1.0)
    assert sent.residency == SLOT


_LOOP: list[asyncio.AbstractEventLoop] = []  # the fake engine's loop, one per test (`models`)


def run(coro: Any) -> Any:
    return _LOOP[-1].run_until_complete(coro)


@pytest.fixture()
def models(tmp_path, tokenizer) -> Iterator[tuple[OpenAIServingModels, str]]:
    for name in ("one", "two", "three"):
        write_adapter(str(tmp_path / name), rank={"one": 4, "two": 8, "three": 16}[name])
    engine = FakeEngine(tokenizer)
    _LOOP.append(asyncio.new_event_loop())
    run(engine.start())
    yield OpenAIServingModels(engine, [BaseModelPath("base", "base")], allow_runtime_lora_updating=True,
                              lora_resolvers=[]), str(tmp_path)  # fmt: skip
    _LOOP.pop().close()


def load(models: OpenAIServingModels, folder: str, name: str = "pol", **extra: object) -> str:
    body = LoadLoRAAdapterRequest(lora_name=name, lora_path=folder, **extra)
    return run(models.load_lora_adapter(body))


def test_serving_models_versions(models: tuple[OpenAIServingModels, str]) -> None:
    serving, root = models
    load(serving, f"{root}/one", version="v1")
    load(serving, f"{root}/two", load_inplace=True, version="v2")
    v1, v2 = serving.held_versions("pol")
    assert v1.digest != v2.digest and (v1.label, v2.label) == ("v1", "v2")
    resolve = lambda model: run(serving.resolve_model(model))  # noqa: E731
    assert resolve("pol").lora_id == v2.request.lora_id and resolve("pol").version == v2.digest
    assert resolve("pol@v1").lora_id == resolve(f"pol@{v1.digest[:8]}").lora_id == v1.request.lora_id
    cards = {card.id: card for card in serving.list_models().data}
    assert cards["pol"].digest == v2.digest and cards["pol"].version == "v2"
    assert cards[v1.key].digest == v1.digest and cards[v1.key].parent == "base"
    listed = serving.lora_adapter_list()
    assert [(e["name"], e["digest"]) for e in listed] == [("pol", v2.digest), (v1.key, v1.digest)]
    with pytest.raises(APIError) as taken:
        load(serving, f"{root}/three", load_inplace=True, version="v1")
    assert taken.value.status == 400 and "already has a version labelled 'v1'" in taken.value.message
    with pytest.raises(APIError) as at_sign:
        load(serving, f"{root}/three", name="new@x")
    assert at_sign.value.status == 400
    # Unloading the newest version makes the previous one the newest (a rollback).
    run(serving.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name="pol@v2")))
    assert resolve("pol").lora_id == v1.request.lora_id
    with pytest.raises(APIError) as gone:
        resolve("pol@v2")
    assert gone.value.status == 404 and "`pol@v2` does not exist" in gone.value.message


def test_reloading_the_same_content_is_the_same_version(models: tuple[OpenAIServingModels, str]) -> None:
    serving, root = models
    load(serving, f"{root}/one")
    first = serving.held_versions("pol")
    load(serving, f"{root}/one", load_inplace=True, version="again")
    (only,) = serving.held_versions("pol")
    assert only.request.lora_id == first[0].request.lora_id and only.label == "again"
