"""generation.decode_kernel: the Triton split-KV decode attention (run here through the interpreter) equals attention
over the repeated cache in float64, skips blocks nobody attends to, merges splits that read nothing, and is what the
decode engine's steps use when asked: the same tokens as the plain reference loop."""

import pytest
import torch

from liger_patch_kd.generation import Sampling, packed_decode_attention, release_sessions
from liger_patch_kd.generation.decode_attention import decode_kernel, packed_gqa_sdpa
from liger_patch_kd.generation.decode_kernel import (
    BLOCK_N,
    TILE_BYTES,
    block_columns,
    decode_attention,
    rope_write_attend,
    split_count,
)
from liger_patch_kd.generation.sampling_kernel import gumbel_argmax

from .helpers import DEVICE, count_launches
from .test_decode_attention import _reference
from .test_generation import _model, decodes_as_the_reference

pytestmark = pytest.mark.usefixtures("clean_patches")

# The kernel runs where the suite runs: through the interpreter on a CPU, in float64; compiled on a GPU, where Triton
# does not lower a float64 product of 128 columns, in float32 (IEEE products: its own rounding, ~1e-7 a term)
ON_GPU = DEVICE.type == "cuda"
EXACT = torch.float32 if ON_GPU else torch.float64
TIGHT = dict(rtol=2e-5, atol=2e-5) if ON_GPU else dict(rtol=1e-12, atol=1e-12)
INTERPRETER_ONLY = pytest.mark.skipif(
    ON_GPU, reason="a float64 model through the interpreter; the gpu-marked tests run the engine compiled"
)


