"""The wire formats a teacher server and its clients speak, pure (the standard library and torch; no HTTP
framework), so both ends import them and neither imports the other: the top-k replies of vLLM, SGLang and
`liger-kd serve` with their registry by name (protocols.py), sampled teacher tokens (sampled_wire.py; the value
they are, SampledTokens: sampled_tokens.py), the exact teacher's hidden states and head (hidden_wire.py), and what
both ends agree on besides the bytes (conventions.py). A new format is a module here: its request fields, its
encoder (the server's), its decoder with the checks of a reply (the client's)."""

from .protocols import BINARY_MEDIA_TYPE, PROTOCOLS, TeacherReplyError, TopK, WireFormat

__all__ = ["BINARY_MEDIA_TYPE", "PROTOCOLS", "TeacherReplyError", "TopK", "WireFormat"]
