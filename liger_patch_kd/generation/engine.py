"""The decode loop as an engine runs it: one static KV cache per (rows, length) bucket, the whole one-token step
(forward with packed grouped-query attention, sampling, finished-row bookkeeping) captured once as a CUDA graph and
replayed, the host asking whether every row has ended only every `check_every` steps.

    tokens = decode(model, input_ids, attention_mask, max_new_tokens=..., sampling=Sampling(...), pad_id=0,
                    eos_ids=(2,), capture="graph")

Captures: "graph" (torch.cuda.CUDAGraph, explicit capture of the step's own kernels) and "eager" (the same step run
op by op: what a CPU runs, and the reference of the graph). The prefill runs through the model's own attention over
the prompt. On CUDA, prompts are left-padded to a multiple of PREFILL_WIDTH_MULTIPLE columns (both captures, so the
two compute the same), and under "graph" a small prefill (rows x width up to PREFILL_CAPTURE_TOKENS, where launching
its few hundred small kernels from Python costs more than running them) is captured too, at the second call of its
width (the first runs it eagerly: lazy kernels, autotuning, the cache's allocation), one graph per width, for the
first PREFILL_GRAPHS widths that come back (later ones run eagerly: a capture syncs and empties the allocator's
cache, so widths in rotation must never be captured again and again), sharing one memory pool that the session's
size (nbytes) counts. A model whose prefill cannot be captured runs it eagerly from then on, in every session.

The session runs a twin of the model (kernel_twin.py: the same parameters, its own module tree) whose RMSNorm, RoPE
and gated MLP are the project's kernels, whether or not the model is patched: a patched and an unpatched student
decode at the same speed, and the model itself (its training forward) is left as it is.

Sessions (cache, buffers, graph) are kept per model for its latest KEEP_SESSIONS buckets and reused by the next call
of a bucket, across optimizer steps: the graph reads the parameters where they are, so an update made in place (what
optimizers do) is what the next call samples from. Two, so that a training run's rollouts and an evaluation's greedy
decode between its steps alternate without either being built and captured again. Parameters moved to new storage (a
new model, a reload) change the key: the sessions of the old storage are dropped and a new one is built; so does any
other change to what the model computes by (utils/module_state.py: a module replaced, a forward, hook, epsilon or
scaling changed, PEFT's adapter switches), which the session's twin and graph would not see; a call of a bucket beyond
KEEP_SESSIONS releases the least recently used one first, and a new bucket releases the kept ones first where they
hold more than a tenth of the memory beside them (a large model's: the one-at-a-time peak as before);
`release_sessions` frees them all; `release_if_large` frees them when they would weigh on a training step's peak (the
Trainer's in-process rollouts call it after each generation).

A call given a `cancel` event (cancellation.py) reads it before the prefill and before each replay of the step, on
the host, with no sync added: a set event ends the call with Cancelled. On CUDA the host runs ahead of the device by
at most `check_every` queued steps when there are EOS ids (their check is a sync), so at most that many run after
the event is seen; the next call's prefill resets everything the cut-short call left in the session.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from ..models.state import transformers_forward
from ..ops.backend import autocast_dtype, select_backend
from ..utils.cuda_graphs import graph_capture
from ..utils.module_state import module_state
from .bookkeeping_kernel import NextColumn, advance_in_one_kernel
from .cancellation import stop_if_cancelled
from .checks import check_decode_arguments
from .decode_attention import decode_kernel, packed_decode_attention
from .forward_options import decode_forward_options
from .fused_projections import FusedProjections
from .kernel_twin import kernel_twin
from .kv_cache import SlotCache
from .model_config import text_config
from .padding import self_visible_causal
from .rotary_table import install_rotary_tables
from .sampling import Sampling, allowed_logits, draw, filtered_scores
from .sampling_kernel import gumbel_argmax

logger = logging.get_logger(__name__)

CAPTURES = ("graph", "eager")  # both attend through the Triton split-KV kernel (decode_kernel.py)
LENGTH_MULTIPLE = 128  # cache lengths are rounded up to this: a run sees few buckets (few captures, few caches)
PREFILL_WIDTH_MULTIPLE = 16  # CUDA prompts are left-padded to this: a run's prompts share few prefill graphs
PREFILL_CAPTURE_TOKENS = 8192  # prefills of at most rows x width tokens are captured ("graph"); larger ones are
# bound by their products, not their launches, and a graph would hold their activations' memory between calls
PREFILL_GRAPHS = 4  # prefill widths a session captures, the first four that come back; others run eagerly
CHECK_EVERY = 16  # decode steps between the host's "has every row ended?" checks (a sync each): measured in bench
# The step's bookkeeping after the draw in one Triton kernel instead of a dozen torch ops (on the Triton backend).
# Checked against the torch ops step for step, through the interpreter on a CPU and compiled and captured on a GPU
# (tests/test_bookkeeping_kernel.py); a switch so a profile can compare both (bench_rollouts).
BOOKKEEPING_KERNEL = True


@dataclass(frozen=True)
class SessionKey:
    rows: int
    length: int
    sampling: Sampling
    pad_id: int
    eos_ids: tuple[int, ...]
    capture: str
    logprobs: bool
    top_logprobs: int  # also the K most likely ids and their log-probs at each step (0: none)
    fuse: bool  # q/k/v and gate/up as one product each (fused_projections.py)
    kernels: bool  # the step runs the project's RMSNorm / RoPE / gated-MLP kernels (kernel_twin.py)
    key_dtype: torch.dtype | None  # the autocast dtype in force (None: none), which sets the cache's dtype
    storage: tuple[int, ...]  # where the parameters live: the graph reads them there
    inference: bool = False  # made under torch.inference_mode: its buffers are inference tensors, which a call
    # outside that mode cannot update in place (each mode its own session)
    # what the model computes by beyond its tensors (utils/module_state.py: its modules, their attributes and hooks,
    # PEFT's switches, the config): the twin and the graph are snapshots of it, so a change is another session
    state: tuple = ()


def left_padded(
    prompts: list[list[int]], pad_id: int, width: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (rows, width) int64: each prompt at the right end of its row (decoding appends
    every row's next token at the same column), `pad_id` and mask 0 before it; width: the longest prompt's."""
    lengths = [len(p) for p in prompts]
    width = max(lengths, default=0) if width is None else width
    if any(n > width for n in lengths):
        raise ValueError(f"left_padded: a prompt of {max(lengths)} tokens does not fit width {width}")
    # one tensor built from the padded rows: no tensor op per row
    ids = torch.tensor([[pad_id] * (width - n) + list(p) for p, n in zip(prompts, lengths)], dtype=torch.long)
    ids = ids.reshape(len(prompts), width)
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths, dtype=torch.long)[:, None]).long()
    return ids.to(device), mask.to(device)


