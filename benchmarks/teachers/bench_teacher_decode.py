"""What a served teacher's reply costs the student's process to decode: vLLM-style JSON against the binary reply.

    python -m benchmarks.teachers.bench_teacher_decode --out benchmarks/results/bench_teacher_decode.json

One sequence of 4096 positions, top-64 (the reply `liger-kd serve` writes, built with its own encoders: JSON with
the prompt token added where it is outside the top 64, as vLLM does; binary arrays). Decoding is what the client
does with the bytes: json.loads + protocols.parse_vllm_reply, or protocols.decode_binary (checks included). CPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from liger_patch_kd.server.app import vllm_prompt_logprobs
from liger_patch_kd.wire import protocols as P

from ..common import environment, print_table, write_json


def build_reply(positions: int, k: int, vocab: int, seed: int = 0) -> tuple[list[int], bytes, bytes]:
    g = torch.Generator().manual_seed(seed)
    sequence = torch.randint(0, vocab, (positions,), generator=g).tolist()
    values = torch.log_softmax(torch.randn(positions, k + 1, generator=g) * 3, -1).sort(-1, descending=True).values
    start = torch.randint(0, vocab, (positions, 1), generator=g)  # k distinct ids per row
    ids = ((start + torch.arange(k) * (vocab // k - 1)) % vocab).to(torch.int32)
    # the prompt token's own log-prob and rank: below the top k (so JSON carries k + 1 entries where it is outside)
    own, ranks = values[:, k] - 1.0, torch.full((positions,), k + 10)
    values = values[:, :k].contiguous()
    ids[-1], values[-1] = -1, -float("inf")
    choice = {"index": 0, "text": "", "prompt_logprobs": vllm_prompt_logprobs(sequence, (ids, values), own, ranks)}
    as_json = json.dumps({"choices": [choice]}).encode()
    return sequence, as_json, P.encode_binary([(ids, values)])


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_teacher_decode.json")
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the client decodes in one thread of the training process
    sequence, as_json, as_binary = build_reply(args.positions, args.top_k, args.vocab)
    common = dict(top_k=args.top_k, vocab_size=args.vocab, request="bench")

    def decode_json():
        return P.parse_vllm_reply(json.loads(as_json), [sequence], **common)

    def decode_binary():
        return P.decode_binary(as_binary, [sequence], **common)

    (a_ids, a_lp), (b_ids, b_lp) = decode_json()[0], decode_binary()[0]
    assert torch.equal(a_ids, b_ids) and torch.equal(a_lp, b_lp), "the two replies must decode to the same arrays"
    rows = []
    for name, blob, fn in (("vLLM JSON", as_json, decode_json), ("binary", as_binary, decode_binary)):
        ms = median_ms(fn, args.reps)
        rows.append(dict(reply=name, positions=args.positions, top_k=args.top_k, MB=len(blob) / 1e6, decode_ms=ms,
                         positions_per_s=args.positions / ms * 1e3))  # fmt: skip
    rows[0]["x_binary"] = rows[0]["decode_ms"] / rows[1]["decode_ms"]
    table = print_table(rows, ["reply", "positions", "top_k", "MB", "decode_ms", "positions_per_s", "x_binary"])
    write_json(args.out, dict(environment=environment(), rows=rows, table=table))


if __name__ == "__main__":
    main()
