"""A grammar compile worker: a process of its own that compiles one `GrammarKey` at a time and sends
back the compiled grammar in xgrammar's serialised form.

A thread running xgrammar cannot be stopped; a process can be killed. The server compiles every new
constraint here (`compile_pool.py`), so a compile that runs past its timeout, or whose client has
left, ends with a SIGKILL, and a shutdown never waits for one. Workers are forked from
multiprocessing's fork server, which has imported this module (and so xgrammar and torch) once: a
new worker starts in a few hundred milliseconds, not the seconds an import takes.

Messages (pickled over a `multiprocessing.Connection`): the worker receives (kind, text,
any_whitespace) and answers ("ok", serialised) or ("error", message, parameter).
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import xgrammar as xgr

from loraserve.structured_output.grammar_compile import compile_key
from loraserve.structured_output.params import GrammarKey


def serve(conn: Connection, tokenizer_info_json: str) -> None:
    """The worker's main loop: compile what arrives until the connection closes."""
    os.nice(5)  # behind the engine's own threads for the CPU
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    # One thread: the pool's size is the number of cores grammar work may take at once.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    while True:
        try:
            kind, text, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(compile_one(compiler, GrammarKey(kind, text, any_whitespace)))


def compile_one(compiler: Any, key: GrammarKey) -> tuple[Any, ...]:
    try:
        return ("ok", compile_key(compiler, key).serialize_json())
    except ValueError as exc:  # GrammarCompileError, JSONDepthError: the client's
        return ("error", str(exc), getattr(exc, "parameter", None))
    except Exception as exc:  # anything else xgrammar raises on this input is about the input too
        return ("error", f"The grammar did not compile: {type(exc).__name__}: {exc}", None)
