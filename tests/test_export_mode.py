"""An export's files share one mode: safetensors writes model.safetensors 0600, beside the 0644 the
rest get (issue 47)."""

from __future__ import annotations

import os
import stat

import pytest

from studio_core.export.export import same_mode

pytestmark = pytest.mark.fast


def test_the_weights_get_the_mode_of_the_files_written_beside_them(tmp_path):
    import torch  # here, not at the top: collecting the tests imports no torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    os.chmod(tmp_path / "model.safetensors", 0o600)  # as safetensors leaves it on some systems
    (tmp_path / "README.md").write_text("card")
    os.chmod(tmp_path / "README.md", 0o644)
    same_mode(tmp_path, tmp_path / "README.md")
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644
