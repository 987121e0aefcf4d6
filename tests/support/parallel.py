"""How the suite spreads over the CPU cores (pytest-xdist; `-n auto --dist loadgroup` in
pyproject.toml's addopts): one worker per core this process may run on (at most 4), each worker on one
compute thread, and the tests grouped so that what is expensive to build is built once:
- a module's tests stay on one worker, with its module-scoped servers, engines and models;
- every module with a test on SmolLM2's session fixtures shares one worker (one GGUF conversion, one
  transformers oracle, one engine).
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


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's group: "smollm2" for the modules that use SmolLM2's session fixtures, else its module
    (a module is never split: its module-scoped fixtures would be built on two workers at once)."""
    smollm2 = {
        module_of(item) for item in items if SMOLLM2_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    }
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = module_of(item)
            item.add_marker(pytest.mark.xdist_group("smollm2" if module in smollm2 else module))
