"""What the teacher-quality benchmarks share (bench_fp8_teacher, bench_sampled_kd): the model shapes, the corpus windows
and a teacher trained on them for a while."""

from __future__ import annotations

import time

import torch

TEACHER = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
               num_key_value_heads=8)  # fmt: skip


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def llama(shape: dict, vocab: int, device, dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=1024, attn_implementation="sdpa", **shape)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


class Windows:
    """Random training windows of a token stream, and the held-out stream cut into consecutive windows."""

    def __init__(self, ids: torch.Tensor, seq: int, device):
        self.ids, self.seq, self.device = ids, seq, device
        self.gen = torch.Generator().manual_seed(0)

    def batch(self, size: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.ids) - self.seq, (size,), generator=self.gen)
        return torch.stack([self.ids[s : s + self.seq] for s in starts.tolist()]).to(self.device)

    def consecutive(self) -> torch.Tensor:
        n = len(self.ids) // self.seq
        return self.ids[: n * self.seq].reshape(n, self.seq).to(self.device)


def train_teacher(model, data: Windows, seconds: float, batch: int, device) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.0, betas=(0.9, 0.95))
    start, step, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - start < seconds:
        for group in opt.param_groups:
            group["lr"] = 6e-4 * min(1.0, (step + 1) / 50)
        ids = data.batch(batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0:
            loss = float(out.loss)
            print(f"teacher step {step}: loss {loss:.3f}", flush=True)
    return dict(steps=step, seconds=time.perf_counter() - start, final_train_loss=out.loss.item())
