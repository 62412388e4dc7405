"""Tests for studio_core.machine.layout: core sets, process layouts, "next free" and TP groups.

Table-driven over instance types and layouts, including the seed layouts: data parallel on
a trn2.3xlarge (TRL's guide: 0,1 / 2,3 / 0-3 work, 1,2 does not) and TP 4 x FSDP 8 on half
a trn2.48xlarge (the TorchNeuron blog's Qwen3-8B run).
"""

import pytest

from studio_core.machine.hardware import Hardware, instance_hardware
from studio_core.machine.cores import format_cores, parse_cores
from studio_core.machine.layout import check_core_set, check_layout, mesh_sizes, pick_cores, tp_groups

pytestmark = pytest.mark.fast  # starts no run, torchrun, browser or app: in `pytest -m fast`

TRN2_3XL = instance_hardware("trn2.3xlarge")
TRN2_3XL_LNC1 = instance_hardware("trn2.3xlarge", lnc=1)
TRN2_48XL = instance_hardware("trn2.48xlarge")
TRN3_48XL = instance_hardware("trn3.48xlarge")
CPU8 = Hardware("cpu", 8, cpu_count=8)
CUDA2 = Hardware("cuda", 2, cpu_count=16)
# config.json values of the two seed models
QWEN3_06B = {"num_attention_heads": 16, "num_key_value_heads": 8}
QWEN3_8B = {"num_attention_heads": 32, "num_key_value_heads": 8}
# Every refusal says what to do instead.
FIX_WORDS = ("use ", "write ", "remove ", "make ", "change ", "list ", "name ", "choose ")


# --- parse_cores / format_cores ---------------------------------------------------------
@pytest.mark.parametrize("text, cores", [
    ("0-3", [0, 1, 2, 3]),
    ("0,1", [0, 1]),
    ("2,3", [2, 3]),
    ("0-1,2-3", [0, 1, 2, 3]),
    (" 0 - 1 , 2 ,3 ", [0, 1, 2, 3]),
    ("7", [7]),
    ("16-47", list(range(16, 48))),
    ("2,3,0,1", [2, 3, 0, 1]),  # kept as written: check_core_set reports the order
])
def test_parse_cores(text, cores):
    assert parse_cores(text) == cores


@pytest.mark.parametrize("text, message", [
    ("", "no cores given"),
    ("   ", "no cores given"),
    (None, "no cores given"),
    ("a", "not a core number or a range"),
    ("0-", "not a core number or a range"),
    ("-1", "not a core number or a range"),
    ("0,,1", "not a core number or a range"),
    ("1.5", "not a core number or a range"),
    ("0-3;4", "not a core number or a range"),
    ("3-0", "reversed range: write 0-3"),
    ("0-3,2", "core 2 appears twice"),
    ("1,1", "core 1 appears twice"),
])
def test_parse_cores_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cores(text)


@pytest.mark.parametrize("cores, text", [
    ([0, 1, 2, 3], "0-3"), ([2], "2"), ([0, 1], "0-1"), ([0, 2], "0,2"), ([0, 1, 4], "0-1,4"),
    (list(range(16, 48)), "16-47"),
])
def test_format_cores_round_trips(cores, text):
    assert format_cores(cores) == text
    assert parse_cores(text) == cores


