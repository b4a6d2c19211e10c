"""kd_teacher_attention="cudnn": the teacher's causal attention over repeated key/value heads with cuDNN first
(models/teacher_attention.py) is the same attention, float64 against an explicit reference and against the model's
own "eager" attention; what it does not take (a mask, one query, dropout) is "sdpa"'s call unchanged."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from liger_patch_kd import KDTrainer, KDTrainingArguments
from liger_patch_kd.models.teacher_attention import NAME, cudnn_causal_sdpa, set_teacher_attention

from .tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("clean_patches")

BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 6, 2, 9, 8


class _Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


def _qkv(seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, seq, DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(BATCH, KV_HEADS, seq, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def test_causal_attention_over_repeated_heads_equals_the_reference():
    q, k, v = _qkv()
    out, weights = cudnn_causal_sdpa(_Layer(), q, k, v, None, scaling=0.4)
    k_rep, v_rep = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
    scores = (q @ k_rep.transpose(-1, -2) * 0.4).masked_fill(torch.ones(SEQ, SEQ).triu(1).bool(), float("-inf"))
    expected = (scores.softmax(-1) @ v_rep).transpose(1, 2)
    assert weights is None and out.shape == (BATCH, SEQ, HEADS, DIM)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["a padding mask", "one query (decode)", "dropout"])
def test_what_it_does_not_take_is_sdpas_call(case):
    q, k, v = _qkv()
    mask, dropout = None, 0.0
    if case == "a padding mask":
        mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).tril()
        mask[0, ..., :2] = False
    elif case == "one query (decode)":
        q = q[:, :, -1:]
    else:
        dropout = 0.5
    torch.manual_seed(0)
    ours, _ = cudnn_causal_sdpa(_Layer(), q, k, v, mask, dropout=dropout, scaling=0.3)
    torch.manual_seed(0)
    theirs, _ = hf_sdpa.sdpa_attention_forward(_Layer(), q, k, v, mask, dropout=dropout, scaling=0.3)
    assert torch.equal(ours, theirs)


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_a_teacher_gives_its_sdpa_logits_padded_or_not():
    """Against the same model on "sdpa" (float64 throughout; "eager" takes its softmax in float32)."""
    plain = tiny_model("llama")  # 4 query heads over 2 key/value heads
    plain.config._attn_implementation = "sdpa"
    teacher = tiny_model("llama")
    teacher.config._attn_implementation = "sdpa"
    set_teacher_attention(teacher, "cudnn")
    assert teacher.config._attn_implementation == NAME
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for attention_mask in (None, mask):
        torch.testing.assert_close(
            _logits(teacher, ids, attention_mask), _logits(plain, ids, attention_mask), rtol=1e-12, atol=1e-12
        )
    set_teacher_attention(teacher, "sdpa")
    assert teacher.config._attn_implementation == "sdpa"


def test_a_teacher_that_runs_no_sdpa_is_refused():
    with pytest.raises(ValueError, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        set_teacher_attention(tiny_model("llama"), "cudnn")
    with pytest.raises(ValueError, match="kd_teacher_attention must be one of"):
        set_teacher_attention(tiny_model("llama"), "flash")


def test_the_trainer_option_reaches_the_teacher_and_is_refused_without_one(tmp_path):
    student, teacher = tiny_model("llama", dtype=torch.float32), tiny_model("llama", dtype=torch.float32, seed=1)
    teacher.config._attn_implementation = "sdpa"
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}] * 2
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", kd_teacher_attention="cudnn")
    KDTrainer(model=student, teacher_model=teacher, args=KDTrainingArguments(**args), train_dataset=rows)
    assert teacher.config._attn_implementation == NAME
    with pytest.raises(ValueError, match="kd_teacher_attention='cudnn' changes how an in-process teacher"):
        KDTrainer(model=tiny_model("llama", dtype=torch.float32), args=KDTrainingArguments(**args), train_dataset=rows)
    with pytest.raises(ValueError, match="kd_teacher_attention must be one of"):
        KDTrainingArguments(**{**args, "kd_teacher_attention": "fast"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
def test_on_cuda_the_teacher_attends_on_cudnn_with_its_sdpa_logits():
    plain = tiny_model("llama", dtype=torch.bfloat16, hidden=256).cuda()  # head dim 64, 4 heads over 2
    plain.config._attn_implementation = "sdpa"
    teacher = tiny_model("llama", dtype=torch.bfloat16, hidden=256).cuda()
    teacher.config._attn_implementation = "sdpa"
    set_teacher_attention(teacher, "cudnn")
    ids = torch.randint(3, 200, (2, 128), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ours = _logits(teacher, ids)
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    assert any("cudnn" in k.lower() for k in kernels), kernels
    # bf16 activations: two attention kernels agree to the inputs' rounding, not bitwise
    torch.testing.assert_close(ours.float(), _logits(plain, ids).float(), rtol=0.05, atol=0.05)
