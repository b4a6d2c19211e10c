"""Run a teacher over token sequences once and write its top-k log-probs, or sampled tokens, to a store
(resumable)."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..batch.columns import TEACHER_PROMPT
from ..utils.text_files import read_utf8
from .sampling import sample_teacher_tokens, sequence_generator
from .store import LOGPROB_DTYPES, StoreWriter
from .store.compact import codec_from_spec
from .store.ids import token_ids


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
    for _, _, logprobs in model_chunks(teacher, input_ids, attention_mask, rows_per_chunk)(temperature, None):
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
    return topk_and_next_of(model_chunks(teacher, input_ids, attention_mask, rows_per_chunk), input_ids, k)


def topk_and_next_of(chunks: LogprobChunks, input_ids: torch.Tensor, k: int):
    """teacher_topk_and_next of the log-probs `chunks` yields (a model's, or a served teacher's hidden states and
    head: hidden_chunks), the one computation for both."""
    following = torch.nn.functional.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
    ids, values, next_lp, ranks = [], [], [], []
    for _, rows, logprobs in chunks(1.0, None):
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


@torch.no_grad()
def teacher_samples(
    teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: int, top_k: int,
    temperature: float, generators: Sequence[torch.Generator], rows_per_chunk: int = 1024,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`samples` draws per position from the teacher at `temperature` (after its exact top_k when top_k > 0), as
    sampling.sample_teacher_tokens makes them: (B, T, m) ids, counts, log-probs, then (B, T, k) top-k ids and
    log-probs, every log-prob at `temperature`. Row b (right-padded: its first attention_mask[b].sum() positions)
    draws with generators[b] alone, chunk by chunk from its own start, so its draws do not depend on the rows
    batched with it; padding positions are padding (id -1, count 0, log-prob -inf)."""
    chunks = model_chunks(teacher, input_ids, attention_mask, rows_per_chunk)
    return samples_of_chunks(chunks, input_ids, attention_mask, samples, top_k, temperature, generators)


