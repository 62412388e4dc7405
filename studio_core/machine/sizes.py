"""Sizes on disk, in one unit everywhere: decimal megabytes (1 MB = 1,000,000 bytes), as disks
and the Hugging Face Hub count them.
"""

from __future__ import annotations

import os
from pathlib import Path

MB = 1_000_000


def format_size(size: float) -> str:
    """1234 -> "1.2 KB", 2_300_000 -> "2.3 MB"; bytes below 1000 as a whole number."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def folder_size(folder: str | Path) -> int:
    """Bytes the folder takes: every file in it, links counted as links (not followed)."""
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:  # a running trainer may remove a file while we walk
                continue
    return total
