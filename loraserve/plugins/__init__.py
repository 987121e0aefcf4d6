"""General plugins: callables registered under the `loraserve.general_plugins` entry-point group.

`load_general_plugins()` calls each allowed plugin once per process. LORASERVE_PLUGINS (alias
VLLM_PLUGINS) filters them: unset loads all (in discovery order), an empty string loads none, otherwise
a comma-separated allowlist of entry-point names, loaded in the allowlist's order (which is also the order
resolvers registered by those plugins are tried). A plugin that fails to import or raises is logged and
skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from loraserve import envs

logger = logging.getLogger(__name__)

GENERAL_PLUGINS_GROUP = "loraserve.general_plugins"

_lock = threading.Lock()
_loaded_plugins: set[str] = set()


def discover_plugins(group: str) -> list[EntryPoint]:
    """The entry points of `group` that the LORASERVE_PLUGINS allowlist permits, in discovery order."""
    allowlist = envs.plugins()
    if allowlist == []:
        return []
    discovered = list(entry_points(group=group))
    if allowlist is not None:
        known = {ep.name for ep in discovered}
        for name in allowlist:
            if name not in known:
                logger.warning(
                    "Plugin %r named in LORASERVE_PLUGINS is not installed (group %s).", name, group
                )
        # Entry-point order across packages is not defined; the allowlist's order is the user's choice.
        discovered = sorted(
            (ep for ep in discovered if ep.name in allowlist), key=lambda ep: allowlist.index(ep.name)
        )
    return discovered


def load_general_plugins() -> list[str]:
    """Call every allowed general plugin not yet called in this process; return the names called now."""
    called: list[str] = []
    with _lock:
        for ep in discover_plugins(GENERAL_PLUGINS_GROUP):
            if ep.name in _loaded_plugins:
                continue
            # Marked before running so a failing plugin is not retried (and its error not repeated).
            _loaded_plugins.add(ep.name)
            if _run_plugin(ep):
                called.append(ep.name)
    if called:
        logger.info("Loaded general plugins: %s", ", ".join(called))
    return called


def _run_plugin(ep: EntryPoint) -> bool:
    try:
        func: Callable[[], object] = ep.load()
    except Exception:
        logger.exception("Failed to import plugin %r (%s); it is skipped.", ep.name, ep.value)
        return False
    try:
        func()
    except Exception as exc:
        logger.error("Plugin %r (%s) failed and is skipped: %s", ep.name, ep.value, exc)
        return False
    return True
