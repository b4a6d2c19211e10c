"""The Triton kernels whose tiles grow with a model's shape launch on every NVIDIA GPU since Ampere: compiled here
for sm_80 and sm_90 (Triton's wheel carries ptxas, no GPU needed), the shared memory each asks for at the tiles its
launcher picks stays within the smallest multiprocessor's (99 KiB). The decode attention kernel asked for 280 KiB at
a 256-wide float32 head before its column blocks narrowed (an on-policy run with a 1024 x 24 teacher stopped on an
H200 with OutOfResources)."""

import pytest
import torch

from benchmarks.common.kernel_resources import SHARED_LIMITS, compiled_resources, tools_available
from liger_patch_kd.generation import decode_kernel, few_row_linear

pytestmark = pytest.mark.skipif(not tools_available(), reason="this Triton ships no NVIDIA ptxas / cuobjdump")

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEADS = [(128, torch.bfloat16), (256, torch.bfloat16), (256, torch.float16), (128, torch.float32), (256, torch.float32)]


def _decode_split(dim: int, dtype: torch.dtype, block: int, arch: int, fused: bool = True) -> dict:
    """decode_kernel._split_kernel as it is launched (4 warps, 2 stages; 4 query heads a key/value head, padded to
    16 rows): by rope_write_attend (`fused`: RoPE and the cache write in the same program, the engine's steps) or
    by decode_attention; on Hopper as a programmatic dependent (generation/dependent_launch.py)."""
    t = TYPES[dtype]
    pointers = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "mask_ptr": "i1", "acc_ptr": "fp32", "max_ptr": "fp32",
                "sum_ptr": "fp32", "out_ptr": t, "new_k_ptr": t, "new_v_ptr": t, "cos_ptr": t, "sin_ptr": t,
                "slot_ptr": "i64"}  # fmt: skip
    scalars = ["kv_heads", "length", "split_len", "stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_kn",
               "stride_vb", "stride_vh", "stride_vn", "stride_mb", "stride_mn", "stride_ob", "stride_oh",
               "stride_nkb", "stride_nkh", "stride_nvb", "stride_nvh", "stride_cb", "stride_sb"]  # fmt: skip
    types = {**{p: "*" + v for p, v in pointers.items()}, **dict.fromkeys(scalars, "i32"), "scale": "fp32"}
    constexprs = dict(GROUP=4, ROWS=decode_kernel.QUERY_ROWS, DIM=dim, BLOCK_D=max(16, 1 << (dim - 1).bit_length()),
                      BLOCK=block, MASK_BLOCK=decode_kernel.MASK_BLOCK, ACC="tl.float32", UPCAST=False, DIRECT=False,
                      FUSED=fused, PDL=arch >= 90)  # fmt: skip
    return dict(kernel="liger_patch_kd.generation.decode_kernel:_split_kernel", types=types, constexprs=constexprs,
                num_warps=decode_kernel.NUM_WARPS, num_stages=decode_kernel.NUM_STAGES, arch=arch,
                aligned=list(pointers))  # fmt: skip


@pytest.fixture(scope="module")
def shared():
    """Shared bytes by (dim, dtype, block, arch, fused): the launcher's blocks on both architectures, fused and
    not, and the 128-column block of a 256-wide float32 head (the one that did not launch), compiled in one go."""
    cases = [(d, t, decode_kernel.block_columns(d, t), a, f) for d, t in HEADS for a in (80, 90) for f in (True, False)]
    cases.append((256, torch.float32, decode_kernel.BLOCK_N, 90, True))
    found = compiled_resources([_decode_split(*case) for case in cases])
    return {case: r["shared_bytes"] for case, r in zip(cases, found)}


@pytest.mark.parametrize("dim, dtype", HEADS)
def test_the_decode_kernel_fits_every_multiprocessors_shared_memory(shared, dim, dtype):
    block = decode_kernel.block_columns(dim, dtype)
    for arch in (80, 90):
        for fused in (True, False):
            assert shared[dim, dtype, block, arch, fused] <= min(SHARED_LIMITS.values()), (dim, dtype, block, arch)


def test_the_check_has_teeth(shared):
    """128 columns of a 256-wide float32 head: more than an H200 holds, what the kernel asked for before."""
    assert shared[256, torch.float32, decode_kernel.BLOCK_N, 90, True] > SHARED_LIMITS["sm_90"]


def _few_row(rows: int, n: int, k: int, dtype: torch.dtype, arch: int, gated: bool) -> dict:
    """few_row_linear._few_row_kernel at the tiles launch_config picks off a GPU (the smallest multiprocessor's
    shared memory), programmatic dependent launch on where the architecture has it."""
    t = TYPES[dtype]
    config = few_row_linear.launch_config(rows, n, k, dtype.itemsize, torch.device("cpu"), weights=2 if gated else 1)
    pointers = {"x_ptr": t, "w_ptr": t, "w2_ptr": t, "b_ptr": t, "out_ptr": t}
    scalars = ["rows", "N", "K", "stride_xm", "stride_wn", "stride_w2n", "stride_om"]
    types = {**{p: "*" + v for p, v in pointers.items()}, **dict.fromkeys(scalars, "i32")}
    constexprs = dict(HAS_BIAS=False, EVEN_K=True, GATED=gated, GELU=False, DTYPE=f"tl.{dtype_name(dtype)}",
                      BLOCK_M=max(16, 1 << (rows - 1).bit_length()), BLOCK_N=config["BLOCK_N"],
                      BLOCK_K=config["BLOCK_K"], ACC="tl.float32", UPCAST=False, PDL=arch >= 90)  # fmt: skip
    return dict(kernel="liger_patch_kd.generation.few_row_linear:_few_row_kernel", types=types, constexprs=constexprs,
                num_warps=config["num_warps"], num_stages=config["num_stages"], arch=arch, aligned=list(pointers))


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


FEW_ROW_SHAPES = [(8, 3072, 2048), (64, 2048, 8192), (64, 16384, 2048), (8, 128256, 4096), (64, 8192, 2048)]


def test_the_few_row_product_fits_every_multiprocessors_shared_memory():
    """Its tiles and stages (launch_config off a GPU: the smallest budget) in the 16-bit dtypes it takes on a GPU,
    plain and gated (two weights' tiles a stage), on both architectures. (Registers are the benchmarks' business:
    a 64-row tile spills a few hundred bytes and still keeps up with cuBLAS, probe_few_row_linear.py.)"""
    cases = [(*shape, dtype, arch, gated) for shape in FEW_ROW_SHAPES for dtype in (torch.bfloat16, torch.float16)
             for arch in (80, 90) for gated in (False, True)]  # fmt: skip
    found = compiled_resources([_few_row(*case) for case in cases])
    for case, resources in zip(cases, found):
        assert resources["shared_bytes"] <= min(SHARED_LIMITS.values()), case