def _case(batch, heads, kv_heads, dim, length, dtype=EXACT, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    attend = torch.rand(batch, length, generator=g) < 0.7
    attend[:, length // 2] = True  # every row attends somewhere
    attend[0, : length - 3] = False  # a row whose first blocks nobody reads (a long left padding)
    return (*(t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)), attend.to(DEVICE))


def _exact(q, k, v, mask, scale):
    """Attention over the repeated cache in float64, whatever the inputs' dtype."""
    return _reference(q.double(), k.double(), v.double(), mask, scale)


@pytest.mark.parametrize(
    "batch, heads, kv_heads, dim, length",
    [(3, 8, 2, 16, 11), (2, 4, 4, 8, 3 * BLOCK_N + 5), (1, 6, 2, 24, 2 * BLOCK_N), (5, 32, 8, 64, 200),
     (2, 4, 2, 128, 300), (2, 4, 1, 256, 150)],  # wide heads: narrower blocks (block_columns), on a GPU too
)  # fmt: skip
def test_kernel_is_attention_over_the_repeated_cache_in_float64(batch, heads, kv_heads, dim, length):
    q, k, v, attend = _case(batch, heads, kv_heads, dim, length)
    out = decode_attention(q, k, v, attend, scale=0.3)
    want = _exact(q, k, v, attend[:, None, None, :], 0.3)
    assert out.shape == (batch, 1, heads, dim) and out.dtype == EXACT
    torch.testing.assert_close(out.double(), want, **TIGHT)  # accumulation in the inputs' dtype: rounding only


@pytest.mark.parametrize("batch, length, merged", [(4, BLOCK_N, False), (1, 3 * BLOCK_N, True)])  # on any GPU too
def test_one_split_writes_the_output_without_a_merge(monkeypatch, batch, length, merged):
    """With one split per (row, head) the split kernel writes the output and no merge is launched; with several the
    merge runs; both equal attention in float64."""
    import liger_patch_kd.generation.decode_kernel as kernel_module

    merges = count_launches(monkeypatch, kernel_module, "_merge_kernel")
    q, k, v, attend = _case(batch, 8, 2, 16, length, seed=5)
    assert (split_count(batch * 2, length, q.device) > 1) == merged
    out = decode_attention(q, k, v, attend, scale=0.25)
    assert bool(merges) == merged
    torch.testing.assert_close(out.double(), _exact(q, k, v, attend[:, None, None, :], 0.25), **TIGHT)


def test_splits_that_read_nothing_and_strided_caches_merge_exactly():
    """A split whose columns nobody attends to (running max -inf) weighs nothing; the cache a slot cache hands over
    is a view of a longer one (strides of the longer cache)."""
    q, k_long, v_long, _ = _case(2, 8, 2, 16, 4 * BLOCK_N, seed=1)
    k, v = k_long[:, :, : 3 * BLOCK_N], v_long[:, :, : 3 * BLOCK_N]
    attend = torch.zeros(2, 3 * BLOCK_N, dtype=torch.bool, device=DEVICE)
    attend[:, 5:9] = True  # the first split only
    assert split_count(2 * 2, 3 * BLOCK_N, q.device) > 1
    out = decode_attention(q, k, v, attend, scale=0.25)
    torch.testing.assert_close(out.double(), _exact(q, k, v, attend[:, None, None, :], 0.25), **TIGHT)


def test_unattended_columns_inside_the_extent_never_reach_the_sum():
    """The main loop reads every block between a row's first and last attended column of a split: whole blocks
    nobody attends to in between, and NaN / inf in the cache's unattended columns (a slot never written, left
    padding), must weigh exactly nothing."""
    length = 4 * BLOCK_N
    q, k, v, _ = _case(2, 8, 2, 16, length, seed=4)
    attend = torch.zeros(2, length, dtype=torch.bool, device=DEVICE)
    attend[:, 3] = attend[:, 3 * BLOCK_N + 7] = True  # two whole blocks of nobody between
    attend[1, BLOCK_N - 1] = True
    k[:, :, ~attend[0] & ~attend[1]] = float("nan")
    v[:, :, ~attend[0] & ~attend[1]] = float("inf")
    out = decode_attention(q, k, v, attend, scale=0.25)
    clean_k, clean_v = k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)
    want = _exact(q, clean_k, clean_v, attend[:, None, None, :], 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, **TIGHT)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_low_precision_inputs_within_their_rounding(dtype, tol):
    q, k, v, attend = _case(4, 8, 2, 32, 150, dtype=dtype, seed=2)
    out = decode_attention(q, k, v, attend, scale=32**-0.5)
    want = _reference(q.double(), k.double(), v.double(), attend[:, None, None, :], 32**-0.5)
    assert out.dtype == dtype
    # float32: products and sums in float32 (~1e-7 relative, over <= 150 terms); bfloat16: the probabilities are
    # rounded to bf16 (8 bits) before their product with the values, as flash attention does
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_packed_sdpa_takes_the_kernel_only_when_asked(monkeypatch):
    q, k, v, attend = _case(3, 8, 2, 16, 70, seed=3)
    layer = torch.nn.Module()
    layer.num_key_value_groups = 4
    mask = attend[:, None, None, :]
    calls = []
    import liger_patch_kd.generation.decode_attention as D

    monkeypatch.setattr(D, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a))
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    plain, _ = packed_gqa_sdpa(layer, q, k, v, mask, scaling=0.2)
    assert calls == []
    with decode_kernel():
        fused, _ = packed_gqa_sdpa(layer, q, k, v, mask, scaling=0.2)
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=DEVICE).masked_fill(~mask, float("-inf"))
        packed_gqa_sdpa(layer, q, k, v, additive, scaling=0.2)  # not a boolean mask: SDPA's
    assert calls == [1]
    torch.testing.assert_close(fused, plain, **TIGHT)


@INTERPRETER_ONLY
@pytest.mark.parametrize("arch, attends_in", [("llama", "rope_write_attend"), ("olmo2", "decode_attention")])
def test_the_engine_steps_through_the_kernel_and_sample_what_the_reference_samples(monkeypatch, arch, attends_in):
    """Llama's attention layout rotates, writes and attends in one launch (generation/attention_fusion.py); OLMo-2's
    (whole-projection q/k norms) rotates and writes on its own and attends through packed_gqa_sdpa's kernel."""
    import liger_patch_kd.generation.attention_fusion as F
    import liger_patch_kd.generation.decode_attention as D

    calls = []
    monkeypatch.setattr(D, "decode_attention", lambda *a: calls.append("decode_attention") or decode_attention(*a))
    monkeypatch.setattr(F, "rope_write_attend", lambda *a: calls.append("rope_write_attend") or rope_write_attend(*a))
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _model(arch, torch.float64, seed=6)
    with packed_decode_attention():
        decodes_as_the_reference(model, Sampling(temperature=0.8, top_k=30))
    assert calls and set(calls) == {attends_in}  # the kernel attended the engine's decode steps
    release_sessions(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [8, 64])