# --- check_core_set ---------------------------------------------------------------------
@pytest.mark.parametrize("hardware, text, problem", [
    # TRL's Trainium guide, trn2.3xlarge at LNC=2
    (TRN2_3XL, "0-3", None),
    (TRN2_3XL, "0,1", None),
    (TRN2_3XL, "2,3", None),
    (TRN2_3XL, "3", None),
    (TRN2_3XL, "1,2", "1,2 is not aligned (it must start at a multiple of 2): use 0,1 or 2,3"),
    (TRN2_3XL, "1-3", "1-3 is 3 cores: a multi-core set must be 2, 4, 8, ... cores (collectives fail "
                      "otherwise); use 2 cores (0,1 or 2,3) or 4 cores (0-3)"),
    (TRN2_3XL, "0,2", "0,2 is not contiguous: use 0,1 or 2,3"),
    (TRN2_3XL, "2,3,0,1", "2,3,0,1 is not in increasing order: write 0-3"),
    (TRN2_3XL, "4", "core 4 not on trn2.3xlarge: 4 NeuronCores on 1 chip(s), LNC=2, 96 GiB per chip: use cores 0-3"),
    (TRN2_3XL, "0-7", "cores 4, 5, 6, 7 not on trn2.3xlarge"),
    (TRN2_3XL_LNC1, "0-7", None),
    (TRN2_3XL_LNC1, "4-7", None),
    (TRN2_3XL_LNC1, "2-5", "not aligned"),
    # half a trn2.48xlarge: aligned to its own size (neuron.md), so 0-31 or 32-63
    (TRN2_48XL, "0-31", None),
    (TRN2_48XL, "32-63", None),
    (TRN2_48XL, "16-47", "16-47 is not aligned (it must start at a multiple of 32): use 0-31 or 32-63"),
    (TRN2_48XL, "8-39", "8-39 is not aligned (it must start at a multiple of 32): use 0-31 or 32-63"),
    (TRN2_48XL, "0-63", None),
    (TRN2_48XL, "4-7", None),  # one chip
    (TRN2_48XL, "2-5", "not aligned"),  # two half chips
    (TRN2_48XL, "4-11", "not aligned (it must start at a multiple of 8)"),
    (TRN2_48XL, "40-71", "cores 64, 65, 66, 67, 68, 69, 70, 71 not on trn2.48xlarge"),
    (TRN3_48XL, "32-63", None),
    (TRN3_48XL, "0-11", "12 cores"),
])
def test_check_core_set(hardware, text, problem):
    problems = check_core_set(parse_cores(text), hardware)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems
        assert all(any(word in p for word in FIX_WORDS) for p in problems), problems


def test_check_core_set_lists_duplicates_and_empty():
    assert "lists a core twice" in check_core_set([0, 0], TRN2_3XL)[0]
    assert "no cores given" in check_core_set([], TRN2_3XL)[0]


