"""The decode engine's step under torch.compile, and the time of a step alone: what bench_rollouts compares the
engine's own captures with. The engine (liger_patch_kd.generation) decodes with "graph" on CUDA and "eager" on a
CPU; the two captures here exist to measure that choice, not to train with.

    "compile"          the step compiled by torch.compile (inductor's kernels), captured as one CUDA graph as the
                       engine captures its own step
    "reduce-overhead"  the step compiled with torch.compile's own CUDA graphs

A step torch.compile traces keeps SDPA and torch's draw (the Triton decode attention and Gumbel-max draw are the
engine's, which the compiler does not trace).
"""

from __future__ import annotations

import torch

from liger_patch_kd.generation.checks import check_decode_arguments
from liger_patch_kd.generation.decode_attention import decode_kernel, packed_decode_attention
from liger_patch_kd.generation.engine import LENGTH_MULTIPLE, DecodeSession, SessionKey, decode_applies
from liger_patch_kd.generation.sampling import Sampling
from liger_patch_kd.utils.module_state import module_state

COMPILED_CAPTURES = ("compile", "reduce-overhead")


class CompiledDecodeSession(DecodeSession):
    """A DecodeSession whose one-token step is compiled by torch.compile (`key.capture` in COMPILED_CAPTURES)."""

    def __init__(self, model: torch.nn.Module, key: SessionKey, device: torch.device) -> None:
        super().__init__(model, key, device)
        self.fused_draw = False  # torch's draw: the compiler traces it
        self.compiled = None

    def step(self) -> None:
        if self.compiled is None:  # at the first step: the cache holds its tensors by then
            eager_step = super().step
            if self.key.capture == "reduce-overhead":  # every buffer the step mutates at a fixed address, or no graph
                buffers = (self.token, self.slot, self.count, self.used, self.base, self.valid, self.done, self.out)
                copies = self.projection_copies.tensors() if self.projection_copies is not None else []
                for t in (*buffers, *self.cache.keys, *self.cache.values, *copies):
                    torch._dynamo.mark_static_address(t)
                self.compiled = torch.compile(eager_step, mode="reduce-overhead")
            else:  # inductor's kernels, captured by the engine's capture (graph breaks cost nothing there)
                self.compiled = torch.compile(eager_step, dynamic=False)
        self.compiled()

    def run_step(self) -> None:
        if self.key.capture == "compile":
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self.step()


_latest: dict[int, CompiledDecodeSession] = {}  # id(model) -> its latest session, as the engine keeps one per model


def compiled_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    capture: str,
    max_new_tokens: int,
    pad_id: int,
    eos_ids: tuple[int, ...] = (),
    check_every: int = 16,
    fuse_projections: bool = False,
) -> torch.Tensor:
    """generation.decode with a compiled step (plain sampling at temperature 1, CUDA only): (rows, n) sampled ids."""
    if capture not in COMPILED_CAPTURES or input_ids.device.type != "cuda":
        raise ValueError(f"capture must be one of {COMPILED_CAPTURES}, on CUDA; got {capture!r} on {input_ids.device}")
    reason = decode_applies(model)
    if reason is not None:
        raise ValueError(f"the decode engine cannot run this model: {reason}")
    check_decode_arguments(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_id=pad_id,
                           eos_ids=tuple(eos_ids), check_every=check_every)  # fmt: skip
    rows, width = input_ids.shape
    length = -(-(width + max_new_tokens) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    storage = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    key = SessionKey(rows, length, Sampling(), pad_id, tuple(sorted(set(eos_ids))), capture, logprobs=False,
                     top_logprobs=0, fuse=fuse_projections, kernels=True, key_dtype=autocast, storage=storage,
                     inference=torch.is_inference_mode_enabled(), state=module_state(model))  # fmt: skip
    session = _latest.get(id(model))
    if session is None or session.key != key:
        _latest.pop(id(model), None)
        session = _latest[id(model)] = CompiledDecodeSession(model, key, input_ids.device)
    with torch.no_grad(), packed_decode_attention():
        tokens, _ = session.run(input_ids, attention_mask, max_new_tokens, check_every)
    return tokens


def compiled_session_of(model: torch.nn.Module) -> CompiledDecodeSession | None:
    """The session compiled_decode kept for `model` (its latest bucket), or None."""
    return _latest.get(id(model))


def time_steps(session: DecodeSession, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int) -> float:
    """Milliseconds per decode step alone (CUDA events around `steps` steps after a prefill; no host sync, no
    prefill, no EOS checks inside), in the session's own capture: what bench_rollouts reports beside the per-call
    figure."""
    if steps >= session.key.length - input_ids.shape[1]:
        raise ValueError(f"steps must be < the cache's free columns {session.key.length - input_ids.shape[1]}")
    engine_step = not isinstance(session, CompiledDecodeSession)  # the engine's steps attend through its kernel
    with torch.no_grad(), packed_decode_attention(), decode_kernel(engine_step), session.projections():
        session.prefill(input_ids, attention_mask)
        session.run_step()  # captured (or compiled) by now
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        for _ in range(steps):
            session.run_step()
        ended.record()
        ended.synchronize()
    return began.elapsed_time(ended) / steps
