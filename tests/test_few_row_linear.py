"""generation.few_row_linear: the decode step's products of a few rows by a weight. The kernel computes F.linear
(float64 sums to float64 rounding, 16-bit outputs to one rounding of their float32 sums), over odd shapes, strided
views and a bias; bad input gets a one-line error; `linear` takes the kernel only at a decode step (inside
decode_kernel(), gradients off, in the dtype F.linear computes in); the engine's every product of a step goes
through it (fused, cast, and the plain linears with their own weights) and decodes what it decodes without."""

import re

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd.generation import Sampling, decode, release_sessions
from liger_patch_kd.generation import few_row_linear as few_row_module
from liger_patch_kd.generation.decode_attention import decode_kernel
from liger_patch_kd.generation.few_row_linear import (
    FEW_ROWS,
    applies,
    few_row_linear,
    launch_config,
    linear,
    shared_memory_bytes,
)
from liger_patch_kd.ops.backend import triton_available

from .helpers import DEVICE
from .test_engine_kernels import _engine_model, _prompts
from .test_onpolicy import tokenizer  # noqa: F401

pytestmark = pytest.mark.skipif(not triton_available(), reason="the few-row product is a Triton kernel")

@pytest.fixture(autouse=True)
def every_product(monkeypatch):
    """The tiny models' products are far narrower than few_row_linear.MIN_OUT_FEATURES (which products take the
    kernel at a real model's shapes): every product takes it here, so that each path is checked through it."""
    monkeypatch.setattr(few_row_module, "MIN_OUT_FEATURES", 0)


DTYPES = [torch.bfloat16, torch.float16, torch.float32] + ([torch.float64] if DEVICE.type == "cpu" else [])
# what a decode step runs through the kernel: float64 on a CPU (the interpreter, sums checked to float64 rounding),
# bfloat16 on a GPU (few_row_linear.GPU_DTYPES)
STEP_DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.bfloat16


def _reference(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _tolerance(dtype: torch.dtype, reference: torch.Tensor, k: int) -> torch.Tensor:
    """What the maths guarantees: float64 sums to k float64 roundings; a 16-bit or float32 output is its float32 sum
    (k roundings of a float32 accumulator, ~k * 2^-24 of the sum of |products|, bounded here by 4 * sqrt(k) * max
    for unit-variance inputs) rounded once (half an ulp of the output dtype), where cuBLAS rounds the same way."""
    eps = torch.finfo(dtype).eps
    magnitude = reference.abs() + 4 * k**0.5
    if dtype == torch.float64:
        return k * eps * magnitude
    return eps / 2 * reference.abs() * 1.01 + k * torch.finfo(torch.float32).eps * magnitude


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n, k, bias", [(1, 64, 512, True), (8, 100, 300, False), (16, 33, 1000, True),
                                              (17, 130, 64, False), (64, 48, 256, True), (3, 5, 7, True)])  # fmt: skip
def test_the_kernel_computes_f_linear(dtype, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    weight = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).to(DEVICE) if bias else None
    got = few_row_linear(x, weight, b)
    want = _reference(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= _tolerance(dtype, want, k)).all()