def samples_of_chunks(
    chunks: LogprobChunks, input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: int, top_k: int,
    temperature: float, generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """teacher_samples of the log-probs `chunks` yields (a model's, or hidden_chunks'), the one computation."""
    b, t = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    spans = [(row * t, row * t + n) for row, n in enumerate(lengths)]
    parts: list = [[] for _ in range(b)]
    for span, _, logprobs in chunks(temperature, spans):
        parts[span].append(sample_teacher_tokens(logprobs, samples, top_k=top_k, generator=generators[span]))
    widths = (samples, samples, samples, top_k, top_k)
    fills = (-1, 0, -math.inf, -1, -math.inf)
    dtypes = (torch.int32, torch.int32, torch.float32, torch.int64, torch.float32)
    device = input_ids.device
    out = [torch.full((b, t, w), f, dtype=d, device=device) for w, f, d in zip(widths, fills, dtypes)]
    for row, drawn in enumerate(parts):
        for n, name in enumerate(("ids", "counts", "logprobs", "topk_ids", "topk_logprobs")):
            if drawn and widths[n]:
                out[n][row, : lengths[row]] = torch.cat([getattr(p, name) for p in drawn]).to(dtypes[n])
    return tuple(out)


# (temperature, spans or None) -> (span index, rows slice, fp32 log-softmax of those rows' logits) over the flattened
# (B * T) positions, chunk by chunk from the start of each span (start, stop) of them (None: one span, all of them)
LogprobChunks = Callable[[float, Sequence[tuple[int, int]] | None], Iterator[tuple[int, slice, torch.Tensor]]]


def model_chunks(teacher: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 rows_per_chunk: int = 1024, vocab_size: int | None = None) -> LogprobChunks:  # fmt: skip
    """The log-prob chunks of a teacher model run over (B, T) ids: its backbone once per pass, then its head (the
    model's logit scale and soft-cap applied as the model does); `vocab_size`: only the head's first rows, the ids a
    model whose head is padded past its tokenizer samples from, are normalised over."""
    from ..models import unwrap_model
    from ..models.backbone import run_backbone
    from ..models.heads import output_head
    from ..models.registry import softcap_of
    from ..models.transforms import scaled_head_inputs

    def chunks(temperature: float, spans=None):
        model = unwrap_model(teacher)
        hidden = run_backbone(model, input_ids, attention_mask, {}).last_hidden_state
        head = output_head(model, "teacher")
        hidden, bias = scaled_head_inputs(model, hidden, head.bias)  # the model's logit scale (Granite, Cohere)
        flat = hidden.reshape(-1, hidden.shape[-1])
        weight, bias = head.weight[:vocab_size], None if bias is None else bias[:vocab_size]
        yield from head_chunks(flat, weight, bias, softcap_of(model.config), temperature, rows_per_chunk, spans)

    return chunks


def hidden_chunks(flat_hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None,
                  rows_per_chunk: int = 1024) -> LogprobChunks:  # fmt: skip
    """The log-prob chunks of final hidden states (B * T, H) already computed (a served teacher's, with its head:
    the logit scale folded into them and the bias), through the same head code as model_chunks."""

    def chunks(temperature: float, spans=None):
        yield from head_chunks(flat_hidden, weight, bias, softcap, temperature, rows_per_chunk, spans)

    return chunks


def head_chunks(flat, weight, bias, softcap, temperature: float, rows_per_chunk: int, spans=None):
    """(span, rows, fp32 log-softmax of cap(h W^T + b) / temperature) a chunk of rows at a time."""
    from ..conventions import apply_softcap
    from ..ops.backend import compute_dtype, logits_fp32, no_autocast

    # under autocast the product runs in its dtype (as nn.Linear's would), autocast off around it
    dtype = compute_dtype(flat.device, weight)
    weight = weight.to(dtype)
    for span, (first, stop) in enumerate(spans if spans is not None else [(0, flat.shape[0])]):
        for start in range(first, stop, rows_per_chunk):
            rows = slice(start, min(start + rows_per_chunk, stop))
            # fp32 out of the product, as the fused losses take their logits: a bf16 head's logits are not rounded
            # to bf16 before the softmax, so stored log-probs are the ones training computes for the same tokens
            with no_autocast(flat.device):  # not held across the yield: the caller's code keeps its autocast
                logits = apply_softcap(logits_fp32(flat[rows].to(dtype), weight, bias), softcap)
                logprobs = torch.log_softmax(logits / temperature, dim=-1)
            yield span, rows, logprobs


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
    samples: int = 0,
    seed: int = 0,
    labels: Sequence[Sequence[int]] | None = None,
) -> Path:
    """Run `teacher` over `sequences` (lists of token ids) and write a store; resumes an interrupted one.

    Shard i always holds sequences [i * shard_size, (i + 1) * shard_size), so a resumed run writes exactly
    the shards a complete run would (the test checks byte-identical files). A resume is refused, naming the
    input, when anything that shapes the store differs: the sequences (content hash), the teacher (config and a
    weights fingerprint; `teacher_name` is only recorded), top_k, temperature, tokenizer, dtype, encoding,
    shard size, or an entry of `inputs` (the CLI adds the data file's hash and --max-length).
    encoding: "plain" or "packed<bits>" (compact ids and log-probs quantised to <bits> bits; see compact.py).
    samples: m > 0 writes m tokens per position sampled from the teacher at `temperature` (distinct ids, counts,
        log-probs at that temperature; store/samples.py), after its exact top_k (the hybrid) or alone (top_k=0);
        `seed` makes the draws reproducible (each sequence draws from a generator seeded from seed and its token ids:
        sampling.sequence_generator; so a resumed run, another batch_size or `liger-kd serve` with sample_seed=seed
        draws the same, on the same device type, up to the rounding of the teacher's batched forward). Train on them
        with losses.fused_linear_sampled_kd (KDTrainer does, from the batch columns) at that same temperature.
    labels: one list per sequence, each position the token itself or -100 (not scored): a store of prompt rows
        (prompt_token_rows) keeps them (store/labels.py), so training on it scores the completions only, as
        training on the rows does; None scores every token.
    """
    vocab = teacher.get_output_embeddings().weight.shape[0]
    check_precompute_args(vocab, top_k=top_k, temperature=temperature, batch_size=batch_size, shard_size=shard_size,
                          logprob_dtype=logprob_dtype, encoding=encoding, samples=samples)  # fmt: skip
    for n, seq in enumerate(sequences):  # before any teacher work: a bad id fails here, not after hours
        if len(token_ids(seq, f"sequence {n}", vocab_size=vocab)) == 0:
            raise ValueError(f"sequence {n} is empty: every sequence needs at least one token; drop it")
    if labels is not None:
        check_labels(sequences, labels)
    fingerprint = {
        "sequences": sequences_fingerprint(sequences),
        **({"labels": sequences_fingerprint(labels)} if labels is not None else {}),
        "teacher": teacher_fingerprint(teacher),
        **(inputs or {}),
    }
    writer = StoreWriter.open(
        out_dir, teacher=teacher_name, vocab_size=vocab, tokenizer_fingerprint=tokenizer_fp, top_k=top_k,
        logprob_dtype=logprob_dtype, temperature=temperature, shard_size=shard_size, num_sequences=len(sequences),
        encoding=encoding, inputs=fingerprint, **({"samples": samples, "sample_seed": seed} if samples else {}),
        **({"labels": True} if labels is not None else {}),
    )  # fmt: skip
    was_training = teacher.training
    try:
        _run(teacher, sequences, writer, top_k, batch_size, shard_size, temperature, progress, samples, seed,
             labels)
    except BaseException:
        if writer.created_manifest and writer.done_shards() == 0:
            writer.abort()  # nothing was finished: leave no store behind that a corrected rerun would trip on
        raise
    finally:
        teacher.train(was_training)
    return writer.finish()


