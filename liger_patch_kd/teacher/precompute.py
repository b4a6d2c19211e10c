"""Run a teacher over token sequences once and write its top-k log-probs to a store (resumable)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .store import LOGPROB_DTYPES, StoreWriter


def topk_of_logits(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log-probs) of the k most likely tokens of each row, log_softmax in fp32."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return ids, values


@torch.no_grad()
def teacher_topk(
    teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int, temperature: float = 1.0,
    rows_per_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Top-k of a teacher batch (B, T) -> (B, T, k) ids and log-probs, from last hidden states a chunk of rows
    at a time, so the (B x T x V) logits are never held at once. Soft-capping is applied as the model does."""
    from ..models.backbone import run_backbone
    from ..models.kd_forward import output_head, unwrap_model
    from ..models.registry import softcap_of
    from ..models.transforms import scaled_head_inputs
    from ..reference import apply_softcap

    model = unwrap_model(teacher)
    hidden = run_backbone(model, input_ids, attention_mask, {}).last_hidden_state
    head = output_head(model, "teacher")
    hidden, bias = scaled_head_inputs(model, hidden, head.bias)  # the model's logit scale (Granite, Cohere)
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids, values = [], []
    for start in range(0, flat.shape[0], rows_per_chunk):
        logits = F.linear(flat[start : start + rows_per_chunk], head.weight, bias)
        logits = apply_softcap(logits.float(), softcap_of(model.config))
        i, v = topk_of_logits(logits, k, temperature)
        ids.append(i)
        values.append(v)
    shape = (*input_ids.shape, k)
    return torch.cat(ids).reshape(shape), torch.cat(values).reshape(shape)


def precompute(
    teacher: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    top_k: int = 64,
    batch_size: int = 8,
    shard_size: int = 1024,
    logprob_dtype: str = "bfloat16",
    temperature: float = 1.0,
    teacher_name: str = "",
    tokenizer_fp: str | None = None,
    progress: bool = True,
) -> Path:
    """Run `teacher` over `sequences` (lists of token ids) and write a store; resumes an interrupted one.

    Shard i always holds sequences [i * shard_size, (i + 1) * shard_size), so a resumed run writes exactly
    the shards a complete run would (the test checks byte-identical files).
    """
    from tqdm.auto import tqdm

    if logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {sorted(LOGPROB_DTYPES)}; got {logprob_dtype!r}")
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab}]; got {top_k}")
    writer = StoreWriter.open(
        out_dir, teacher=teacher_name, vocab_size=vocab, tokenizer_fingerprint=tokenizer_fp, top_k=top_k,
        logprob_dtype=logprob_dtype, temperature=temperature, shard_size=shard_size, num_sequences=len(sequences),
    )  # fmt: skip
    device = next(teacher.parameters()).device
    n_shards = math.ceil(len(sequences) / shard_size)
    was_training = teacher.training
    teacher.eval()
    with tqdm(total=len(sequences), initial=min(len(sequences), writer.done_shards() * shard_size),
              desc="teacher top-k", unit="seq", disable=not progress) as bar:  # fmt: skip
        for shard in range(writer.done_shards(), n_shards):
            shard_seqs = [
                torch.as_tensor(s, dtype=torch.long) for s in sequences[shard * shard_size : (shard + 1) * shard_size]
            ]
            ids, values = [], []
            for start in range(0, len(shard_seqs), batch_size):
                batch = shard_seqs[start : start + batch_size]
                padded = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True).to(device)
                mask = (
                    torch.arange(padded.shape[1], device=device)[None]
                    < torch.tensor([len(s) for s in batch], device=device)[:, None]
                ).long()
                b_ids, b_values = teacher_topk(teacher, padded, mask, top_k, temperature)
                for row, seq in enumerate(batch):
                    i, v = b_ids[row, : len(seq)].cpu(), b_values[row, : len(seq)].cpu()
                    i[-1], v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
                    ids.append(i)
                    values.append(v)
                bar.update(len(batch))
            writer.write_shard(shard_seqs, torch.cat(ids), torch.cat(values))
    teacher.train(was_training)
    return writer.out_dir
