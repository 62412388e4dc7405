"""Is a folder on storage every machine of a cluster sees? The run folder and the compile cache of a
run on several machines must be (a shared filesystem such as FSx for Lustre, EFS or NFS)."""

from __future__ import annotations

from pathlib import Path

import psutil

SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "beegfs", "gpfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.s3fs",
                      "fuse.mount-s3", "efs", "wekafs")


def filesystem(path: Path) -> str:
    """The type of the filesystem `path` (or its nearest existing parent) is on."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    best = max((p for p in psutil.disk_partitions(all=True) if str(path).startswith(p.mountpoint.rstrip("/") + "/")
                or str(path) == p.mountpoint), key=lambda p: len(p.mountpoint), default=None)
    return best.fstype if best else "unknown"


def shared_storage(path: Path) -> bool:
    """Is `path` on a network filesystem the cluster's nodes can all mount?"""
    return filesystem(path) in SHARED_FILESYSTEMS or filesystem(path).startswith("fuse.")


def unshared_warnings(run_dir, compile_cache) -> list[str]:
    """The plan's warnings for a run on several machines whose runs folder or compile cache is on
    this machine's own disk, which the other nodes cannot see."""
    warnings = []
    for what, path, setting in (("runs folder", Path(run_dir).parent, "--runs-dir or STUDIO_RUNS_DIR"),
                                ("compile cache", Path(compile_cache), "STUDIO_COMPILE_CACHE")):
        if not shared_storage(path):
            warnings.append(f"the {what} {path} is on this machine's own disk ({filesystem(path)}): "
                            f"the other nodes cannot see it. Put it on storage every node mounts "
                            f"(e.g. FSx for Lustre, NFS) with {setting}")
    return warnings
