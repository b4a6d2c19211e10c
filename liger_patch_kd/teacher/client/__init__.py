"""A teacher behind a server, from the trainer's side: the clients that ask a server (vLLM, SGLang or `liger-kd
serve`) for top-k or sampled tokens (client.py), the top-k with each sequence's own token's log-prob
(token_client.py) or hidden states and the head (hidden_client.py), the HTTP
endpoint they share with the rollout engine's client (transport.py), and the prefetcher that attaches the replies
to training batches (prefetch.py). The formats they read are the wire room's (liger_patch_kd/wire/); the server
is liger_patch_kd/server/, which this room never imports."""

from .client import PendingTopK, TeacherClient, TeacherServerError, TeacherTimeoutError
from .prefetch import TeacherPrefetcher

__all__ = [
    "PendingTopK",
    "TeacherClient",
    "TeacherPrefetcher",
    "TeacherServerError",
    "TeacherTimeoutError",
]
