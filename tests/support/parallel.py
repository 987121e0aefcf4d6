"""How the suite spreads over the CPU cores (pytest-xdist; `-n auto --dist loadgroup` in
pyproject.toml's addopts): one worker per core this process may run on (at most 4), each worker on one
compute thread, and the tests grouped so that what is expensive to build is built once:
- a module's tests stay on one worker, with its module-scoped servers, engines and models;
- every test on SmolLM2's session fixtures shares one worker (one GGUF conversion, one transformers
  oracle, one engine), and so do the Ray tests (one cluster at a time on a 2-core machine).
A worker count of 1 (`-n 1`, or a process pinned to one core) runs the same groups in turn; `-p
no:xdist` or `-n 0` runs the suite in this process, as before."""

from __future__ import annotations

import os

import pytest

MAX_WORKERS = 4  # each worker holds its own session fixtures (tiny models, tokenizers): memory, not cores
SMOLLM2_FIXTURES = frozenset({"smollm_cache_root", "smollm2_oracle", "smollm2_llm"})


def usable_cores() -> int:
    """The cores this process may run on (its affinity: `taskset -c 0` gives 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_WORKERS, usable_cores()))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A worker computes on one thread: two workers of two OpenMP threads each on two cores would wait
    at every barrier for a descheduled sibling. Kernel tests that test a thread count set it themselves;
    servers and engines the tests start as processes inherit OMP_NUM_THREADS."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def xdist_group(item: pytest.Item) -> str:
    """The group a test runs in: SmolLM2's, Ray's, or its module's."""
    if SMOLLM2_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "smollm2"
    if item.get_closest_marker("ray") is not None:
        return "ray"
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