@pytest.mark.parametrize("config", [{"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2},
                                    {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}])  # fmt: skip
def test_every_tile_configuration_computes_the_same_sums(config):
    """K walked in other tile widths and N split another way: the same float64 product, to rounding."""
    dtype = torch.float64 if DEVICE.type == "cpu" else torch.float32
    x = torch.randn(5, 200, dtype=dtype, device=DEVICE)
    weight = torch.randn(70, 200, dtype=dtype, device=DEVICE)
    want = _reference(x, weight, None)
    got = few_row_linear(x, weight, config=config)
    assert ((got.double() - want).abs() <= _tolerance(dtype, want, 200)).all()


def test_strided_views_leading_dims_and_the_edges():
    """x (rows, 1, K) as a decode step hands it, a slice of a wider buffer (rows apart by more than K), a weight
    that is a row slice of a fused copy, a bias view; no rows; K = 0 (the bias alone)."""
    dtype = torch.float64 if DEVICE.type == "cpu" else torch.float32
    wide = torch.randn(8, 1, 300, dtype=dtype, device=DEVICE)
    x = wide[..., :256]
    fused = torch.randn(96, 256, dtype=dtype, device=DEVICE)
    weight, bias = fused[32:80], torch.randn(96, dtype=dtype, device=DEVICE)[32:80]
    got = few_row_linear(x, weight, bias)
    assert got.shape == (8, 1, 48)
    want = _reference(x, weight, bias)
    assert ((got.double() - want).abs() <= _tolerance(dtype, want, 256)).all()
    assert few_row_linear(x[:0], weight, bias).shape == (0, 1, 48)
    empty_k = few_row_linear(torch.ones(4, 0, dtype=dtype, device=DEVICE), weight[:, :0], bias)
    assert torch.equal(empty_k, bias.expand(4, 48))


@pytest.mark.parametrize("case, message", [
    ("rows", "at most 64 rows; got 65"),
    ("dtypes", "one float dtype for x, weight and bias"),
    ("shapes", "x (..., K) and weight (N, K)"),
    ("bias", "bias (N,) = (48,)"),
    ("stride", "stride 1 in the last dim wanted; got {'weight': 48}"),
    ("bias stride", "got {'bias': 2}"),
    ("ints", "one float dtype"),
    ("gradient", "computes no gradient: call it under torch.no_grad()"),
    ("subclass", "takes plain tensors; got {'weight': 'Marked'}"),
])  # fmt: skip
def test_bad_input_gets_a_one_line_error(case, message):
    x, weight, bias = torch.randn(8, 32, device=DEVICE), torch.randn(48, 32, device=DEVICE), None
    if case == "rows":
        x = torch.randn(FEW_ROWS + 1, 32, device=DEVICE)
    elif case == "dtypes":
        weight = weight.half()
    elif case == "shapes":
        weight = torch.randn(48, 31, device=DEVICE)
    elif case == "bias":
        bias = torch.randn(47, device=DEVICE)
    elif case == "stride":
        weight = torch.randn(32, 48, device=DEVICE).T
    elif case == "bias stride":
        bias = torch.randn(96, device=DEVICE)[::2]
    elif case == "gradient":
        weight.requires_grad_()
    elif case == "subclass":  # what a quantized weight is: its storage is no plain matrix
        weight = weight.as_subclass(Marked)
    else:
        x, weight = x.long(), weight.long()
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        few_row_linear(x, weight, bias)
    assert "\n" not in str(error.value)


class Marked(torch.Tensor):
    pass


def test_rows_of_a_long_prefill_are_read_past_2_to_the_31(monkeypatch):
    """The head reads a prefill's last position: 64 rows a whole prompt apart, the last one past 2**31 elements
    from the first (64 rows x 8,200 tokens x 4,160 features). Only the rows are written (the rest of the buffer is
    never touched, so it stays unmapped memory)."""
    rows, k, stride = 64, 4160, 8200 * 4160
    assert (rows - 1) * stride > 2**31
    storage = torch.empty((rows - 1) * stride + k, dtype=torch.float16, device=DEVICE)
    x = storage.as_strided((rows, 1, k), (stride, k, 1))
    x.copy_(torch.randn(rows, 1, k, dtype=torch.float64).half())
    weight = torch.randn(16, k, dtype=torch.float64).half().to(DEVICE)
    got = few_row_linear(x, weight)
    want = _reference(x, weight, None)
    assert ((got.double() - want).abs() <= _tolerance(torch.float16, want, k)).all()


def test_linear_takes_the_kernel_only_at_a_decode_step(monkeypatch):
    """Outside decode_kernel(), with gradients, over FEW_ROWS rows, and under autocast in float32 (where F.linear
    computes in the autocast dtype): F.linear. float64 under autocast: the kernel (autocast leaves float64 alone)."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    x, weight = (torch.randn(*shape, device=DEVICE, dtype=STEP_DTYPE) for shape in ((8, 64), (32, 64)))
    with torch.no_grad():
        assert not applies(x, weight, None)  # outside the engine's decode
    with decode_kernel():
        assert not applies(x, weight, None)  # gradients on
        with torch.no_grad():
            assert applies(x, weight, None)
            assert applies(x[:1], weight[:5], None)
            assert not applies(torch.randn(FEW_ROWS + 1, 64, device=DEVICE, dtype=STEP_DTYPE), weight, None)
            assert applies(x.float(), weight.float(), None) == (DEVICE.type == "cpu")  # GPU_DTYPES: 16 bits
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                assert not applies(x.float(), weight.float(), None)
                assert applies(x.bfloat16(), weight.bfloat16(), None)
                assert applies(x.double(), weight.double(), None) == (DEVICE.type == "cpu")
    calls = []
    monkeypatch.setattr(few_row_module, "launch", lambda x, w, **k: calls.append(1) or F.linear(x, w, k["bias"]))
    with torch.no_grad(), decode_kernel():
        linear(x, weight)
    linear(x, weight)
    assert len(calls) == 1


def test_launch_config_stays_in_shared_memory():
    """A stage's tiles (x's padded rows and the weight's, 16-bit or float32) times the stages fit what a program
    may hold on the GPU (Ampere's smallest, 99 KiB, off a GPU)."""
    device = torch.device("cuda") if DEVICE.type == "cuda" else torch.device("cpu")
    for rows, n, k in [(8, 3072, 2048), (8, 2048, 8192), (64, 16384, 2048), (8, 128256, 2048), (1, 8, 16)]:
        for size in (2, 4):
            config = launch_config(rows, n, k, size, device)
            m = max(16, 1 << (rows - 1).bit_length())
            stage = (m + config["BLOCK_N"]) * config["BLOCK_K"] * size
            assert stage * config["num_stages"] <= shared_memory_bytes(device)


def _decode(model, monkeypatch, kernel: bool, fuse: bool):
    with monkeypatch.context() as m:
        shapes = []
        if kernel:
            launch = few_row_module.launch

            def recorded(x, weight, up_weight=None, **options):
                # every product the step launches: a weight, or gate and up with the activation (mlp_fusion.py)
                shapes.extend(tuple(w.shape) for w in (weight, up_weight) if w is not None)
                return launch(x, weight, up_weight, **options)

            m.setattr(few_row_module, "launch", recorded)
        else:
            m.setattr(few_row_module, "step_applies", lambda x: False)
        ids, mask = (t.to(DEVICE) for t in _prompts())
        torch.manual_seed(3)
        out = decode(model, ids, mask, max_new_tokens=6, sampling=Sampling(temperature=0.9), pad_id=0,
                     logprobs=True, capture="eager", fuse_projections=fuse)  # fmt: skip
    release_sessions(model)
    return out, set(shapes)


@pytest.mark.parametrize("arch, fuse", [("llama", False), ("llama", True), ("qwen2", True), ("phi3", False)])
def test_a_session_decodes_what_it_decodes_with_cublas_every_product_through_the_kernel(arch, fuse, monkeypatch):
    """float64 on a CPU (the interpreter): the same tokens, log-probs to float64 rounding; bfloat16 on a GPU, where
    cuBLAS sums in another order: the same tokens on these prompts, log-probs to bfloat16 logits' rounding;
    every product of a decode step took the kernel: each linear's own weight, or with fuse_projections the
    concatenated q/k/v (with Qwen2's biases) copy; gate and up through the gated kernel, with their own weights or
    the halves of the gate/up copy."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model(arch, STEP_DTYPE, seed=6).to(DEVICE)
    (tokens, logprobs), shapes = _decode(model, monkeypatch, kernel=True, fuse=fuse)
    (plain, plain_logprobs), _ = _decode(model, monkeypatch, kernel=False, fuse=fuse)
    assert torch.equal(tokens, plain)
    torch.testing.assert_close(logprobs, plain_logprobs, rtol=0, atol=1e-10 if DEVICE.type == "cpu" else 0.1)
    if not fuse:
        halved = {"gate_up_proj"}  # Phi-3's: its gate and up halves reach the gated kernel
        assert {(m.out_features // (2 if name.rsplit(".", 1)[-1] in halved else 1), m.in_features)
                for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)} <= shapes  # fmt: skip
        return
    attention, mlp, hidden = model.model.layers[0].self_attn, model.model.layers[0].mlp, model.config.hidden_size
    assert {tuple(attention.o_proj.weight.shape), tuple(mlp.down_proj.weight.shape), tuple(model.lm_head.weight.shape),
            (sum(getattr(attention, p).out_features for p in ("q_proj", "k_proj", "v_proj")), hidden),
            tuple(mlp.up_proj.weight.shape)} <= shapes  # fmt: skip


def test_a_patch_of_nn_linear_itself_keeps_every_kernel_away(monkeypatch):
    """A library that patches nn.Linear.forward (every linear computing something else): no linear of the decode
    step takes the kernel or a copy, fused or not, and the session decodes what the patched model's forward
    gives."""
    from .test_engine_kernels import _forward_logprobs

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    model = _engine_model("llama", STEP_DTYPE, seed=3).to(DEVICE)
    original = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: original(self, x) * 0.9)
    ids, mask = (t.to(DEVICE) for t in _prompts())
    for fuse in (False, True):
        (tokens, logprobs), shapes = _decode(model, monkeypatch, kernel=True, fuse=fuse)
        assert not shapes
        want = _forward_logprobs(model, ids, mask, tokens)
        torch.testing.assert_close(logprobs.double(), want, rtol=0, atol=2e-6 if DEVICE.type == "cpu" else 0.1)


def test_only_the_wide_products_take_the_kernel_by_default(monkeypatch):
    """MIN_OUT_FEATURES as shipped: a head-wide product takes the kernel, a q/k/v-wide one stays with cuBLAS."""
    monkeypatch.undo()  # the shipped threshold (every_product lowered it)
    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    assert few_row_module.MIN_OUT_FEATURES == 8192
    widths, kernel = [], few_row_module.launch
    monkeypatch.setattr(few_row_module, "launch", lambda *a, **k: widths.append(len(a[1])) or kernel(*a, **k))
    x = torch.randn(4, 16, device=DEVICE, dtype=STEP_DTYPE)
    with torch.no_grad(), decode_kernel():
        for n in (8192, 3072):
            assert linear(x, torch.randn(n, 16, device=DEVICE, dtype=STEP_DTYPE)).shape == (4, n)
    assert widths == [8192]


@pytest.mark.parametrize("precision", ["float64", "bf16 autocast"])
def test_kdtrainer_trains_on_policy_through_the_kernel(precision, tmp_path, tokenizer, monkeypatch):  # noqa: F811
    """KDTrainer.train() on-policy, its rollouts through the decode engine: every product of a decode step through
    the few-row kernel (the gated one for gate/up). A float64 student (no autocast) trains to the losses the same
    run gives through the CPU's BLAS, to float64 rounding (the same completions); a float32 student under bf16
    autocast (bf16=True) launches the kernel in bf16 on the session's cast copies and trains to finite losses."""
    from liger_patch_kd.generation.engine import session_of
    from liger_patch_kd.trainer import KDTrainer

    from .test_onpolicy import PROMPTS, _args
    from .tiny_models import tiny_model

    if DEVICE.type == "cpu":
        monkeypatch.setenv("LIGER_KD_BACKEND", "triton")
    dtype = torch.float64 if precision == "float64" else torch.float32

    def run(kernel: bool):
        launched, launch = [], few_row_module.launch

        def recorded(x, weight, up_weight=None, **options):
            launched.append((x.dtype, up_weight is not None))
            return launch(x, weight, up_weight, **options)

        with monkeypatch.context() as m:
            m.setattr(few_row_module, "launch", recorded)
            if not kernel:
                m.setattr(few_row_module, "step_applies", lambda x: False)
            student = tiny_model("llama", dtype=dtype, seed=1).to(DEVICE)
            student.set_attn_implementation("sdpa")
            trainer = KDTrainer(model=student, teacher_model=tiny_model("llama", dtype=dtype, seed=2).to(DEVICE),
                                processing_class=tokenizer, train_dataset=PROMPTS,
                                args=_args(tmp_path, max_steps=2, kd_generation_cache="graph",
                                           bf16=precision != "float64", use_cpu=DEVICE.type == "cpu"))  # fmt: skip
            trainer.train()
        session = session_of(student)
        # the rollouts decode under the Trainer's autocast from the call's start (OnPolicySteps' precision): the
        # session holds bf16 copies of the float32 weights, not autocast casting them inside every step
        assert session is not None and session.key.key_dtype == (None if dtype == torch.float64 else torch.bfloat16)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return torch.tensor(losses, dtype=torch.float64), launched

    losses, launched = run(kernel=True)
    assert len(losses) == 2 and torch.isfinite(losses).all()
    assert {gated for _, gated in launched} == {True, False}  # the plain kernel and the gated one
    if precision == "float64":
        plain, none = run(kernel=False)
        assert not none
        torch.testing.assert_close(losses, plain, rtol=1e-9, atol=0)
    else:
        assert {dtype for dtype, _ in launched} == {torch.bfloat16}
