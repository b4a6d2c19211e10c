"""A frozen teacher's decoder forward replayed from CUDA graphs, one per batch shape.

A small teacher's forward is bound by the host, not the GPU: each of its few hundred small kernels costs a Python
call, a dispatch and a launch, and the step waits on that rather than on the products. Captured once per shape and
replayed, the whole decoder is one launch. The KD forward asks for it in `run_backbone` (backbone.py) when the
teacher runs with no gradients and nothing but its tokens (no mask: models.backbone drops a mask that only pads the
end of rows; no position ids, cache or vision inputs); anything else runs eagerly, as before.

Shapes: the rows are captured as they come, the length is rounded up to `length_multiple` so that generated
batches of every length share a few graphs. The padded tail holds valid ids and is never read back: attention is
causal, so no real position sees it. The products then run on more rows than the batch has, which may round
differently from the eager forward (cuBLAS picks its kernel by shape): equal to rounding, not to the bit. Where
the position encoding depends on the sequence's length (RoPE scaled "dynamic" or "longrope": the frequencies change
past the trained length), or attention is not causal, the length is not padded; it is never padded past the
model's trained length.

The graphs read the parameters where they are: an update made in place (`load_state_dict`, an EMA teacher's copy_) is
what the next replay computes with. Parameters or buffers moved to new storage (`.to(dtype)`, a reload) are seen by
their addresses and the graphs are captured again. What the model computes by beyond its tensors (its modules, their
plain attributes and hooks, PEFT's adapter switches, the config: utils/module_state.py) is part of a graph's key, so a
teacher changed between calls replays the graph of what it is now. A replay returns a view of the graph's output
buffer, which the next replay of that shape overwrites: what the caller keeps, it clones. Autocast is part of a
graph's key, and its cast cache is off while capturing (a cached cast would be freed when the caller's autocast region
ends, under the graph's feet).

`capture="eager"` runs the same padded buffers op by op instead of replaying: what a CPU runs, and the reference
the graph is tested against.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import logging

from ..utils.cuda_graphs import graph_capture
from ..utils.module_state import module_state
from .state import unwrap_model

logger = logging.get_logger(__name__)

CAPTURES = ("graph", "eager")
LENGTH_MULTIPLE = 64  # generated batches of every length share a graph per 64 positions
MAX_GRAPHS = 8  # shapes kept; the least recently replayed goes first
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # RoPE scalings whose frequencies depend on the sequence's length

# The model instance's attribute holding its CapturedBackbone: read by run_backbone with a dict lookup, so the
# forward of a model that has none takes no extra call.
CAPTURED_ATTR = "__liger_kd_captured__"


@dataclass
class _Entry:
    input_ids: torch.Tensor  # (rows, padded length): the static input the graph reads
    hidden: torch.Tensor | None  # the static output the graph writes (None for the eager capture)
    graph: Any  # torch.cuda.CUDAGraph, or None for the eager capture


class CapturedBackbone:
    """The graphs of one model: `run(backbone, input_ids)` is `backbone(input_ids=...).last_hidden_state`."""

    def __init__(self, capture: str = "graph", length_multiple: int = LENGTH_MULTIPLE, max_graphs: int = MAX_GRAPHS,
                 trained_length: int | None = None):  # fmt: skip
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}; got capture={capture!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (length_multiple, max_graphs)):
            raise ValueError(
                f"length_multiple and max_graphs must be whole numbers >= 1; got length_multiple={length_multiple!r}, "
                f"max_graphs={max_graphs!r}"
            )
        self.capture = capture
        self.length_multiple = length_multiple
        self.trained_length = trained_length  # no padded length goes past it (the module docstring)
        self.max_graphs = max_graphs
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.parameters_at: tuple[int, ...] | None = None
        self.captures = 0  # graphs captured so far (tests and logs read it)
        self.refused: set[tuple] = set()  # keys whose capture failed: they run eagerly
        self._pool = None

    def settings(self) -> tuple:
        """What the constructor was given: two with the same settings capture the same graphs."""
        return self.capture, self.length_multiple, self.max_graphs, self.trained_length

    def replay(self, model: nn.Module, backbone: nn.Module, input_ids, attention_mask, kwargs: dict):
        """The backbone's output from the graphs, or None where they do not apply (the caller runs it eagerly): no
        gradients, the model in eval mode, 2-D token ids, no mask and no keyword beyond `use_cache` off."""
        if (
            torch.is_grad_enabled()
            or model.training
            or attention_mask is not None
            or not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or any(v is not None and not (k == "use_cache" and v is False) for k, v in kwargs.items())
        ):
            return None
        hidden = self.run(model, backbone, input_ids)
        return None if hidden is None else BaseModelOutputWithPast(last_hidden_state=hidden)

    def run(self, model: nn.Module, backbone: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The last hidden states (rows, length, hidden) of `backbone` on `input_ids`, or None where this shape
        cannot be captured (the caller then runs the backbone itself). From a graph they are a view of its output
        buffer, which the next replay of that shape overwrites: clone them to keep them (the fused loss reads
        them at once)."""
        rows, length = input_ids.shape
        padded = -(-length // self.length_multiple) * self.length_multiple if length_may_be_padded(model) else length
        if self.trained_length is not None:  # never across the trained length (the module docstring)
            padded = max(length, min(padded, self.trained_length))
        key = (rows, padded, input_ids.device, torch.is_autocast_enabled(input_ids.device.type),
               torch.get_autocast_dtype(input_ids.device.type), torch.is_inference_mode_enabled(),
               module_state(model))  # fmt: skip
        if key in self.refused:
            return None
        at = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
        if at != self.parameters_at:  # parameters or buffers moved: every graph reads the old addresses
            self.entries.clear()
            self.parameters_at = at
        entry = self.entries.get(key)
        if entry is None:
            entry = self._new_entry(key, backbone, input_ids, padded)
            if entry is None:
                return None
        self.entries.move_to_end(key)
        entry.input_ids[:, :length].copy_(input_ids)
        if entry.graph is None:
            hidden = backbone(input_ids=entry.input_ids, attention_mask=None, use_cache=False).last_hidden_state
        else:
            entry.graph.replay()
            hidden = entry.hidden
        return hidden[:, :length]

    def _new_entry(self, key: tuple, backbone: nn.Module, input_ids: torch.Tensor, padded: int) -> _Entry | None:
        while len(self.entries) >= self.max_graphs:
            self.entries.popitem(last=False)
        static_ids = torch.zeros((input_ids.shape[0], padded), dtype=input_ids.dtype, device=input_ids.device)
        static_ids[:, : input_ids.shape[1]].copy_(input_ids)
        if self.capture == "eager":
            entry = _Entry(static_ids, None, None)
        else:
            try:
                graph, hidden = _capture(backbone, static_ids, self._graph_pool())
            except RuntimeError as err:  # an op a capture refuses (a host sync in the forward or a hook, say)
                self.refused.add(key)
                self._pool = None  # the failed capture's pool may stay marked as recording: later ones take a new one
                logger.warning("the teacher's forward could not be captured for shape %s (%s): it runs eagerly",
                               tuple(static_ids.shape), str(err).splitlines()[0])  # fmt: skip
                return None
            entry = _Entry(static_ids, hidden, graph)
        self.captures += 1
        self.entries[key] = entry
        return entry

    def _graph_pool(self):
        if self._pool is None:  # one memory pool for every shape's graph: they replay one at a time
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


def _autocast_as_now(device: torch.device):
    """The caller's autocast, with its cast cache off (see the module docstring)."""
    return torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type),
                          enabled=torch.is_autocast_enabled(device.type), cache_enabled=False)  # fmt: skip