def check_precompute_args(
    vocab: int, *, top_k: int, temperature: float = 1.0, batch_size: int = 1, shard_size: int = 1,
    logprob_dtype: str = "bfloat16", encoding: str = "plain", max_length: int | None = None, samples: int = 0,
) -> None:  # fmt: skip
    """Every precompute option checked before any work: a ValueError naming the option and the fix."""

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(samples) or not 0 <= samples <= 255:
        raise ValueError(f"samples (--samples) must be an integer in [0, 255] (0: top-k only); got {samples!r}")
    low, high = (0, vocab - 1) if samples else (1, vocab)  # with samples, 0 is draws alone; something is left to draw
    if not is_int(top_k) or not low <= top_k <= high:
        bound = f"vocab_size={vocab}" + (" - 1 (something is left to draw)" if samples else "")
        raise ValueError(f"top_k (--top-k) must be an integer in [{low}, {bound}]; got {top_k!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(f"temperature (--temperature) must be a finite number > 0 (1 is the usual); got "
                         f"{temperature!r}")  # fmt: skip
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1; got {value!r}")
    if max_length is not None and (not is_int(max_length) or max_length < 1):
        raise ValueError(f"max_length (--max-length) must be an integer >= 1, or None for no limit; got "
                         f"{max_length!r}")  # fmt: skip
    if not isinstance(logprob_dtype, str) or logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"logprob_dtype (--dtype) must be one of {sorted(LOGPROB_DTYPES)}; got {logprob_dtype!r}")
    codec_from_spec(encoding, vocab, top_k)


def check_labels(sequences: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> None:
    """Labels that fit their sequences (one per token, each the token or -100) and score something, before any
    teacher work: a ValueError naming the sequence."""
    if len(labels) != len(sequences):
        raise ValueError(f"labels: {len(labels)} lists for {len(sequences)} sequences; give one per sequence")
    for n, (seq, label) in enumerate(zip(sequences, labels)):
        label = list(label)
        if len(label) != len(seq):
            raise ValueError(f"labels of sequence {n}: {len(label)} for {len(seq)} tokens; give one per token")
        if any(t not in (-100, s) for t, s in zip(label, seq)):
            raise ValueError(f"labels of sequence {n}: each must be the token itself (scored) or -100 (not scored)")
        if all(t == -100 for t in label[1:]):  # label 0 has no position before it to predict it
            raise ValueError(f"labels of sequence {n} score no token: the row has no completion left to train on; "
                             f"drop it (or keep more of it: raise --max-length)")


def _run(teacher, sequences, writer: StoreWriter, top_k, batch_size, shard_size, temperature, progress, samples=0,
         seed=0, labels=None) -> None:  # fmt: skip
    from tqdm.auto import tqdm

    device = next(teacher.parameters()).device
    n_shards = math.ceil(len(sequences) / shard_size)
    teacher.eval()
    with tqdm(total=len(sequences), initial=min(len(sequences), writer.done_shards() * shard_size),
              desc="teacher top-k", unit="seq", disable=not progress) as bar:  # fmt: skip
        for shard in range(writer.done_shards(), n_shards):
            shard_seqs = [
                torch.as_tensor(s, dtype=torch.long) for s in sequences[shard * shard_size : (shard + 1) * shard_size]
            ]
            ids, values, drawn = [], [], []
            for start in range(0, len(shard_seqs), batch_size):
                batch = shard_seqs[start : start + batch_size]
                padded = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True).to(device)
                mask = (
                    torch.arange(padded.shape[1], device=device)[None]
                    < torch.tensor([len(s) for s in batch], device=device)[:, None]
                ).long()
                if samples:  # each sequence's own generator: its draws are the server's for the same seed
                    generators = [sequence_generator(seed, s, device) for s in batch]
                    *b_draws, b_ids, b_values = teacher_samples(teacher, padded, mask, samples, top_k, temperature,
                                                                generators)  # fmt: skip
                else:
                    b_ids, b_values = teacher_topk(teacher, padded, mask, top_k, temperature)
                for row, seq in enumerate(batch):
                    i, v = b_ids[row, : len(seq)].cpu(), b_values[row, : len(seq)].cpu()
                    i[-1], v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
                    ids.append(i)
                    values.append(v)
                    if samples:
                        d_ids, d_counts, d_lp = (d[row, : len(seq)].cpu() for d in b_draws)
                        d_ids[-1], d_counts[-1], d_lp[-1] = -1, 0, -math.inf
                        drawn.append((d_ids, d_counts, d_lp))
                bar.update(len(batch))
            shard_labels = None if labels is None else labels[shard * shard_size : (shard + 1) * shard_size]
            if samples:
                draws = tuple(torch.cat(part) for part in zip(*drawn))
                writer.write_shard(shard_seqs, torch.cat(ids).long(), torch.cat(values).float(), samples=draws,
                                   labels=shard_labels)  # fmt: skip
            else:
                writer.write_shard(shard_seqs, torch.cat(ids), torch.cat(values), labels=shard_labels)


