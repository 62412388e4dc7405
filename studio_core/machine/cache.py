"""The studio's own cache folder, which the built-in model, TRL's field schema, the config
checks, the compile cache and lm-eval's offline tasks live under."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the studio's local cache (``$STUDIO_CACHE_DIR`` or ~/.cache/trn-studio)."""
    return Path(os.environ.get("STUDIO_CACHE_DIR", "~/.cache/trn-studio")).expanduser()
