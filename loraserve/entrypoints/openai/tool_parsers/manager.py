"""ToolParserManager: the tool-call parsers by name, as vLLM's registry names them.

Built-in parsers register with `@ToolParserManager.register_module("name")` when the package is
imported; a `--tool-parser-plugin` file (a Python file path, imported once at startup) registers its
own the same way, so `--tool-call-parser` can name it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import ClassVar

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser


class ToolParserManager:
    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}
    _imported: ClassVar[set[str]] = set()

    @classmethod
    def register_module(
        cls, name: str | list[str] | None = None, force: bool = True
    ) -> Callable[[type[ToolParser]], type[ToolParser]]:
        """Decorator registering a ToolParser subclass under `name` (or names; default: its class name)."""

        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            names = [parser.__name__] if name is None else [name] if isinstance(name, str) else list(name)
            for each in names:
                if not force and each in cls.tool_parsers:
                    raise KeyError(f"{each} is already registered at {cls.tool_parsers[each].__module__}")
                cls.tool_parsers[each] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"tool helper parser '{name}' not found in tool parser list")
        return cls.tool_parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.tool_parsers)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import a plugin file once (by its real path); its decorators register its parsers.
        OSError/ImportError (or whatever the file raises) propagate to the caller, who names the file."""
        path = os.path.realpath(os.path.expanduser(plugin_path))
        if path in cls._imported:
            return
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--tool-parser-plugin {plugin_path!r} is not a file")
        module_name = "loraserve_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"--tool-parser-plugin {plugin_path!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        cls._imported.add(path)
