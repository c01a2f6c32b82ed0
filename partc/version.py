"""partc's version: the one source setup.cfg, plan.yaml, profiles and `partc --version` read,
and the build: which partc source exactly wrote a plan."""
from __future__ import annotations

import hashlib
import importlib.util
from functools import lru_cache
from pathlib import Path

__version__ = "0.1.0"


@lru_cache(maxsize=1)
def build_id() -> str:
    """16 hex digits of the SHA-256 of partc's own source (every .py and .json file of the partc
    package and its CLI, by relative path): two installs with the same build_id write the same
    plan for the same inputs. `partc check` tells a plan another build wrote (stale: recompile)
    from one that was edited (tampered) with it. Stable across machines and checkouts."""
    package = Path(__file__).parent
    spec = importlib.util.find_spec("partc.cli")
    # the CLI is partc/cli in a wheel and the repository's cli/ in a development install: hashed
    # under one name either way
    cli = Path(spec.origin).parent if spec is not None and spec.origin else package / "cli"
    digest = hashlib.sha256()
    for name, root in (("partc", package), ("partc/cli", cli)):
        for path in sorted(root.rglob("*")):
            if path.suffix not in (".py", ".json") or "__pycache__" in path.parts or (
                    root == package and path.is_relative_to(cli)):
                continue
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:16]
