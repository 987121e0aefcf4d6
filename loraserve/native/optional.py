"""Optional kernel modules (the Triton backends): imported on first use, None where they cannot be.

The layers pick a Triton kernel for CUDA tensors only when its module imports; without Triton (or
with a Triton that has no usable backend) they keep their torch path. This is the one place that
tries the import and says why it failed.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """The module `name` (one that imports Triton), or None when it cannot be imported; tried once per
    process. A missing Triton is silent; any other failure (a broken install, no GPU backend) is logged
    once, since the caller then runs its slower torch path."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # not installed, or installed without a usable backend
        if not isinstance(e, ImportError):
            logger.warning("Triton kernels of %s unavailable (%s); using the torch path", name, e)
        return None
