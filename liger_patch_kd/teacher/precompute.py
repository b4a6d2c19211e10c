"""Run a teacher over token sequences once and write its top-k log-probs to a store (resumable)."""

from __future__ import annotations

import hashlib
import json
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
    ids, values = [], []
    for _, logprobs in _logprob_chunks(teacher, input_ids, attention_mask, temperature, rows_per_chunk):
        v, i = logprobs.topk(k, dim=-1)
        ids.append(i)
        values.append(v)
    shape = (*input_ids.shape, k)
    return torch.cat(ids).reshape(shape), torch.cat(values).reshape(shape)


@torch.no_grad()
def teacher_topk_and_next(
    teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int,
    rows_per_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """teacher_topk at temperature 1, plus at each position the log-prob of the next input token and its rank
    (1 = most likely), as vLLM's prompt_logprobs report it: (B, T, k) ids, (B, T, k) log-probs, (B, T) next-token
    log-probs and (B, T) ranks (the last position, with no next token, gets -inf and 0)."""
    following = torch.nn.functional.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
    ids, values, next_lp, ranks = [], [], [], []
    for rows, logprobs in _logprob_chunks(teacher, input_ids, attention_mask, 1.0, rows_per_chunk):
        v, i = logprobs.topk(k, dim=-1)
        own = logprobs.gather(-1, following[rows, None]).squeeze(-1)
        ids.append(i)
        values.append(v)
        next_lp.append(own)
        ranks.append((logprobs > own[:, None]).sum(-1) + 1)
    shape = (*input_ids.shape, k)
    next_lp, ranks = torch.cat(next_lp).reshape(input_ids.shape), torch.cat(ranks).reshape(input_ids.shape)
    next_lp[:, -1], ranks[:, -1] = -math.inf, 0
    return torch.cat(ids).reshape(shape), torch.cat(values).reshape(shape), next_lp, ranks


def _logprob_chunks(teacher, input_ids, attention_mask, temperature: float, rows_per_chunk: int):
    """(rows slice, fp32 log-softmax of those rows' logits) over the flattened (B * T) positions, chunk by chunk."""
    from ..conventions import apply_softcap
    from ..models import unwrap_model
    from ..models.backbone import run_backbone
    from ..models.kd_forward import output_head
    from ..models.registry import softcap_of
    from ..models.transforms import scaled_head_inputs

    model = unwrap_model(teacher)
    hidden = run_backbone(model, input_ids, attention_mask, {}).last_hidden_state
    head = output_head(model, "teacher")
    hidden, bias = scaled_head_inputs(model, hidden, head.bias)  # the model's logit scale (Granite, Cohere)
    flat = hidden.reshape(-1, hidden.shape[-1])
    for start in range(0, flat.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        logits = apply_softcap(
            F.linear(flat[rows].to(head.weight.dtype), head.weight, bias).float(), softcap_of(model.config)
        )
        yield rows, torch.log_softmax(logits / temperature, dim=-1)


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
    encoding: str = "plain",
    inputs: dict | None = None,
) -> Path:
    """Run `teacher` over `sequences` (lists of token ids) and write a store; resumes an interrupted one.

    Shard i always holds sequences [i * shard_size, (i + 1) * shard_size), so a resumed run writes exactly
    the shards a complete run would (the test checks byte-identical files). A resume is refused, naming the
    input, when anything that shapes the store differs: the sequences (content hash), the teacher (config and a
    weights fingerprint; `teacher_name` is only recorded), top_k, temperature, tokenizer, dtype, encoding,
    shard size, or an entry of `inputs` (the CLI adds the data file's hash and --max-length).
    encoding: "plain" or "packed<bits>" (compact ids and log-probs quantised to <bits> bits; see compact.py).
    """
    from tqdm.auto import tqdm

    if logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype must be one of {sorted(LOGPROB_DTYPES)}; got {logprob_dtype!r}")
    vocab = teacher.get_output_embeddings().weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab}]; got {top_k}")
    fingerprint = {
        "sequences": sequences_fingerprint(sequences),
        "teacher": teacher_fingerprint(teacher),
        **(inputs or {}),
    }
    writer = StoreWriter.open(
        out_dir, teacher=teacher_name, vocab_size=vocab, tokenizer_fingerprint=tokenizer_fp, top_k=top_k,
        logprob_dtype=logprob_dtype, temperature=temperature, shard_size=shard_size, num_sequences=len(sequences),
        encoding=encoding, inputs=fingerprint,
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


def sequences_fingerprint(sequences: Sequence[Sequence[int]]) -> str:
    """sha256 of the token ids (lengths included), so a resume with other data or truncation is caught."""
    digest = hashlib.sha256()
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.int64)
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:16]


