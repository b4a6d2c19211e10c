"""A teacher behind a server: the wire formats (protocols.py, a registry by name), the client that asks a server
(vLLM, SGLang or `liger-kd serve`), the prefetcher that attaches its replies to training batches, and the server
itself (server.py; FastAPI and uvicorn imported lazily, so it is not imported here)."""

from .client import PendingTopK, TeacherClient, TeacherServerError, TeacherTimeoutError
from .prefetch import TeacherPrefetcher
from .protocols import PROTOCOLS, TeacherReplyError, WireFormat

__all__ = [
    "PROTOCOLS",
    "PendingTopK",
    "TeacherClient",
    "TeacherPrefetcher",
    "TeacherReplyError",
    "TeacherServerError",
    "TeacherTimeoutError",
    "WireFormat",
]
