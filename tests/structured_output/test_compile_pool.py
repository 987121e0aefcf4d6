"""The compile pool's workers run the compile and nothing else: a script without a `__main__` guard
(multiprocessing imports the main module in every child it starts) is not run again in a worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import xgrammar as xgr

    from loraserve.structured_output.compile_pool import CompileSettings, GrammarCompilePool
    from loraserve.structured_output.params import GrammarKey

    print("the script ran", flush=True)
    info = xgr.TokenizerInfo(["a", "b", "ab", "</s>"], stop_token_ids=[3])
    pool = GrammarCompilePool(
        lambda: info.serialize_json(),
        lambda key, text: xgr.CompiledGrammar.deserialize_json(text, info),
        CompileSettings(workers=1, timeout_s=60),
    )
    compiled = pool.submit(GrammarKey("regex", "(ab)+"), "client").future.result(120)
    print("compiled", type(compiled).__name__, flush=True)
    pool.shutdown()
    """
)


def test_an_unguarded_script_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("the script ran") == 1, result.stdout
    assert "compiled CompiledGrammar" in result.stdout
