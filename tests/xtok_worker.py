"""Worker for test_distributed's cross-tokenizer checks: one process of a 2-process run (gloo on CPU, NCCL on GPUs)
of `compute_cross_tokenizer_loss` with the student and the teacher sharded by FSDP2 (or the student in DDP),
against one process on the whole batch.

The parent (`prepare`) builds the batches once: the whole collated batch and each rank's rows of it, padded to
the whole batch's lengths, with the groups renumbered from 0 (what a collator gives a rank for its own rows), so
that every row has the same shapes in both runs. As in fsdp_worker, each rank's loss is normalised by the whole
batch's item count and scaled by the world size (FSDP and DDP average gradients over ranks); the gathered
gradients must then equal one process's on the whole batch.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from liger_patch_kd.align import CrossTokenizerCollator, CrossTokenizerConfig, VocabMap, byte_level_to_text

from .fsdp_worker import relative_error, shard_fsdp2
from .tiny_models import tiny_model

EXAMPLES = [{"prompt": "At dawn, ", "completion": "the fox sees a cat."},
            {"prompt": "The mill ", "completion": "stands by the river; 8 or 9."},
            {"prompt": "", "completion": "A heron watches the old mill."},
            {"prompt": "Night: ", "completion": "owls call twice, then once."}]  # fmt: skip
# the teacher divides its logits by logits_scaling (Granite), so the scale folded in inside its forward is checked
STUDENT, TEACHER = dict(arch="llama", hidden=32, layers=2, seed=1), dict(arch="granite", hidden=48, layers=2, seed=2)
CONFIG = CrossTokenizerConfig(kind="hybrid", hard_weight=0.2, uld_top_k=16, temperature=1.3)
TOP_K = 8  # offline: the teacher's top-k per position


def model_of(spec: dict, vocab: int, dtype: torch.dtype):
    spec = dict(spec)
    return tiny_model(spec.pop("arch"), dtype=dtype, vocab=vocab, **spec)


def _rows_of(batch: dict, rows: slice) -> dict:
    """A rank's rows of the collated batch, the align groups renumbered from 0 (they are global in a batch)."""
    part = {k: v[rows] for k, v in batch.items()}
    s, t = part["student_align_groups"], part["teacher_align_groups"]
    first = int(s[s >= 0].min())
    part["student_align_groups"] = torch.where(s >= 0, s - first, s)
    part["teacher_align_groups"] = torch.where(t >= 0, t - first, t)
    return part


def tokenizers():
    """The demo's tokenizers (a byte-level BPE student, a character-level teacher) and their collator."""
    from liger_patch_kd.demo import BOS, load_corpus
    from liger_patch_kd.demo.cross_tokenizer import CharTokenizerWithOffsets, train_bpe_tokenizer

    char = CharTokenizerWithOffsets(load_corpus())
    bpe = train_bpe_tokenizer(load_corpus()[:8000], 300)
    return bpe, char, CrossTokenizerCollator(bpe, char, student_prefix_ids=(BOS,), teacher_prefix_ids=(BOS,))


def build_inputs(world: int) -> dict:
    """The batches (online and offline: whole, and each of `world` ranks' rows), the vocabulary map and the two
    vocabulary sizes."""
    bpe, char, collator = tokenizers()
    vocab_map = VocabMap.build(bpe, char, normalize=byte_level_to_text, teacher_vocab_size=len(char))
    teacher = model_of(TEACHER, len(char), torch.float64)
    offline_rows = []
    for example in EXAMPLES:  # the teacher's top-k on its own ids, as a store holds them
        ids = torch.tensor([collator.teacher_sequence(example)])
        with torch.no_grad():
            values, top = torch.log_softmax(teacher(input_ids=ids).logits, -1).topk(TOP_K, dim=-1)
        offline_rows.append(dict(example, teacher_input_ids=ids[0].tolist(), teacher_token_ids=top[0],
                                 teacher_logprobs=values[0]))  # fmt: skip
    batches = {}
    for mode, rows in (("online", EXAMPLES), ("offline", offline_rows)):
        whole = collator(rows)
        share = len(rows) // world
        parts = [_rows_of(whole, slice(r * share, (r + 1) * share)) for r in range(world)]
        batches[mode] = (whole, parts)
    return dict(batches=batches, vocab_map=vocab_map, sizes=dict(student=bpe.get_vocab_size(), teacher=len(char)))