def _capture(backbone: nn.Module, input_ids: torch.Tensor, pool) -> tuple[Any, torch.Tensor]:
    device = input_ids.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), _autocast_as_now(device):  # warm-up: lazy initialisation, compilation, handles
        for _ in range(2):
            backbone(input_ids=input_ids, attention_mask=None, use_cache=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # a failed capture raises with the stream, the allocator and the generator put right (utils/cuda_graphs.py)
    with graph_capture(graph, device, pool, capture_error_mode="thread_local"), _autocast_as_now(device):
        hidden = backbone(input_ids=input_ids, attention_mask=None, use_cache=False).last_hidden_state
    return graph, hidden


def length_may_be_padded(model: nn.Module) -> bool:
    """Whether a padded tail leaves every real position's output as it is: attention causal and RoPE's frequencies
    not following the length (LENGTH_DEPENDENT_ROPE). Read at every call as well as when enabled: a config changed
    in between (Gemma-3's use_bidirectional_attention, read by its forward at run time) is not padded into."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    bidirectional = getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False
    return rope_type not in LENGTH_DEPENDENT_ROPE and not bidirectional


def enable_captured_backbone(model: nn.Module, capture: str | None = None, **options) -> CapturedBackbone:
    """Have `model`'s KD forward replay its decoder from CUDA graphs when it runs without gradients on tokens alone
    (the module docstring). `capture`: "graph" on CUDA, "eager" elsewhere unless given. A model already enabled
    with the same settings keeps its graphs (a second Trainer over the same teacher replays what the first
    captured, and tries again the shapes it could not capture); other settings start afresh."""
    inner = unwrap_model(model)
    devices = {p.device.type for p in inner.parameters()}
    if capture is None:
        capture = "graph" if devices == {"cuda"} else "eager"
    elif capture == "graph" and devices != {"cuda"}:
        raise ValueError(
            f"capture='graph' needs the model on a CUDA device; its parameters are on {sorted(devices)}: move it "
            f"first, or leave capture=None (eager off CUDA)"
        )
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not length_may_be_padded(inner):  # the length shows in every position: no padding
        options["length_multiple"] = 1
    trained_length = getattr(text, "original_max_position_embeddings", None) or getattr(
        text, "max_position_embeddings", None
    )
    captured = CapturedBackbone(capture, trained_length=trained_length, **options)
    kept = inner.__dict__.get(CAPTURED_ATTR)
    if kept is not None and kept.settings() == captured.settings():
        kept.refused.clear()  # shapes whose capture failed are tried again
        return kept
    inner.__dict__[CAPTURED_ATTR] = captured  # not a submodule, not a parameter: state_dict and .to() ignore it
    return captured


def disable_captured_backbone(model: nn.Module) -> None:
    """Back to the eager forward; the graphs and their memory are released."""
    unwrap_model(model).__dict__.pop(CAPTURED_ATTR, None)


def captured_backbone_of(model: nn.Module) -> CapturedBackbone | None:
    return unwrap_model(model).__dict__.get(CAPTURED_ATTR)
