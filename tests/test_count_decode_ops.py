"""benchmarks.onpolicy.count_decode_ops: the census of one decode step, and what it guards. The accuracy
benchmark's student (head size 24, float32 weights under bf16 autocast) rotates q and k, writes the cache's new
column and attends in one kernel a layer (the RoPE kernel, the slot write and attention before; a dozen torch ops
stood in for the rotation before the RoPE kernel took halves that are no power of two) and reads cos / sin with one
gather from its session's table (seven kernels a step before). Each residual add runs in the kernel of the norm
that reads its sum (generation/residual_fusion.py), which under autocast also writes the norm in bf16 for the
products that read it. The next step's mask and position ids are made by the bookkeeping kernel as it moves the
slot, not by three torch ops in the step. The census runs the kernels through the interpreter (CPU tensors): it is
for machines without CUDA, where conftest sets the interpreter."""

import collections

import pytest
import torch

from benchmarks.onpolicy.count_decode_ops import decode_step_ops
from liger_patch_kd.demo.arithmetic import ModelShape
from liger_patch_kd.generation import release_sessions

pytestmark = pytest.mark.usefixtures("clean_patches")


@pytest.mark.parametrize("autocast", [True, False])
def test_the_students_decode_step_rotates_in_the_attention_kernel_and_reads_cos_sin_from_its_table(autocast):
    if torch.cuda.is_available():
        pytest.skip("the census interprets the kernels on CPU tensors: TRITON_INTERPRET is set only without CUDA")
    model = ModelShape(96, 2).build(264, seed=0, device="cpu").eval()
    if not autocast:
        model = model.to(torch.bfloat16)
    ops, kernels = decode_step_ops(model, rows=4, prompt=6, autocast=autocast)
    launched = collections.Counter(kernels)
    # RoPE of q and k, the cache's new column and attention: one launch a layer (generation/attention_fusion.py)
    assert launched["_split_kernel"] == 2 and not launched["_merge_kernel"]
    assert not launched["_rope_kernel"] and not launched["_slot_write_kernel"]
    # 2 norms a layer + the final one: each but the first layer's input norm with the add before it
    assert launched["_rms_norm_fwd_kernel"] == 1 and launched["_add_rms_norm_fwd_kernel"] == 4
    names = collections.Counter(name for name, _ in ops)
    assert not [where for name, where in ops if name == "add" and where.startswith("modeling_llama")]
    # autocast casts the first input norm's output for its products, no other norm's (the final one's included)
    assert names["_to_copy"] == (1 if autocast else 0)
    assert not [where for _, where in ops if where.startswith("engine.py")]  # mask, positions: the kernel's
    assert launched["_bookkeeping_kernel"] == 1
    assert not {"cos", "sin", "neg", "cat"} & set(names)  # no torch rotation, no per-step rotary module
    assert [where.split(":")[0] for name, where in ops if name == "index"] == ["rotary_table.py"]
    assert not [where for _, where in ops if where.startswith("rope.py")]
    release_sessions(model)