def widened(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, multiple: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts padded further on the left to a multiple of `multiple` columns: `pad_id`, mask 0. The
    positions (from the mask) and what each prompt token attends to are unchanged."""
    extra = -input_ids.shape[1] % multiple
    if extra == 0:
        return input_ids, attention_mask
    pad = input_ids.new_full((input_ids.shape[0], extra), pad_id)
    unattended = torch.zeros_like(pad, dtype=attention_mask.dtype)
    return torch.cat([pad, input_ids], 1), torch.cat([unattended, attention_mask], 1)


def cache_keyword(model: nn.Module) -> str:
    """The name the forward that `model(...)` runs takes its KV cache by (transformers 5.2x renamed
    past_key_values to cache)."""
    forward = transformers_forward(model) or model.forward  # a patched model's KD forward hands it on to this one
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def decode_applies(model: nn.Module) -> str | None:
    """None if the engine can decode with `model`, else why not: a decoder-only transformers LM with SDPA attention
    (the 4D boolean masks the engine builds are SDPA's), position ids and logits_to_keep, and full attention (a
    sliding window would need its own mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    # a student patched at class level (apply_kd_patch_to_<arch>()) runs the KD forward, which hands a call without
    # labels to transformers' own forward, keywords and all: that forward's parameters are what a step can pass
    params = inspect.signature(transformers_forward(model) or type(model).forward).parameters
    if not {"logits_to_keep", "position_ids"} <= set(params):
        return "its forward takes no logits_to_keep / position_ids"
    text = text_config(model)
    if getattr(text, "_attn_implementation", None) != "sdpa":
        return f"its attention is {getattr(text, '_attn_implementation', None)!r}, the engine builds SDPA's masks"
    if any("sliding" in str(t) for t in (getattr(text, "layer_types", None) or ())):
        return "it has sliding-window layers"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "it has a sliding window"
    return None


class DecodeSession:
    """The buffers, cache and captured step of one bucket: `rows` rows, `length` cache columns."""

    def __init__(self, model: nn.Module, key: SessionKey, device: torch.device) -> None:
        # the twin (the model's own parameters, the kernels bound on its modules) or, without kernels, the model's
        # own forward: the KD forward of a patched model gives way to transformers' either way
        # (the model itself by a weak reference: _SESSIONS is keyed weakly by it, and a session holding it strongly
        # kept the model, and so its sessions, alive for good)
        self._model = kernel_twin(model) if key.kernels else weakref.ref(model)
        self.key, self.device = key, device
        self._source = weakref.ref(model)  # the model itself: what is remembered of it outlives its sessions
        rows, length = key.rows, key.length
        # cos / sin looked up from a table of the cache's positions (rotary_table.py), refreshed at each call
        self.rotary_tables = install_rotary_tables(self._model, length) if key.kernels else []
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(rows, 1, **long)  # the step's input ids
        self.slot = torch.zeros(1, **long)  # the cache column the step writes
        self.count = torch.zeros(1, **long)  # tokens sampled so far (the column of `out` written next)
        self.used = torch.zeros(1, **long)  # columns up to the token that ended the last row still going
        self.base = torch.zeros(rows, 1, **long)  # position id = base + slot (each row's prompt length - W)
        self.valid = torch.ones(rows, length, dtype=torch.bool, device=device)  # columns a row may attend to
        self.columns = torch.arange(length, **long)
        # the step's inputs, made when the slot moves (in the bookkeeping kernel where it runs), not by the step:
        # the mask of the columns it may attend to (valid & columns <= slot) and its position ids (base + slot)
        self.step_mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.positions = torch.zeros(rows, 1, **long)
        self.next_column = NextColumn(self.slot, self.valid, self.step_mask, self.positions)  # the kernel's, per step
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.out = torch.zeros(rows, length, **long)
        self.out_logprobs = torch.zeros(rows, length, dtype=torch.float32, device=device) if key.logprobs else None
        top = (rows, length, key.top_logprobs)
        self.out_top = (torch.zeros(top, **long), torch.zeros(top, dtype=torch.float32, device=device)) \
            if key.top_logprobs else None  # fmt: skip
        self.eos = torch.tensor(key.eos_ids, **long)
        self.cache = SlotCache(model.config.get_text_config().num_hidden_layers, rows, length, self.slot)
        self.cache_keyword = cache_keyword(self.model)
        self.seed = torch.zeros(1, **long)  # the fused draw's Philox key, drawn from torch's generator per call
        self.fused_draw = fused_draw_applies(key, device)
        # the step's counters and flags in one kernel (bookkeeping_kernel.py), where BOOKKEEPING_KERNEL allows
        self.fused_bookkeeping = BOOKKEEPING_KERNEL and select_backend(device) == "triton"
        self.graph: torch.cuda.CUDAGraph | None = None
        # captured prefills by width: (graph, its input ids, its attention mask); widths run once eagerly so far
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.prefill_widths_seen: set[int] = set()
        # False for a model whose prefill capture failed in any of its sessions (it would fail again, each time
        # reserving memory); prefill_graph also stops capturing once PREFILL_GRAPHS graphs are held
        self.prefill_captures = key.capture == "graph" and model not in _PREFILL_UNCAPTURABLE
        # one memory pool for every prefill graph of the session: they run one at a time and hand nothing out of
        # their pool (their results land in the session's own buffers), so one prefill's activations are held
        self.prefill_pool = None
        self.prefill_pool_bytes = 0  # the memory the capture reserved for it, counted in nbytes
        # fused q/k/v and gate/up, under autocast weights held in its dtype (cast once a call, not every step), and
        # with the kernels every product of a step through the few-row kernel
        copies = FusedProjections(self.model, fuse=key.fuse, autocast=key.key_dtype, few_rows=key.kernels)
        self.projection_copies = copies if copies else None

    @property
    def model(self) -> nn.Module:
        """What the step runs: the twin, or (kernels=False) the model itself."""
        return self._model() if isinstance(self._model, weakref.ref) else self._model

    def nbytes(self) -> int:
        """The memory the session holds between calls: KV cache, projection weight copies, output buffers."""
        buffers = [self.out, self.valid, self.step_mask, *(self.out_top or ())]
        buffers += [self.out_logprobs] if self.out_logprobs is not None else []
        held = self.cache.nbytes() + sum(t.numel() * t.element_size() for t in buffers) + self.prefill_pool_bytes
        return held + (self.projection_copies.nbytes() if self.projection_copies is not None else 0)

    # ----------------------------------------------------------------------------------------- the step
    def _advance(self, logits: torch.Tensor, bump_slot: bool = False) -> None:
        """Sample from (rows, V) logits and book it: padding after a row's end, its end, the next input (and, for
        a decode step, the next cache column: `bump_slot`)."""
        sampling = self.key.sampling
        if self.fused_draw:  # one kernel; its noise keyed by (the call's seed, the step)
            tokens = gumbel_argmax(logits, self.seed, self.count, temperature=sampling.temperature,
                                   vocab_limit=sampling.vocab_limit)  # fmt: skip
        else:
            tokens = draw(filtered_scores(logits, sampling), sampling)
        if self.out_logprobs is not None:  # the model's own log-prob of the token (temperature 1, unfiltered)
            own_logprobs = allowed_logits(logits, sampling).log_softmax(-1)
            self.out_logprobs.index_copy_(1, self.count, own_logprobs.gather(-1, tokens[:, None]))
            if self.out_top is not None:  # and the K most likely ids under it, with theirs
                top = own_logprobs.topk(self.key.top_logprobs, dim=-1)
                self.out_top[0].index_copy_(1, self.count, top.indices[:, None])
                self.out_top[1].index_copy_(1, self.count, top.values[:, None])
        if self.fused_bookkeeping:  # what follows, in one kernel (bookkeeping_kernel.py)
            advance_in_one_kernel(tokens.contiguous(), self.done, self.eos, self.out, self.token, self.count, self.used,
                                  self.key.pad_id, self.next_column if bump_slot else None)  # fmt: skip
            return
        if len(self.key.eos_ids):
            tokens = torch.where(self.done, self.key.pad_id, tokens)
            self.used.copy_(torch.where(self.done.all(), self.used, self.count + 1))  # some row was still going
            self.done |= torch.isin(tokens, self.eos)
        else:
            self.used.copy_(self.count + 1)
        self.out.index_copy_(1, self.count, tokens[:, None])
        self.token.copy_(tokens[:, None])
        self.count.add_(1)
        if bump_slot:
            self.slot.add_(1)
            self._inputs_through_slot()

    def _inputs_through_slot(self) -> None:
        """The next step's mask (the prompt's columns and those written, up to the slot) and position ids."""
        torch.logical_and(self.valid, self.columns <= self.slot, out=self.step_mask)
        torch.add(self.base, self.slot, out=self.positions)

    def step(self) -> None:
        """One decode step, all on the device, no host sync: what the CUDA graph holds."""
        out = self.model(input_ids=self.token, attention_mask=self.step_mask[:, None, None, :],
                         position_ids=self.positions,
                         use_cache=True, logits_to_keep=1, **{self.cache_keyword: self.cache},
                         **decode_forward_options(self.model))  # fmt: skip
        self._advance(out.logits[:, -1], bump_slot=True)

    # -------------------------------------------------------------------------------------------- a call
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The prompts through the model's own attention into the cache, and the first token sampled: replayed from
        the width's captured graph where there is one (module docstring), else run op by op."""
        width = input_ids.shape[1]
        captured = self.prefill_graph(width)
        if captured is None:
            self.prefill_ops(input_ids, attention_mask)
            return
        graph, ids, mask = captured
        ids.copy_(input_ids)
        mask.copy_(attention_mask)
        graph.replay()
        self.cache.prefilled = width  # what the Python side of the forward set when the graph was captured

    def prefill_graph(self, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None:
        """The width's captured prefill: kept, or captured now at the width's second call; None where the prefill
        runs op by op (the first call of a width, an eager session, a large prefill, a capture that failed)."""
        kept = self.prefill_graphs.get(width)
        if kept is not None:
            return kept
        if not self.prefill_captures or self.key.rows * width > PREFILL_CAPTURE_TOKENS \
                or len(self.prefill_graphs) >= PREFILL_GRAPHS:  # fmt: skip
            return None
        if width not in self.prefill_widths_seen:
            self.prefill_widths_seen.add(width)
            return None
        ids = torch.zeros(self.key.rows, width, dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        graph = torch.cuda.CUDAGraph()
        rng = torch.cuda.get_rng_state(self.device)
        try:  # a failed capture raises with the stream, allocator and generator put right (utils/cuda_graphs.py)
            self.prefill_pool = self.prefill_pool or torch.cuda.graph_pool_handle()
            # thread_local: another thread's allocation (the server's weight receiver) is not refused meanwhile
            with graph_capture(graph, self.device, self.prefill_pool, capture_error_mode="thread_local"):
                reserved = torch.cuda.memory_reserved(self.device)  # after the capture emptied the cache
                self.prefill_ops(ids, mask)
            self.prefill_pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        except RuntimeError as error:  # something in the forward a graph cannot hold: eager prefills from now on
            self.prefill_captures = False
            source = self._source()
            if source is not None:
                _PREFILL_UNCAPTURABLE.add(source)
            logger.info("the decode engine's prefill could not be captured (%s); it runs op by op", error)
            return None
        finally:
            self.cache.decoding = True
            torch.cuda.set_rng_state(rng, self.device)  # the capture drew nothing of the call's seed
        self.prefill_graphs[width] = (graph, ids, mask)
        return self.prefill_graphs[width]

    def prefill_ops(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The prefill op by op (what a prefill graph holds)."""
        rows, width = input_ids.shape
        attended = attention_mask.bool()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        mask = self_visible_causal(attended)  # a padding position attends to itself only: no NaN, no fully masked row
        self.cache.decoding = False
        if self.fused_draw:  # from the call's seeded generator: the same seed, the same completions
            self.seed.copy_(torch.randint(0, 2**62, (1,), device=self.device))
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_keyword: self.cache},
                         **decode_forward_options(self.model))  # fmt: skip
        self.valid[:, :width].copy_(attended)
        self.valid[:, width:].fill_(True)
        self.base.copy_(attended.long().sum(-1, keepdim=True) - width)
        self.slot.fill_(width)
        self._inputs_through_slot()
        self.count.zero_()
        self.used.zero_()
        self.done.zero_()
        self._advance(out.logits[:, -1])
        self.cache.decoding = True

    def capture(self) -> None:
        """Warm the step up on a side stream (allocator, lazy kernels), put the state back, capture it."""
        step = self.step
        live = (self.token, self.slot, self.count, self.used, self.done, self.step_mask, self.positions)
        state = [t.clone() for t in live]
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                step()  # writes cache columns the real steps overwrite before anything reads them
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:  # a failed capture raises with the stream, allocator and generator put right (utils/cuda_graphs.py)
            with graph_capture(graph, self.device, torch.cuda.graph_pool_handle()):
                step()
            self.graph = graph
        finally:  # captured or not, the session's state and the call's seed are as the prefill left them
            for saved, buffer in zip(state, live):
                buffer.copy_(saved)
            torch.cuda.set_rng_state(rng, self.device)  # warm-up draws consumed nothing of the call's seed

    def run_step(self) -> None:
        """The step as the session runs it: captured at its first call and replayed ("graph"), or op by op."""
        if self.key.capture == "graph":
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self.step()

    @contextlib.contextmanager
    def projections(self) -> Iterator[None]:
        """The projection copies (fused, or cast to the autocast dtype), refreshed (an in-place update since the last
        call included) and installed."""
        if self.projection_copies is None:
            yield
            return
        self.projection_copies.sync()
        with self.projection_copies.installed():
            yield

    def run(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, check_every: int,
        cancel: threading.Event | None = None,
    ):  # fmt: skip
        """(rows, n) sampled ids (n <= max_new_tokens: fewer when every row ended) and their log-probs or None;
        Cancelled once `cancel` is set (read before the prefill and each step)."""
        stop_if_cancelled(cancel)
        for table in self.rotary_tables:
            table.refresh()
        with self.projections():
            self.prefill(input_ids, attention_mask)
            checks = len(self.key.eos_ids) > 0
            for step in range(1, max_new_tokens):
                if checks and step % check_every == 0 and not bool((~self.done).any()):
                    break  # the only host sync of the loop
                stop_if_cancelled(cancel)  # a flag read on the host: no sync
                self.run_step()
        n = int(self.used)  # columns after the last row ended (up to check_every - 1 of them) are padding: cut
        logprobs = None if self.out_logprobs is None else self.out_logprobs[:, :n].clone()
        if self.out_top is not None:
            return self.out[:, :n].clone(), logprobs, tuple(t[:, :n].clone() for t in self.out_top)
        return self.out[:, :n].clone(), logprobs


def fused_draw_applies(key: SessionKey, device: torch.device) -> bool:
    """Whether the step draws through sampling_kernel.gumbel_argmax (one kernel where torch's draw takes several):
    Triton's backend for the device and plain sampling (temperature, vocabulary limit; top-k / top-p and greedy go
    through sampling.draw). Its random numbers are not torch's: a seed
    gives other completions than sampling.draw's, from the same distribution (tests/test_sampling_kernel.py)."""
    sampling = key.sampling
    plain = not sampling.greedy and sampling.top_k == 0 and sampling.top_p >= 1.0
    return plain and select_backend(device) == "triton"


KEEP_SESSIONS = 2  # buckets kept per model: a run's rollouts and an evaluation's decode between its steps
# per model, its sessions by key, the least recently used first
_SESSIONS: weakref.WeakKeyDictionary[nn.Module, OrderedDict[SessionKey, DecodeSession]] = weakref.WeakKeyDictionary()
# models whose prefill could not be captured: their sessions prefill op by op (DecodeSession.prefill_graph)
_PREFILL_UNCAPTURABLE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def release_sessions(model: nn.Module | None = None) -> None:
    """Free the KV caches and graphs kept for `model` (every model's when None)."""
    if model is None:
        _SESSIONS.clear()
    else:
        _SESSIONS.pop(model, None)


KEEP_FRACTION = 0.1  # a model's kept sessions may hold this fraction of the memory the process holds beside them


def release_if_large(model: nn.Module, fraction: float = KEEP_FRACTION) -> bool:
    """After a call between training steps: release `model`'s sessions when their KV caches, fused weights and
    buffers exceed `fraction` of the CUDA memory allocated beside them, so that keeping them adds at most that
    fraction to the training step's peak (which is at least that memory). Kept, the next call of a bucket replays
    its graph as it is; released, it allocates and captures again (a small cost beside the call's generation). A 1B
    student at 64 rows of 1024 columns holds about a sixth of its run's memory: released; at 8 rows less than a
    tenth: kept. Returns whether it released them."""
    if not weigh_on_memory(list(_SESSIONS.get(model, {}).values()), fraction):
        return False
    release_sessions(model)
    return True


def weigh_on_memory(sessions: list[DecodeSession], fraction: float = KEEP_FRACTION) -> bool:
    """Whether `sessions` (CUDA ones; a CPU's are not device memory) hold more than `fraction` of the CUDA memory
    allocated beside them."""
    kept = [s for s in sessions if s.device.type == "cuda"]
    if not kept:
        return False
    held = sum(s.nbytes() for s in kept)
    return held > fraction * (torch.cuda.memory_allocated(kept[0].device) - held)


def session_of(model: nn.Module) -> DecodeSession | None:
    """The session `model` used last, or None."""
    kept = _SESSIONS.get(model)
    return next(reversed(kept.values()), None) if kept else None


def sessions_of(model: nn.Module) -> list[DecodeSession]:
    """The sessions kept for `model`, the least recently used first."""
    return list(_SESSIONS.get(model, {}).values())


def session_for(model: nn.Module, key: SessionKey, device: torch.device) -> DecodeSession:
    """`model`'s session for `key`: the kept one, or a new one built after the sessions of other parameter storage,
    those beyond KEEP_SESSIONS - 1, and any that weigh on memory (weigh_on_memory: a 1B model's KV cache at 64 rows,
    say) are released, their memory back before the new one allocates. Small sessions (an evaluation's, a small
    model's) are what is kept side by side."""
    kept = _SESSIONS.setdefault(model, OrderedDict())
    session = kept.pop(key, None)
    if session is None:
        for stale in [k for k in kept if k.storage != key.storage]:  # parameters moved: never replayed again
            del kept[stale]
        while len(kept) >= KEEP_SESSIONS:
            kept.popitem(last=False)
        if weigh_on_memory(list(kept.values())):
            kept.clear()
        session = DecodeSession(model, key, device)
    kept[key] = session  # the most recently used last
    return session


def decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: Sampling,
    pad_id: int,
    eos_ids: tuple[int, ...] | list[int] = (),
    capture: str = "graph",
    logprobs: bool = False,
    top_logprobs: int = 0,
    check_every: int = CHECK_EVERY,
    fuse_projections: bool = False,
    kernels: bool = True,
    cancel: threading.Event | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Sample up to `max_new_tokens` after left-padded prompts.

    Args:
        model: a decoder-only transformers LM for which decode_applies is None, in eval mode.
        input_ids: (rows, W) prompts, left-padded; attention_mask: (rows, W), 0 on the padding.
        sampling: temperature / top-k / top-p / vocab limit (Sampling).
        pad_id: what a row gets after its end; eos_ids: the ids that end a row (kept as its last token).
        capture: one of CAPTURES (on a CPU every capture runs "eager": no graphs there).
        logprobs: also return each sampled token's log-prob under the model's own distribution (temperature 1,
            unfiltered, over the first vocab_limit ids).
        top_logprobs: with `logprobs`, also the K most likely ids at each step under that distribution and their
            log-probs (what an OpenAI reply's top_logprobs lists); 0: none.
        check_every: decode steps between the host's checks that some row is still going.
        fuse_projections: q/k/v and gate/up each as one product over a copy of their weights concatenated
            (fused_projections.py: fewer, fuller kernels a step; the copy costs those weights' bytes in memory and is
            refreshed at each call, so in-place updates are seen).
        kernels: run the step (and the prefill) through the project's RMSNorm / RoPE / gated-MLP kernels, whether
            or not the model is patched (kernel_twin.py: a twin of the module tree over the same parameters; the
            model itself is left as it is); False: the model's modules as they are.
        cancel: an event another thread may set to stop the call: read before the prefill and before each step
            (no device sync), it ends the call with cancellation.Cancelled, returning nothing; None: runs to the end.

    Returns:
        ((rows, n) int64 sampled ids, (rows, n) float32 log-probs or None); n <= max_new_tokens, fewer when every
        row ended (at the step where the last one did, as generate() stops). With top_logprobs = K > 0 a third
        element: ((rows, n, K) int64 ids, (rows, n, K) float32 log-probs), most likely first.
    """
    if capture not in CAPTURES:
        raise ValueError(f"capture must be one of {CAPTURES}; got {capture!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an int >= 0 (0: none); got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise ValueError(f"top_logprobs={top_logprobs} lists log-probs: pass logprobs=True with it")
    reason = decode_applies(model)
    if reason is not None:
        raise ValueError(f"the decode engine cannot run this model: {reason}; use generate() (cache 'dynamic')")
    check_decode_arguments(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, pad_id=pad_id,
                           eos_ids=tuple(eos_ids), check_every=check_every)  # fmt: skip
    vocab = getattr(text_config(model), "vocab_size", None)
    allowed = min(sampling.vocab_limit or vocab, vocab) if isinstance(vocab, int) else sampling.vocab_limit
    if allowed is not None and top_logprobs > allowed:
        raise ValueError(f"top_logprobs={top_logprobs} is more than the {allowed} ids that may be drawn: ask for "
                         f"at most {allowed}")  # fmt: skip
    device = input_ids.device
    if device.type != "cuda":
        capture = "eager"
    if device.type == "cuda":  # few prefill widths, so few prefill graphs (module docstring)
        input_ids, attention_mask = widened(input_ids, attention_mask, pad_id, PREFILL_WIDTH_MULTIPLE)
    rows, width = input_ids.shape
    length = -(-(width + max_new_tokens) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    autocast = autocast_dtype(device)
    storage = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    eos = tuple(sorted(set(eos_ids)))
    fuse, kernels = bool(fuse_projections), bool(kernels)
    key = SessionKey(rows, length, sampling, pad_id, eos, capture, logprobs, top_logprobs, fuse, kernels, autocast,
                     storage, torch.is_inference_mode_enabled(), module_state(model))  # fmt: skip
    with torch.no_grad(), packed_decode_attention(), decode_kernel():
        session = session_for(model, key, device)
        return session.run(input_ids, attention_mask, max_new_tokens, check_every, cancel)