def sequences_fingerprint(sequences: Sequence[Sequence[int]]) -> str:
    """sha256 of the token ids (lengths included), so a resume with other data or truncation is caught: each
    sequence's length (8 bytes, little-endian), then its ids as int64."""
    digest = hashlib.sha256()
    if sys.byteorder == "little" and all(isinstance(seq, list) for seq in sequences):
        # the same bytes laid out at once: one array of [length, ids...] per sequence, no tensor per sequence
        lengths = [len(seq) for seq in sequences]
        flat = torch.as_tensor([t for seq in sequences for t in seq], dtype=torch.int64).numpy()
        out = np.empty(len(flat) + len(lengths), dtype=np.int64)
        at = np.cumsum([0, *lengths[:-1]], dtype=np.int64) + np.arange(len(lengths))
        keep = np.ones(len(out), dtype=bool)
        keep[at] = False
        out[at], out[keep] = lengths, flat
        digest.update(out.tobytes())
        return digest.hexdigest()[:16]
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.int64)
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:16]


@torch.no_grad()
def teacher_fingerprint(teacher: torch.nn.Module) -> str:
    """sha256 of the teacher's config and of every parameter: names, shapes, dtypes and an exact sum per row.

    Each tensor is seen as rows (its first dimension) of raw bit patterns; per row, the sum of those patterns
    weighted by fixed odd pseudo-random column weights is taken in wrapping int32 arithmetic (exact, so the same
    on every device and for any chunking), and the rows' sums are hashed. Every element of every row counts:
    changing any one value always changes the fingerprint (its bit difference times an odd weight is never
    0 mod 2**32), and other changes to a row go unnoticed only by a ~2**-32 coincidence. It reads each weight once,
    on the weights' own device (measured: 2.1 s bf16 / 2.7 s fp32 for 134M parameters on a busy 2-core CPU), and is
    independent of where the weights were loaded from, so `teacher` and `/abs/path/teacher` agree while another
    checkpoint of the same architecture does not.
    """
    config = getattr(teacher, "config", None)
    fields = json.loads(config.to_json_string(use_diff=False)) if config is not None else {}
    # where it was loaded from and which transformers wrote it do not change the numbers
    fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "transformers_version"}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, param in teacher.named_parameters():
        digest.update(json.dumps([name, list(param.shape), str(param.dtype)]).encode())
        digest.update(tensor_row_sums(param).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


_MIX = (-1640531535, -1028477379)  # 0x9E3779B1, 0xC2B2AE3D as int32: a multiplicative hash of the column index


def tensor_row_sums(t: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """(rows,) int32: per row of `t` (its first dimension; a scalar is one row), the wrapping sum of its elements'
    bit patterns (as int32: 1- and 2-byte values widened, 8-byte ones as two halves) times odd pseudo-random
    column weights. Integer arithmetic, so exact and the same on any device and for any chunking."""
    t = t.detach()
    rows = t.reshape(t.shape[0] if t.dim() else 1, -1)
    if t.is_complex():
        rows = torch.view_as_real(rows).reshape(rows.shape[0], -1)
    rows = rows.contiguous()
    size = rows.element_size()
    if rows.dtype == torch.bool:
        bits = rows.view(torch.uint8)
    else:
        bits = rows.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32}[size])
    cols = bits.shape[1]
    j = torch.arange(cols, dtype=torch.int32, device=t.device)
    weights = (j * _MIX[0] + _MIX[1]) * _MIX[0]
    weights = (weights ^ (weights >> 15)) | 1  # odd: a change of any one element always changes its row's sum
    out = torch.empty(bits.shape[0], dtype=torch.int32, device=t.device)
    step = max(1, chunk_elements // max(cols, 1))
    for r in range(0, bits.shape[0], step):
        out[r : r + step] = (bits[r : r + step].to(torch.int32) * weights).sum(1, dtype=torch.int32)
    return out


class BadLine(ValueError):
    """A data line precompute cannot use; the message starts with file:line and says the fix."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class PrecomputeRows:
    """What `liger-kd precompute --data` reads: token sequences, their labels (None when every line was text or
    token ids, which score every token; else one list per sequence, -100 on prompts) and the skipped lines'
    {reason: count}."""

    sequences: list[list[int]]
    labels: list[list[int]] | None
    skipped: dict[str, int]


ACCEPTED_ROWS = (
    "'text' (a string), 'input_ids' (token ids), 'prompt' + 'completion' (TRL's prompt-completion rows, text or "
    "lists of messages) or 'messages' (a conversation ending with the assistant's turn)"
)


def read_jsonl_rows(
    path: str | Path, *, tokenizer=None, max_length: int | None = None, vocab_size: int | None = None,
    skip_bad_lines: bool = False, max_prompt_length: int | None = None,
) -> PrecomputeRows:  # fmt: skip
    """Token id sequences (and labels) from a JSONL file whose lines are ACCEPTED_ROWS (blank lines ignored).

    A text line is tokenized with the tokenizer's special tokens and cut at max_length; a prompt line is tokenized
    exactly as KDTrainer tokenizes it for training (batch/prompts.py's PromptCollator, with max_prompt_length and
    max_length as kd_max_prompt_length and kd_max_length): its labels are -100 on the prompt, so a store of them
    scores the completions only. A line that is not JSON, has none of those keys, holds no tokens (or no
    completion token), or holds an id outside [0, vocab_size) raises BadLine naming file:line and the fix; with
    skip_bad_lines it is skipped instead and counted in `skipped`.
    """
    for name, value in (("max_length", max_length), ("max_prompt_length", max_prompt_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, or None for no limit; "
                             f"got {value!r}")  # fmt: skip
    sequences, labels, skipped, prompt_rows = [], [], {}, False
    for line_no, line in enumerate(read_utf8(path, "--data").split("\n"), 1):
        if not line.strip():
            continue
        try:
            ids, label = _parse_line(line, tokenizer, max_length, max_prompt_length, vocab_size, f"{path}:{line_no}")
        except BadLine as e:
            if not skip_bad_lines:
                raise
            skipped[e.reason] = skipped.get(e.reason, 0) + 1
            continue
        sequences.append(ids)
        labels.append(ids if label is None else label)
        prompt_rows = prompt_rows or label is not None
    if max_prompt_length is not None and sequences and not prompt_rows:
        raise ValueError(f"--max-prompt-length {max_prompt_length} cuts the prompts of prompt rows, and {path} holds "
                         f"none (text or token ids only): drop --max-prompt-length (--max-length cuts them)")
    return PrecomputeRows(sequences, labels if prompt_rows else None, skipped)


def read_jsonl_sequences(
    path: str | Path, *, tokenizer=None, max_length: int | None = None, vocab_size: int | None = None,
    skip_bad_lines: bool = False,
) -> tuple[list[list[int]], dict[str, int]]:  # fmt: skip
    """(sequences, skipped) of a JSONL file of {"input_ids": [...]} or {"text": "..."} lines: read_jsonl_rows of a
    file without prompt rows (their labels would be lost: a ValueError says to call read_jsonl_rows)."""
    rows = read_jsonl_rows(path, tokenizer=tokenizer, max_length=max_length, vocab_size=vocab_size,
                           skip_bad_lines=skip_bad_lines)  # fmt: skip
    if rows.labels is not None:
        raise ValueError(f"{path} holds prompt rows, whose completion-only labels read_jsonl_sequences cannot return: "
                         f"call read_jsonl_rows")  # fmt: skip
    return rows.sequences, rows.skipped


def _parse_line(line: str, tokenizer, max_length: int | None, max_prompt_length: int | None,
                vocab_size: int | None, where: str) -> tuple[list[int], list[int] | None]:  # fmt: skip
    """(token ids, labels or None: every token scored) of one line."""
    skip = "; or pass --skip-bad-lines to skip such lines"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise BadLine(f"{where}: not valid JSON ({e}){skip}", "invalid JSON") from None
    if not isinstance(record, dict) or not any(key in record for key in ("input_ids", "text", "prompt", "messages")):
        keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise BadLine(f"{where}: each line needs one of {ACCEPTED_ROWS}; got {keys}{skip}", "no accepted columns")
    label = None
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadLine(f"{where}: 'input_ids' must be a list of integers{skip}", "input_ids not integers")
    elif tokenizer is None:
        kind = "'text'" if "text" in record else "prompt"
        raise ValueError(f"{where}: a {kind} line needs a tokenizer: pass --tokenizer (or a --teacher that has one)")
    elif "text" in record and not isinstance(record["text"], str):  # the tokenizer would refuse it, not naming the line
        raise BadLine(
            f"{where}: 'text' must be a JSON string; got {json.dumps(record['text'])[:40]}: quote it, or give "
            f"'input_ids'{skip}",
            "text not a string",
        )
    elif "text" in record:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
    else:
        ids, label = _prompt_row_tokens(record, tokenizer, max_length, max_prompt_length, where, skip)
    ids = ids[:max_length] if max_length is not None else ids
    if not ids:
        raise BadLine(f"{where}: the line holds no tokens; remove it{skip}", "no tokens")
    bad = [t for t in ids if not 0 <= t < (vocab_size if vocab_size is not None else math.inf)]
    if bad:
        raise BadLine(
            f"{where}: token id {bad[0]} is outside the teacher's vocabulary [0, {vocab_size}): the line was "
            f"tokenized for another model; re-tokenize it with the teacher's tokenizer{skip}",
            "token id outside the vocabulary",
        )
    return list(ids), label


def _prompt_row_tokens(record: dict, tokenizer, max_length, max_prompt_length, where: str, skip: str):
    """(input_ids, labels) of a TRL prompt row, as KDTrainer's PromptCollator tokenizes it for training."""
    from ..batch.prompts import conversation_column, prompt_token_rows, tokenize_prompt_row

    column = conversation_column(record)
    if column is not None and getattr(tokenizer, "chat_template", None) is None:
        # the tokenizer's, not the line's: skipping such lines would skip every conversation in the file
        raise ValueError(f"{where}: a conversational '{column}' row needs a tokenizer with a chat template, and this "
                         f"one has none (tokenizer.chat_template is None): pass --tokenizer with one (the student's "
                         f"chat tokenizer), or give text prompts")  # fmt: skip
    try:
        prompt, completion = tokenize_prompt_row(tokenizer, record)
    except ValueError as e:
        raise BadLine(f"{where}: {e}{skip}", "prompt row not readable") from None
    if completion is None or TEACHER_PROMPT in record:
        why = ("has a 'teacher_prompt' (its teacher scores other tokens: make its rows with "
               "batch.prompts.privileged_token_rows)" if completion is not None else
               "has a prompt and no completion: nothing for the teacher to score offline; add a 'completion', or let "
               "the student write them (--rollouts-from STUDENT)")  # fmt: skip
        raise BadLine(f"{where}: the row {why}{skip}", "prompt without completion" if completion is None
                      else "a teacher prompt")  # fmt: skip
    kept = len(prompt[-max_prompt_length:]) if max_prompt_length is not None else len(prompt)
    if max_length is not None and kept >= max_length:
        raise BadLine(f"{where}: its prompt has {kept} tokens (--max-prompt-length {max_prompt_length}) and "
                      f"--max-length {max_length} cuts prompt + completion there, leaving no completion token: set "
                      f"--max-prompt-length below --max-length (it keeps a prompt's last tokens){skip}",
                      "no completion token left")  # fmt: skip
    row = prompt_token_rows(tokenizer, [record], max_prompt_length=max_prompt_length, max_length=max_length)[0]
    return row["input_ids"], row["labels"]


def file_fingerprint(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