@torch.no_grad()
def teacher_fingerprint(teacher: torch.nn.Module, samples_per_tensor: int = 4096) -> str:
    """sha256 of the teacher's config and a strided sample of every parameter (names, shapes, dtypes, values).

    Cheap on any model size (a few thousand values per tensor) and independent of where the weights were loaded
    from, so `teacher` and `/abs/path/teacher` agree while another checkpoint of the same architecture does not.
    """
    config = getattr(teacher, "config", None)
    fields = json.loads(config.to_json_string(use_diff=False)) if config is not None else {}
    # where it was loaded from and which transformers wrote it do not change the numbers
    fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "transformers_version"}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, param in teacher.named_parameters():
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // samples_per_tensor)][:samples_per_tensor]
        digest.update(json.dumps([name, list(param.shape), str(param.dtype)]).encode())
        digest.update(sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class BadLine(ValueError):
    """A data line precompute cannot use; the message starts with file:line and says the fix."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_jsonl_sequences(
    path: str | Path, *, tokenizer=None, max_length: int | None = None, vocab_size: int | None = None,
    skip_bad_lines: bool = False,
) -> tuple[list[list[int]], dict[str, int]]:  # fmt: skip
    """Token id sequences from a JSONL file of {"input_ids": [...]} or {"text": "..."} lines (blank lines ignored).

    A line that is not JSON, has neither key, holds no tokens, or holds an id outside [0, vocab_size) raises
    BadLine naming file:line and the fix; with skip_bad_lines it is skipped instead and counted in the returned
    {reason: count}.
    """
    sequences, skipped = [], {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sequences.append(_parse_line(line, tokenizer, max_length, vocab_size, f"{path}:{line_no}"))
            except BadLine as e:
                if not skip_bad_lines:
                    raise
                skipped[e.reason] = skipped.get(e.reason, 0) + 1
    return sequences, skipped


def _parse_line(line: str, tokenizer, max_length: int | None, vocab_size: int | None, where: str) -> list[int]:
    skip = "; or pass --skip-bad-lines to skip such lines"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise BadLine(f"{where}: not valid JSON ({e}){skip}", "invalid JSON") from None
    if not isinstance(record, dict) or not ("input_ids" in record or "text" in record):
        raise BadLine(f"{where}: each line needs 'text' or 'input_ids'{skip}", "no text or input_ids")
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadLine(f"{where}: 'input_ids' must be a list of integers{skip}", "input_ids not integers")
    elif tokenizer is None:
        raise ValueError(f"{where}: a 'text' line needs a tokenizer: pass --tokenizer (or a --teacher that has one)")
    else:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
    ids = ids[:max_length] if max_length else ids
    if not ids:
        raise BadLine(f"{where}: the line holds no tokens; remove it{skip}", "no tokens")
    bad = [t for t in ids if not 0 <= t < (vocab_size if vocab_size is not None else math.inf)]
    if bad:
        raise BadLine(
            f"{where}: token id {bad[0]} is outside the teacher's vocabulary [0, {vocab_size}): the line was "
            f"tokenized for another model; re-tokenize it with the teacher's tokenizer{skip}",
            "token id outside the vocabulary",
        )
    return list(ids)


def file_fingerprint(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
