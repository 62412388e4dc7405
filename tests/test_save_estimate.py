"""The disk check's estimate of a checkpoint (rundir/checkpoints.save_bytes): in proportion to what
the save writes, so a small model's run is not stopped as "the disk is full" on a disk it fits."""

from __future__ import annotations

import pytest

from studio_core.data.builtin import ensure_tiny_model
from studio_core.rundir import checkpoints
from studio_core.rundir.checkpoints import disk_full_text, save_bytes


def small_model_and_optimizer():
    """About 1.8 MB of tensors: 154k float32 parameters and Adam's two states for each."""
    import torch

    model = torch.nn.Linear(256, 600)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    tensors = sum(p.numel() * 4 for p in model.parameters()) * 3
    return model, optimizer, tensors


@pytest.mark.fast
def test_a_small_checkpoint_needs_about_its_own_size_not_16_mib_more():
    model, optimizer, tensors = small_model_and_optimizer()
    need = save_bytes(model, optimizer, adapter_only=False)
    assert 1_700_000 < tensors < 1_900_000
    # the tensors, 2% for the files' framing and a 1 MiB floor for config, states and the like
    assert tensors < need <= tensors * 1.02 + (1 << 20) + 64  # Adam keeps a step count too
    assert "needs about 2.8 MiB" in disk_full_text(".", need, "checkpoint-1")


@pytest.mark.fast
def test_the_margin_grows_with_what_is_saved():
    model, optimizer, tensors = small_model_and_optimizer()
    margin_with_optimizer = save_bytes(model, optimizer, adapter_only=False) - tensors
    margin_without = save_bytes(model, None, adapter_only=False) - tensors // 3
    # 2% of Adam's two states more (less the few bytes of its step counts, which are saved too)
    assert margin_with_optimizer - margin_without >= 0.02 * (tensors * 2 // 3) - 64


def test_the_tokenizer_counts_what_saving_it_writes(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tokenizer.save_pretrained(tmp_path)
    written = (tmp_path / "tokenizer.json").stat().st_size
    assert abs(checkpoints.tokenizer_bytes(tokenizer) - written) < written * 0.2
    model, optimizer, _ = small_model_and_optimizer()
    assert (save_bytes(model, optimizer, False, tokenizer) - save_bytes(model, optimizer, False)
            == checkpoints.tokenizer_bytes(tokenizer))
    assert checkpoints.tokenizer_bytes(None) == 0
