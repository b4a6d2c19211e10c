"""A teacher served by `liger-kd serve`'s app in this process: the app `serve` builds (build_app) on a copy of the
teacher, run by uvicorn in a thread on a free loopback port, for a benchmark row that trains against a served
teacher on the same machine without starting another process."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def served_teacher(teacher: torch.nn.Module, *, top_k: int, dtype: torch.dtype | None = None,
                   ready_timeout: float = 300.0) -> Iterator[str]:  # fmt: skip
    """Serve a copy of `teacher` (in `dtype` if given: `liger-kd serve` runs the dtype it loads) as `liger-kd
    serve` does (eval mode, no gradients, its kernels patched on CUDA; every protocol, the hidden states included);
    yields its URL, and stops the server and its thread on the way out."""
    import uvicorn

    from liger_patch_kd.models import patch_teacher_kernels
    from liger_patch_kd.server.app import build_app
    from liger_patch_kd.server.validation import listening_socket
    from liger_patch_kd.teacher import TeacherClient

    model = copy.deepcopy(teacher)
    if dtype is not None:
        model.to(dtype)
    model.eval().requires_grad_(False)
    device = next(model.parameters()).device
    if device.type == "cuda":
        patch_teacher_kernels(model, None)
    listener = listening_socket("127.0.0.1", 0)  # port 0: the system picks a free one
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    vocab = model.get_output_embeddings().weight.shape[0]
    server = uvicorn.Server(uvicorn.Config(build_app(model, top_k=top_k, model_name="teacher"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="served-teacher", daemon=True)
    thread.start()
    try:
        TeacherClient(url, top_k=top_k, vocab_size=vocab, timeout=ready_timeout).wait_until_ready()
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        listener.close()
