"""HiddenClient: the exact served teacher's client: final hidden states of token sequences from
`liger-kd serve` (wire/hidden_wire.py), each with the head of the weight version it was computed with.

The head is fetched once per weights version and cached: every hidden-state reply names its version (the server's
weights_id: a restarted server, at weight version 0 again, sends another), and a reply of another version than the
cached head's makes the client fetch the head again before the reply is used. A head
newer than the reply (the weights changed in between) sends the request again, so hidden states and head always
come from one version. Requests, retries, timeouts and errors are TeacherClient's.
"""

from __future__ import annotations

import json
import threading

from ...wire.hidden_wire import HEAD_PATH, HIDDEN_PATH, WIRE_DTYPES, TeacherHead, decode_head, decode_hidden
from ...wire.protocols import BINARY_MEDIA_TYPE
from .client import TeacherClient, TeacherServerError

HIDDEN_PROTOCOL = "hidden"  # the trainer's kd_teacher_protocol for this client (the top-k ones: wire/protocols.py)
VERSION_ATTEMPTS = 4  # requests for one chunk while the server's weights keep changing under it


class HiddenClient(TeacherClient):
    """Per sequence, (hidden states (T, H) (bf16 / float32 as sent; fp8 dequantised to float32), TeacherHead).
    `dtype`: what the server sends, one of hidden_wire.WIRE_DTYPES ("auto": the teacher's own dtype)."""

    def __init__(self, url: str, *, dtype: str = "auto", **options) -> None:
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype must be one of {WIRE_DTYPES} (the hidden states on the wire); got {dtype!r}")
        super().__init__(url, "liger", top_k=1, vocab_size=1, **options)
        self.protocol, self.dtype = "hidden", dtype
        self.head_lock = threading.Lock()
        self.cached_head: TeacherHead | None = None
        self.head_fetches = 0
        self.bytes_received = self.tokens_received = 0  # hidden-state replies: bytes on the wire per token
        self.count_lock = threading.Lock()  # replies arrive on several threads: `+=` alone loses updates

    def head(self, version: int | None = None) -> TeacherHead:
        """The head at `version` (None: the server's current), from the cache when it holds that version."""
        with self.head_lock:
            cached = self.cached_head
            if cached is None or (version is not None and cached.version != version):
                raw, _ = self._send("GET", HEAD_PATH, None, BINARY_MEDIA_TYPE)
                cached = decode_head(raw, request=f"GET {self.url}{HEAD_PATH}")
                self.cached_head, self.head_fetches = cached, self.head_fetches + 1
            return cached

    def _request(self, sequences: list[list[int]]) -> list:
        size = f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens"
        body = json.dumps({"prompt": sequences, "dtype": self.dtype}).encode()
        for _ in range(VERSION_ATTEMPTS):
            name = f"request {next(self._counter)} ({size}) to {self.url}{HIDDEN_PATH}"
            raw, _ = self._send("POST", HIDDEN_PATH, body, BINARY_MEDIA_TYPE)
            states, version = decode_hidden(raw, sequences, request=name)
            head = self.head(version)
            if head.version == version:  # else the weights changed between the two: ask again
                width = head.weight.shape[-1]
                if states and states[0].shape[-1] != width:
                    raise TeacherServerError(f"{name}: hidden states of width {states[0].shape[-1]}, the head's "
                                             f"weight is {tuple(head.weight.shape)}")  # fmt: skip
                with self.count_lock:
                    self.bytes_received += len(raw)
                    self.tokens_received += sum(map(len, sequences))
                return [(h, head) for h in states]
        raise TeacherServerError(f"the teacher's weights at {self.url} changed during each of {VERSION_ATTEMPTS} "
                                 f"requests: no hidden states and head of one version")  # fmt: skip
