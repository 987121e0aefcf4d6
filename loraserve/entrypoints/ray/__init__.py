"""Scale-out on Ray Serve: engine replicas behind the one HTTP server, routed by adapter affinity.

Importing this package does not import Ray: `affinity` is pure (the cluster simulator uses it) and
`ray_missing_error` says what to install; the other modules need `pip install 'loraserve[ray]'`.
"""

from __future__ import annotations


def ray_missing_error(num_replicas: int) -> str | None:
    """None when Ray Serve can be imported, else the one-line reason `--replicas N` cannot run."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return (
            f"--replicas {num_replicas} runs the engines on Ray Serve, which is not installed: "
            "pip install 'loraserve[ray]' (or pip install 'ray[serve]')"
        )
    return None
