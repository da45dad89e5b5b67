"""Where specee keeps what it derives from a model once (predictor banks, tuned profiles, converted
tokenizers): $SPECEE_CACHE, else $XDG_CACHE_HOME/specee, else ~/.cache/specee."""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    root = os.environ.get("SPECEE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specee")
    return Path(root)
