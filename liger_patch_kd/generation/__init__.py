"""In-process generation as an engine does it: the layer between `models` (patching) and `teacher` (serving).

It knows transformers models, not the Trainer. Modules, lowest first:
  decode_attention  SDPA for one-token decode steps with grouped-query heads packed (rollouts, the server)
"""

from .decode_attention import packed_decode_attention

__all__ = ["packed_decode_attention"]