def test_compiled_kernel_at_the_1b_students_shapes_is_sdpa_within_bf16_rounding(rows):
    """The compiled kernel (bf16 tensor-core products) against float64 attention: 32 query / 8 key-value heads of 64
    dims over a 1024-column cache, left padding and unwritten columns masked."""
    q, k, v, attend = (t.cuda() for t in _case(rows, 32, 8, 64, 1024, dtype=torch.bfloat16, seed=7))
    attend[:, 900:] = False  # columns not written yet: whole blocks skipped
    attend[:, 10] = True  # row 0 attended only columns >= 1021: now one column, far from the others
    out = decode_attention(q, k, v, attend, scale=64**-0.5)
    want = _reference(q.double(), k.double(), v.double(), attend[:, None, None, :], 64**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)  # probabilities rounded to bf16


def test_blocks_narrow_for_wide_heads_so_the_pipelined_tiles_fit_shared_memory():
    """Pipelined stages of key and value tiles must fit a multiprocessor's shared memory: 128 columns of a 256-wide
    float32 head asked for 280 KiB on an H200 (227 KiB) and did not launch (tests/test_kernel_resources.py compiles
    the chosen blocks); the common 128-wide bf16 head keeps 128."""
    assert block_columns(128, torch.bfloat16) == block_columns(64, torch.float32) == BLOCK_N
    for dim in (8, 24, 64, 96, 128, 200, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            block = block_columns(dim, dtype)
            padded = max(16, 1 << (dim - 1).bit_length())
            assert 16 <= block <= BLOCK_N and block & (block - 1) == 0
            assert block * padded * torch.empty((), dtype=dtype).element_size() <= TILE_BYTES, (dim, dtype, block)
            assert block == BLOCK_N or 2 * block * padded * torch.empty((), dtype=dtype).element_size() > TILE_BYTES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dim, dtype", [(256, torch.bfloat16), (128, torch.float32), (256, torch.float32)])
def test_compiled_kernel_takes_wide_heads(dim, dtype):
    """Wide heads (Gemma's 256 in bf16; 128 and 256 in float32, at narrower blocks) launch and equal float64
    attention: the float32 1024 x 24 teacher of the time-to-accuracy benchmark, 4 heads of 256, did not."""
    q, k, v, attend = (t.cuda() for t in _case(8, 4, 2, dim, 700, dtype=dtype, seed=3))
    out = decode_attention(q, k, v, attend, scale=dim**-0.5)
    want = _reference(q.double(), k.double(), v.double(), attend[:, None, None, :], dim**-0.5)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-5  # probabilities rounded to bf16; IEEE float32 products
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


@INTERPRETER_ONLY
def test_the_engine_draws_plain_sampling_through_the_fused_kernel_from_the_models_distribution(monkeypatch):
    """Plain sampling (temperature, no top-k / top-p) draws through sampling_kernel.gumbel_argmax: other random
    numbers than torch's, the same distribution. 2048 rows of one prompt: the first token's counts against the
    model's softmax (chi-square over the ids with expected count >= 5, rest pooled)."""
    import liger_patch_kd.generation.engine as E
    from liger_patch_kd.generation import decode

    from .test_sampling_kernel import chi2_critical, chi2_statistic

    calls = []
    monkeypatch.setattr(E, "gumbel_argmax", lambda *a, **k: calls.append(1) or gumbel_argmax(*a, **k))
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _model("llama", torch.float64, seed=8)
    prompt = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(1)).expand(2048, 5)
    sampling = Sampling(temperature=0.7)
    # the model's own modules (kernels=False): 2048 rows through the RMSNorm / RoPE kernels would take minutes in
    # the interpreter, and this test is about the draw (tests/test_engine_kernels.py checks the engine's kernels)
    options = dict(max_new_tokens=1, sampling=sampling, pad_id=0, kernels=False)
    torch.manual_seed(0)
    tokens, _ = decode(model, prompt, torch.ones_like(prompt), **options)
    assert calls
    with torch.no_grad():
        probs = (model(input_ids=prompt[:1]).logits[0, -1] / 0.7).softmax(-1)
    stat, dof = chi2_statistic(torch.bincount(tokens[:, 0], minlength=probs.numel()), probs)
    assert dof >= 5 and stat < chi2_critical(dof), (stat, dof)  # p = 1e-4, as the kernel's own tests
    torch.manual_seed(0)
    again, _ = decode(model, prompt, torch.ones_like(prompt), **options)
    assert torch.equal(again, tokens)  # the call's seed comes from torch's generator
    release_sessions(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_captured_step_with_the_fused_draw_replays_the_eager_steps_draws():
    """On CUDA plain sampling draws through the fused kernel, keyed by (the call's seed, the step): the captured
    graph (captured, then replayed) makes exactly the eager step's tokens for the same torch seed."""
    from liger_patch_kd.generation import decode

    from .test_generation import _prompts

    model = _model("llama", torch.float32, seed=9).cuda()
    ids, mask = _prompts("cuda")
    runs = []
    for capture in ("eager", "graph", "graph"):
        torch.manual_seed(5)
        runs.append(decode(model, ids, mask, max_new_tokens=12, sampling=Sampling(temperature=0.9), pad_id=0,
                           capture=capture, fuse_projections=True)[0])  # fmt: skip
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])
    release_sessions(model)


