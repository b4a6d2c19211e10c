"""In-process generation as an engine does it: the layer between `models` (patching) and `teacher` (serving).

It knows transformers models, not the Trainer. Modules, lowest first:
  decode_kernel     a Triton split-KV attention for the engine's one-token steps (reads its boolean mask)
  decode_attention  SDPA for one-token decode steps with grouped-query heads packed (rollouts, the server)
  sampling          temperature / top-k / top-p and a Gumbel-max draw as fixed-shape tensors (capturable)
  kv_cache          SlotCache: a static KV cache written at one device-side slot
  fused_projections q/k/v and gate/up as one product each, over a session-owned copy refreshed every call
  kernel_twin       the model a session runs: its module tree copied over the same parameters, the project's
                    RMSNorm / RoPE / gated-MLP kernels bound on the copies (patched or not, the same step)
  rotary_table      a session's cos / sin of every cache position, made once by the model's own rotary module
  bookkeeping_kernel the step's counters, EOS flags and output column after the draw, in one Triton kernel
  model_config      text_config: the language model's config (a VLM's text config)
  forward_options   decode_forward_options: router outputs off in decode forwards (MoE configs that ask)
  special_tokens    special_ids: a generator's pad id, EOS ids and start token (generation config, then tokenizer)
  padding           prefill_mask: a left-padded prefill's mask without fully masked rows (eager float64's NaN)
  checks            decode()'s arguments refused before any work (one-line errors)
  cancellation      Cancelled: a decode loop stopped part-way by an event another thread sets (a client gone)
  engine            decode(): prefill, then the one-token step captured as a CUDA graph and replayed (a small
                    prefill captured too)
"""

from .cancellation import Cancelled, stop_if_cancelled
from .decode_attention import packed_decode_attention
from .engine import CAPTURES, decode, decode_applies, left_padded, release_if_large, release_sessions
from .forward_options import decode_forward_options
from .model_config import text_config
from .padding import masked_rows_give_nan, prefill_mask
from .sampling import Sampling, filtered_scores

__all__ = [
    "CAPTURES",
    "Cancelled",
    "Sampling",
    "decode",
    "decode_applies",
    "decode_forward_options",
    "filtered_scores",
    "left_padded",
    "masked_rows_give_nan",
    "packed_decode_attention",
    "prefill_mask",
    "release_if_large",
    "release_sessions",
    "stop_if_cancelled",
    "text_config",
]