# --- check_layout -----------------------------------------------------------------------
@pytest.mark.parametrize("nproc, tp, fsdp, cores, hardware, config, problem", [
    # seed: data parallel on a trn2.3xlarge
    (4, 1, 1, "0-3", TRN2_3XL, QWEN3_06B, None),
    (2, 1, 1, "0,1", TRN2_3XL, QWEN3_06B, None),
    (2, 1, 1, "2,3", TRN2_3XL, QWEN3_06B, None),
    (4, 1, 1, None, TRN2_3XL, None, None),
    (1, 1, 1, "3", TRN2_3XL, None, None),
    (2, 1, 1, "1,2", TRN2_3XL, None, "studio.cores: 1,2 is not aligned"),
    (3, 1, 1, "1-3", TRN2_3XL, None, "studio.cores: 1-3 is 3 cores"),
    (2, 1, 1, "0,2", TRN2_3XL, None, "studio.cores: 0,2 is not contiguous"),
    (3, 1, 1, None, TRN2_3XL, None, "studio.nproc: 3 NeuronCores cannot run collectives together"),
    # seed: TP 4 x FSDP 8 = 32 processes on half a trn2.48xlarge
    (32, 4, 8, "0-31", TRN2_48XL, QWEN3_8B, None),
    (32, 4, 8, "32-63", TRN2_48XL, QWEN3_8B, None),
    (32, 4, 8, "16-47", TRN2_48XL, QWEN3_8B, "studio.cores: 16-47 is not aligned"),
    (32, 4, 8, "8-39", TRN2_48XL, QWEN3_8B, "studio.cores: 8-39 is not aligned"),
    (64, 4, 16, "0-63", TRN2_48XL, QWEN3_8B, None),
    (32, 4, 8, None, TRN3_48XL, QWEN3_8B, None),
    # more processes or cores than the machine has
    (8, 1, 1, None, TRN2_3XL, None, "studio.nproc: 8 processes but trn2.3xlarge"),
    (65, 1, 1, None, TRN2_48XL, None, "has 64 NeuronCores: use at most 64"),
    (4, 1, 1, "2-5", TRN2_3XL, None, "cores 4, 5 not on trn2.3xlarge"),
    (4, 1, 1, None, CUDA2, None, "has 2 CUDA devices: use at most 2"),
    # TP x FSDP must be the process count
    (4, 2, 4, None, TRN2_48XL, None, "studio.tp_size x studio.fsdp_size = 2 x 4 = 8 must equal studio.nproc = 4"),
    (32, 4, 4, "0-31", TRN2_48XL, None, "= 16 must equal studio.nproc = 32"),
    # cores must match the process count
    (4, 1, 1, "0,1", TRN2_3XL, None, "studio.cores: 0,1 is 2 core(s) but studio.nproc is 4"),
    (2, 1, 1, "zero", TRN2_3XL, None, "studio.cores: 'zero' in 'zero' is not a core number"),
    # TP must divide the heads (Qwen3-0.6B: 16 / 8, Qwen3-8B: 32 / 8)
    (4, 4, 1, "0-3", TRN2_3XL, QWEN3_06B, None),
    (2, 2, 1, None, TRN2_3XL, QWEN3_06B, None),
    (8, 8, 1, "0-7", TRN2_48XL, QWEN3_8B, None),
    (3, 3, 1, None, TRN2_48XL, QWEN3_06B, "studio.tp_size: 3 does not divide the model's 16 attention heads "
                                           "(16 attention, 8 key/value): use 1, 2, 4, 8"),
    (16, 16, 1, "0-15", TRN2_48XL, QWEN3_8B, "studio.tp_size: 16 does not divide the model's 8 key/value heads"),
    (16, 16, 1, "0-15", TRN2_48XL, {"text_config": QWEN3_8B}, "does not divide the model's 8 key/value heads"),
    (16, 16, 1, "0-15", TRN2_48XL, {"num_attention_heads": 32}, None),  # no num_key_value_heads: MHA
    # CPU backend: data parallel only, up to the CPU cores
    (2, 2, 1, None, CPU8, None, "not supported on the CPU backend: use data parallel"),
    (8, 1, 8, None, CPU8, None, "not supported on the CPU backend"),
    (16, 1, 1, None, CPU8, None, "studio.nproc: 16 processes but this machine has 8 CPU cores: use at most 8"),
    (8, 1, 1, None, CPU8, None, None),
    (3, 1, 1, None, CPU8, None, None),  # any count on CPU: no NeuronCore collectives
    (2, 1, 1, "0,1", CPU8, None, None),  # CPU cores to pin to: no alignment needed
    (2, 1, 1, "1,2", CPU8, None, None),
    (2, 1, 1, "7-8", CPU8, None, "goes past the 8 cpu cores (0-7): choose cores below 8"),
    (2, 1, 1, "0", CPU8, None, "is 1 core(s) but studio.nproc is 2"),
    # detected hardware at LNC=1 on 16 chips: 128 devices, as many as TorchNeuron allows a process
    (4, 1, 1, "0-3", Hardware("neuron", 128, 192, chips=16, lnc=1), None, None),
    # a machine whose cores a process naming none could not all see
    (4, 1, 1, "0-3", Hardware("neuron", 256, 384, chips=32, lnc=1), None,
     "TorchNeuron allows 128 devices per process: use LNC=2"),
    # sizes that are not whole numbers
    (0, 1, 1, None, TRN2_3XL, None, "studio.nproc: got 0; use a whole number of at least 1"),
    (2, True, 1, None, TRN2_3XL, None, "studio.tp_size: got True; use a whole number"),
])
def test_check_layout(nproc, tp, fsdp, cores, hardware, config, problem):
    problems = check_layout(nproc, tp, fsdp, cores, hardware, config)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems
        assert all(any(word in p for word in FIX_WORDS) for p in problems), problems


def test_check_layout_takes_a_parsed_list_too():
    assert check_layout(2, 1, 1, [2, 3], TRN2_3XL) == []
    assert "not aligned" in check_layout(2, 1, 1, [1, 2], TRN2_3XL)[0]


# --- pick_cores -------------------------------------------------------------------------
ALL_3XL, ALL_48XL = set(range(4)), set(range(64))


