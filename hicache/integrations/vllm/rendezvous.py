"""How the scheduler learns the pools its workers registered.

vLLM's manager (scheduler process) and workers (one process per rank) share no channel the
spec can use, but they share vLLM's engine_id. Each worker writes its pool ids to
<dir>/<engine>/rank<r>.json (atomically, by rename); the manager reads the ranks it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile


def _folder(root: str, engine_id: str) -> str:
    tag = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return os.path.join(root, f"engine-{tag}")


def publish(root: str, engine_id: str, rank: int, pools: dict[int, tuple[str, str]]) -> None:
    """Record rank's (pool id, pool secret) of each group index, in a file only this uid can
    read (the secret gives access to the pool). Raises OSError."""
    folder = _folder(root, engine_id)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".rank{rank}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "pools": {str(g): list(p) for g, p in pools.items()}}, f)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def withdraw(root: str, engine_id: str, rank: int) -> None:
    try:
        os.unlink(os.path.join(_folder(root, engine_id), f"rank{rank}.json"))
    except FileNotFoundError:
        pass


def read(root: str, engine_id: str, world_size: int) -> list[dict[int, tuple[str, str]]] | None:
    """Every rank's pools (group index -> (pool id, secret)), or None while a rank has not
    published."""
    out = []
    for rank in range(world_size):
        try:
            with open(os.path.join(_folder(root, engine_id), f"rank{rank}.json")) as f:
                pools = json.load(f)["pools"]
            out.append({int(g): (str(p[0]), str(p[1])) for g, p in pools.items()})
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
    return out