def test_masks_of_any_strides_and_calls_the_kernel_cannot_take(monkeypatch):
    """An expanded mask (column stride 0) and a strided view are read where they are (they were read as contiguous:
    wrong columns); a value head size other than the query's, and dropout, go to SDPA; a direct call with shapes it
    cannot take is one line naming them."""
    monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    layer = torch.nn.Module()
    layer.num_key_value_groups = 3
    q, k, v, _ = _case(2, 6, 2, 24, 70, seed=4)
    wide = (torch.rand(2, 1, 1, 140, generator=torch.Generator().manual_seed(0)) < 0.6).to(DEVICE)
    wide[..., -2] = True
    for mask in (torch.ones(2, 1, 1, 1, dtype=torch.bool, device=DEVICE).expand(2, 1, 1, 70), wide[..., ::2]):
        with decode_kernel():
            got, _ = packed_gqa_sdpa(layer, q, k, v, mask)
        torch.testing.assert_close(got.double(), _exact(q, k, v, mask, 24**-0.5), **TIGHT)
    calls = []
    import liger_patch_kd.generation.decode_attention as D

    monkeypatch.setattr(D, "decode_attention", lambda *a: calls.append(1) or decode_attention(*a))
    with decode_kernel():
        short_v = v[..., :16].contiguous()
        try:  # SDPA's: a refusal on a CPU, another value head size taken on CUDA
            packed_gqa_sdpa(layer, q, k, short_v, None)
        except RuntimeError:
            pass
    assert calls == []  # the kernel used to take it and return (2, 1, 6, 24) of garbage
    with pytest.raises(ValueError, match=r"query \(batch, H, 1, d\).*got query \(2, 6, 2, 24\)"):
        decode_attention(torch.cat([q, q], 2), k, v, torch.ones(2, 70, dtype=torch.bool, device=DEVICE), scale=1.0)
    with pytest.raises(ValueError, match=r"stride 1 in their last dim; got \[1, 2, 1\]"):
        decode_attention(q, torch.cat([k, k], -1)[..., ::2], v, torch.ones(2, 70, dtype=torch.bool, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match=r"boolean mask \(batch, length\) = \(2, 70\)"):
        decode_attention(q, k, v, torch.ones(2, 69, dtype=torch.bool, device=DEVICE), scale=1.0)
