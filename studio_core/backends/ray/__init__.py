"""The Ray backend: a run as a Ray job on a Ray cluster (backend.py; the job's own driver is job.py)."""

from studio_core.backends.ray.backend import RayBackend

__all__ = ["RayBackend"]