def prepare(path: str, world: int) -> None:
    """build_inputs, saved for the workers (built once, in the parent)."""
    torch.save(build_inputs(world), path)


def _loss(student, teacher, batch, vocab_map, n_items):
    from liger_patch_kd.trainer.teachers.other_tokenizer_loss import compute_cross_tokenizer_loss

    return compute_cross_tokenizer_loss(student, teacher, batch, CONFIG, vocab_map, n_items).loss


def _gathered(model, what: str) -> dict[str, torch.Tensor]:
    """name -> the whole gradient or parameter: DTensors gathered (FSDP2), plain tensors as they are (DDP)."""
    model = getattr(model, "module", model)  # DDP's replica, under the original names
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
    return out


def run(rank: int, world: int, init_file: str, data_path: str, cases: list[str], result_path: str,
        backend: str = "gloo") -> None:  # fmt: skip
    """`cases`: "<wrapper>-<mode>-<dtype>" with wrapper fsdp2 (student and teacher fully_shard-ed: decoder layers,
    then the root) or ddp (the student in DistributedDataParallel, the teacher whole), mode online (a live teacher)
    or offline (the teacher's top-k in the batch), dtype of both models float64 or bfloat16. Three SGD steps each;
    errors of the loss, every gradient and the parameters after the steps (fsdp_worker.relative_error), keyed
    "<case> step <i> ...", saved by rank 0. Backend "gloo": CPU tensors; "nccl": one GPU per process."""
    os.environ.update(NCCL_NVLS_ENABLE="0")
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = torch.load(data_path, weights_only=False)
    errors: dict[str, float] = {}
    for case in cases:
        wrapper, mode, dtype = case.split("-")
        model_dtype = getattr(torch, dtype)
        exact = model_dtype == torch.float64
        whole, parts = (
            {k: v.to(device) for k, v in b.items()} for b in (data["batches"][mode][0], data["batches"][mode][1][rank])
        )
        for batch in (whole, parts):
            if "teacher_logprobs" in batch:
                batch["teacher_logprobs"] = batch["teacher_logprobs"].to(model_dtype)
        n_items = (whole["labels"][:, 1:] != -100).sum()
        student = model_of(STUDENT, data["sizes"]["student"], model_dtype).to(device).train()
        teacher = None if mode == "offline" else model_of(TEACHER, data["sizes"]["teacher"], model_dtype).to(device)
        teacher = None if teacher is None else teacher.requires_grad_(False)
        reference, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
        if wrapper == "fsdp2":
            sharded = shard_fsdp2(copy.deepcopy(student), device.type)
            sharded_teacher = None if teacher is None else shard_fsdp2(copy.deepcopy(teacher), device.type)
        else:
            ids = None if device.type == "cpu" else [rank]
            sharded = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(student), device_ids=ids)
            sharded_teacher = copy.deepcopy(teacher)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
        ref_named = dict(reference.named_parameters())
        for step in range(3):
            ref_loss = _loss(reference, ref_teacher, whole, data["vocab_map"], n_items)
            ref_loss.backward()
            loss = _loss(sharded, sharded_teacher, parts, data["vocab_map"], n_items)
            (loss * world).backward()  # FSDP and DDP average gradients over ranks
            total = loss.detach().double()
            dist.all_reduce(total)
            scale = 1.0 if exact else abs(ref_loss.item())
            errors[f"{case} step {step} loss"] = abs(total.item() - ref_loss.item()) / scale
            for name, grad in _gathered(sharded, "grad").items():
                errors[f"{case} step {step} grad {name}"] = relative_error(grad, ref_named[name].grad, exact)
            ref_opt.step(), opt.step()
            ref_opt.zero_grad(), opt.zero_grad()
        for name, param in _gathered(sharded, "param").items():
            errors[f"{case} after 3 steps {name}"] = relative_error(param, ref_named[name].detach(), exact)
    if rank == 0:
        torch.save(errors, result_path)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as fsdp_worker: gloo's threads can abort the interpreter's teardown after the result is written
