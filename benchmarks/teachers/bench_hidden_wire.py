"""The exact served teacher's FP8 transport: how far the teacher distribution moves when its final hidden
states cross the wire as e4m3 with one scale per row instead of bf16, on the demo's trained teacher.

    python -m benchmarks.teachers.bench_hidden_wire --out runs/bench_hidden_wire.json        # CPU, ~2-5 minutes

Trains the demo's teacher (`liger-kd demo`'s step 2: Llama 4 x 128 on the character corpus, CE, float32), takes its
final hidden states (after the final norm: what its lm_head multiplies, and what `liger-kd serve` sends) on the
demo's 64 held-out windows, sends them through the real wire code (hidden_wire.encode_hidden / decode_hidden) as
float32, bf16 and fp8, and reports per token KL(P_bf16 || P_fp8) (the issue's figure: the FP8 transport against the
default bf16 one), KL(P_fp32 || P_x) for each and top-1 agreement with the float32 teacher, where P_x = softmax(h_x
W) with the teacher's own float32 head. Bytes per token: the reply's, per token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from liger_patch_kd.demo.same_tokenizer import demo_data, train_teacher
from liger_patch_kd.demo.toys import DemoSizes
from liger_patch_kd.wire.hidden_wire import FP8_DTYPE, decode_hidden, encode_hidden

from ..common import environment, print_table, write_json


def kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row, float64."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_hidden_wire.json")
    parser.add_argument("--quick", action="store_true", help="the demo's quick sizes (a smoke test)")
    args = parser.parse_args()
    sizes = DemoSizes.quick() if args.quick else DemoSizes()
    device = torch.device("cpu")
    tokenizer, _, held_out, dataset, collator = demo_data(sizes)
    with tempfile.TemporaryDirectory() as work:
        teacher = train_teacher(dataset, collator, len(tokenizer), sizes, Path(work) / "teacher", device)
    with torch.no_grad():
        ids = torch.tensor(held_out)
        hidden = teacher(input_ids=ids, output_hidden_states=True).hidden_states[-1].float()  # after the final norm
        weight = teacher.get_output_embeddings().weight.detach().float()
    sequences, states = ids.tolist(), list(hidden)
    tokens = sum(map(len, sequences))
    exact = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    logits, rows = {}, []
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp8 e4m3, scale per row", FP8_DTYPE)):
        blob = encode_hidden(states, sequences, dtype, version=0)
        back, _ = decode_hidden(blob, sequences, request=name)
        logits[name] = torch.cat(back).float() @ weight.T
        kl = kl_rows(exact, logits[name])
        rows.append(dict(wire=name, bytes_per_token=(len(blob) - 24 - 4 * len(sequences)) / tokens,
                         kl_vs_fp32_mean=float(kl.mean()), kl_vs_fp32_p99=float(kl.quantile(0.99)),
                         top1_vs_fp32=float((logits[name].argmax(-1) == exact.argmax(-1)).float().mean())))  # fmt: skip
    fp8 = kl_rows(logits["bf16"], logits["fp8 e4m3, scale per row"])
    rows[-1].update(kl_vs_bf16_mean=float(fp8.mean()), kl_vs_bf16_p99=float(fp8.quantile(0.99)),
                    kl_vs_bf16_max=float(fp8.max()))  # fmt: skip
    shape = f"H = {hidden.shape[-1]}, V = {weight.shape[0]}"
    print(f"\nthe demo's teacher (Llama 4 x 128, {shape}), {tokens} held-out tokens")
    columns = ["wire", "bytes_per_token", "kl_vs_fp32_mean", "kl_vs_fp32_p99", "top1_vs_fp32", "kl_vs_bf16_mean",
               "kl_vs_bf16_p99", "kl_vs_bf16_max"]  # fmt: skip
    table = print_table(rows, columns)
    write_json(args.out, dict(environment=environment(), sizes=vars(sizes), rows=rows, table=table))


if __name__ == "__main__":
    main()
