"""Which SDPA backend the models' attention runs on: a measured choice, not PyTorch's default order.

On an H200 (torch 2.11, `benchmarks/bench_attention.py`, causal, bf16) cuDNN's attention is 1.7-1.9x flash's for
the 8B-shaped teacher's forward (14.9 ms against 25.6 ms a layer at 32k tokens) and 1.4-1.6x for the 1B student's
forward + backward, while PyTorch tries flash first. At long context attention is most of the step, so the order
matters there; at 4k it is a few percent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

ATTENTION_BACKENDS = ("default", "cudnn", "flash")


@contextlib.contextmanager
def attention_backend(choice: str) -> Iterator[None]:
    """Within the block, `F.scaled_dot_product_attention` tries `choice` first, then PyTorch's other backends in
    their usual order (a backend that cannot take a call, e.g. cuDNN on a CPU or with a mask it does not support,
    is skipped, so nothing fails for the choice). "default" leaves PyTorch's order alone. Models run with
    attn_implementation="sdpa" are the ones affected."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}; got {choice!r}")
    if choice == "default":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[choice]
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel([first, *(b for b in rest if b != first)], set_priority=True):
        yield