@pytest.mark.parametrize("nproc, free, hardware, block", [
    (1, ALL_3XL, TRN2_3XL, [0]),
    (2, ALL_3XL, TRN2_3XL, [0, 1]),
    (4, ALL_3XL, TRN2_3XL, [0, 1, 2, 3]),
    (1, ALL_3XL - {0}, TRN2_3XL, [1]),
    (2, ALL_3XL - {0}, TRN2_3XL, [2, 3]),  # not 1,2: collectives fail there
    (2, ALL_3XL - {2}, TRN2_3XL, [0, 1]),
    (2, ALL_3XL - {0, 3}, TRN2_3XL, None),  # 1 and 2 are free but not a valid pair
    (4, ALL_3XL - {0}, TRN2_3XL, None),
    (3, ALL_3XL, TRN2_3XL, None),
    (8, ALL_3XL, TRN2_3XL, None),
    (32, ALL_48XL, TRN2_48XL, list(range(0, 32))),
    (32, ALL_48XL - set(range(16)), TRN2_48XL, list(range(32, 64))),
    (32, ALL_48XL - {20}, TRN2_48XL, list(range(32, 64))),
    (32, ALL_48XL - {20, 40}, TRN2_48XL, None),
    (4, ALL_48XL - set(range(0, 64, 4)), TRN2_48XL, None),  # a core busy on every chip
    (4, ALL_48XL - {1}, TRN2_48XL, [4, 5, 6, 7]),
])
def test_pick_cores(nproc, free, hardware, block):
    picked = pick_cores(nproc, free, hardware)
    assert picked == block
    if picked is not None:
        assert check_layout(nproc, 1, 1, picked, hardware) == []


def test_pick_cores_needs_a_process():
    with pytest.raises(ValueError, match="at least 1"):
        pick_cores(0, ALL_3XL, TRN2_3XL)


# --- tp_groups --------------------------------------------------------------------------
@pytest.mark.parametrize("nproc, tp, groups", [
    (32, 4, [list(range(i, i + 4)) for i in range(0, 32, 4)]),
    (4, 1, [[0], [1], [2], [3]]),
    (4, 4, [[0, 1, 2, 3]]),
    (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_tp_groups(nproc, tp, groups):
    assert tp_groups(nproc, tp) == groups


@pytest.mark.parametrize("nproc, tp", [(6, 4), (4, 0)])
def test_tp_groups_refuses_a_size_that_does_not_divide(nproc, tp):
    with pytest.raises(ValueError, match="does not divide"):
        tp_groups(nproc, tp)


@pytest.mark.parametrize("nproc, tp", [(32, 4), (8, 2), (4, 4), (4, 1)])
def test_tp_groups_match_transformers_device_mesh(nproc, tp):
    """Build the mesh with Transformers itself, on torch's fake process group (no devices)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    dist.init_process_group("fake", rank=0, world_size=nproc, store=FakeStore())
    try:
        _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=tp, fsdp_size=nproc // tp))
        dense = mesh.get_mesh(("pp", "dp_replicate", "fsdp", "tp")).mesh
        assert dense.reshape(-1, tp).tolist() == tp_groups(nproc, tp)
        assert mesh.get_mesh("tp").mesh.tolist() == tp_groups(nproc, tp)[0]  # rank 0's own group
    finally:
        dist.destroy_process_group()


# --- mesh_sizes: one TP x FSDP mesh per node, replicated across nodes --------------------
@pytest.mark.parametrize("tp, fsdp, world, replicas", [
    (4, 8, 32, 1),  # the seed layout on half a trn2.48xlarge
    (4, 8, 128, 4),  # the Slurm script on 4 nodes
    (2, 1, 2, 1),
])
def test_mesh_sizes(tp, fsdp, world, replicas):
    assert mesh_sizes(tp, fsdp, world) == {"tp_size": tp, "fsdp_size": fsdp, "dp_replicate_size": replicas}


def test_mesh_sizes_refuses_a_world_of_partial_meshes():
    with pytest.raises(ValueError, match="run a multiple of 32 processes"):
        mesh_sizes(4, 8, 48)
