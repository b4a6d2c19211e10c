"""A rollout store scored by a teacher behind a server (`liger-kd precompute --rollouts-from ... --teacher-url URL`)
instead of one in this process, through the served-teacher clients of teacher/client/:

    topk     the server's top-k (vLLM, SGLang or `liger-kd serve`) and its log-prob of each sampled token, from one
             JSON request (token_client.TopKTokenClient: the binary reply carries no own-token log-prob); the
             top-k is at temperature 1 (what servers report), so --temperature must be 1
    sampled  `liger-kd serve`'s sampled teacher tokens (--samples, after the exact --top-k: the hybrid), drawn at
             --temperature from each sequence's own seeded generator as precompute draws them, plus a top-1 JSON
             request for the sampled tokens' log-probs
    hidden   `liger-kd serve`'s final hidden states and head (the exact teacher): the top-k, samples and log-probs
             computed here by the code that scores an in-process teacher's hidden states (scoring.rows_of_chunks),
             so the store is the in-process one up to the rounding of the server's forward
    auto     `liger-kd serve` (GET /v1/models' owned_by) with --samples: sampled; else topk

The server is asked what it serves (GET /v1/models) when the teacher is made, so an unreachable URL, a protocol it
does not speak or a top-k beyond its --top-k is a one-line ValueError before any model loads. The API key comes
from the LIGER_KD_API_KEY environment variable (or `api_key=`), never from the URL, and is never written down.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

import torch

from ...teacher.client import TeacherClient, TeacherServerError
from ...teacher.client.client import AUTO_PROTOCOL
from ...teacher.client.hidden_client import HIDDEN_PROTOCOL, HiddenClient
from ...teacher.client.token_client import TopKTokenClient
from ...teacher.precompute import hidden_chunks
from ...utils.errors import reason_of
from ...wire.conventions import API_KEY_ENV, is_int
from .scoring import RowScores, ScoreOptions, TeacherScores, right_padded, rows_of_chunks

TOPK, SAMPLED = "topk", "sampled"
SERVED_PROTOCOLS = (AUTO_PROTOCOL, TOPK, SAMPLED, HIDDEN_PROTOCOL)
LIGER_OWNER = "liger-kd"  # GET /v1/models' owned_by of `liger-kd serve`: the one that serves samples, hidden states


def checked_url(url: Any, flag: str) -> str:
    """An http(s) URL with a host and no credentials in it (a key in a URL would reach the manifest and logs: it
    belongs in the environment), trailing slash dropped; ValueError naming `flag` otherwise."""
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r}: not an http(s) URL with a host, e.g. http://127.0.0.1:8000")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{flag}: the URL holds credentials (user:key@host), which would be written to the store's "
                         f"manifest: drop them and put the key in {API_KEY_ENV}")  # fmt: skip
    if parts.query or parts.fragment:
        raise ValueError(f"{flag} {parts.scheme}://{parts.netloc}{parts.path}: the URL holds a query or fragment "
                         f"(keys travel in {API_KEY_ENV}, not in URLs): give the server's base URL")  # fmt: skip
    return url.rstrip("/")


def served_model(client: TeacherClient, flag: str) -> dict:
    """The model GET /v1/models lists, or a one-line ValueError naming `flag` and the URL (nothing answers there,
    a wrong API key, no model listed)."""
    try:
        return client.served_model()
    except TeacherServerError as e:
        # no answer at all: the connection's own error (the client's message speaks of a teacher during training)
        reason = reason_of(e.__cause__) if isinstance(e.__cause__, OSError) else reason_of(e)
        what = "the student's engine (vLLM, SGLang, or `liger-kd serve --teacher STUDENT --port PORT`)" \
            if flag == "--rollouts-from" else "it (e.g. `liger-kd serve --teacher PATH --port PORT`)"  # fmt: skip
        raise ValueError(f"{flag} {client.url}: no server answers GET /v1/models ({reason}); start {what} or fix "
                         f"the URL; the API key is read from {API_KEY_ENV}") from None  # fmt: skip


class ServedTeacher:
    """The teacher at `url`, asked about rollouts over `protocol` (SERVED_PROTOCOLS; see the module docstring).
    `timeout` / `retries`: each request's (retries on connection errors and 5xx, with backoff); `device`: where the
    hidden protocol's head runs."""

    def __init__(self, url: str, protocol: str = AUTO_PROTOCOL, *, timeout: float = 600.0, retries: int = 3,
                 api_key: str | None = None, device: str | torch.device = "cpu",
                 flag: str = "--teacher-url") -> None:  # fmt: skip
        if protocol not in SERVED_PROTOCOLS:
            raise ValueError(f"--teacher-protocol must be one of {SERVED_PROTOCOLS}; got {protocol!r}")
        self.url, self.asked, self.flag = checked_url(url, flag), protocol, flag
        self.options = dict(timeout=timeout, retries=retries, api_key=api_key or os.environ.get(API_KEY_ENV) or None)
        self.device = torch.device(device)
        probe = TeacherClient(self.url, "vllm", top_k=1, vocab_size=1, **self.options)
        try:
            self.model = served_model(probe, flag)
        finally:
            probe.close()
        self.name = self.model["id"]
        served = self.model.get("vocab_size")
        self.vocab_size: int | None = served if is_int(served) else None  # vLLM and SGLang do not list it
        context = self.model.get("max_model_len")
        self.context: int | None = context if is_int(context) else None
        self.protocol: str | None = None
        self.clients: dict = {}

    def check(self, options: ScoreOptions, vocab_size: int) -> None:
        """What the store asks (top-k, samples, temperature) against what the server serves, before any work;
        `vocab_size` bounds the ids a reply may hold. Chooses the protocol of "auto"."""
        owner = self.model.get("owned_by")
        liger = owner == LIGER_OWNER
        protocol = self.asked if self.asked != AUTO_PROTOCOL else (SAMPLED if options.samples and liger else TOPK)
        where = f"{self.flag} {self.url} (model {self.name!r}, owned_by {owner!r})"
        if protocol in (SAMPLED, HIDDEN_PROTOCOL) and not liger:
            raise ValueError(f"--teacher-protocol {protocol} is served by `liger-kd serve` only, and {where} is "
                             f"another server: use --teacher-protocol topk (without --samples), or serve the "
                             f"teacher with liger-kd serve")  # fmt: skip
        if protocol == TOPK and options.samples:
            raise ValueError(f"--samples {options.samples}: the top-k protocol draws no teacher tokens; use "
                             f"--teacher-protocol sampled or hidden (liger-kd serve), or drop --samples")  # fmt: skip
        if protocol == SAMPLED and not options.samples:
            raise ValueError("--teacher-protocol sampled draws teacher tokens: give --samples m (>= 1), or use "
                             "--teacher-protocol topk")  # fmt: skip
        if protocol == TOPK and options.temperature != 1.0:
            raise ValueError(f"--temperature {options.temperature:g}: a server's top-k is at temperature 1, and "
                             f"tempering a top-k afterwards is not exact; keep --temperature 1 (the loss tempers "
                             f"exactly), or use --teacher-protocol hidden")  # fmt: skip
        most = self.model.get("max_logprobs")
        wanted = options.top_k if protocol != HIDDEN_PROTOCOL else 0
        if is_int(most) and wanted > most:
            raise ValueError(f"--top-k {options.top_k}: {where} serves at most {most} log-probs per position (its "
                             f"--top-k): lower --top-k, or restart the server with --top-k {options.top_k}")
        self.protocol, self.store_vocab = protocol, vocab_size

    def section(self) -> dict:
        """The manifest's name of this teacher: where it is served, its model, the protocol (never a key)."""
        return {"url": self.url, "model": self.name, "protocol": self.protocol}

    def rows(self, sequences: list[list[int]], options: ScoreOptions) -> TeacherScores:
        """The teacher's TeacherScores of `sequences` (scoring.TeacherRows)."""
        if self.protocol is None:
            raise ValueError("ServedTeacher.check(options, vocab_size) runs before rows(): it chooses the protocol")
        if self.protocol == HIDDEN_PROTOCOL:
            return self.hidden_rows(sequences, options)
        own = self.client("own", top_k=max(options.top_k, 1) if self.protocol == TOPK else 1).fetch(sequences)
        if self.protocol == TOPK:
            return TeacherScores.of_rows([RowScores(ids.long(), lp, None, next_lp) for (ids, lp), next_lp in own])
        drawn = self.client("samples", options=options).fetch(sequences)
        out = []
        for s, (_, next_lp) in zip(drawn, own):
            top_ids = s.topk_ids if s.topk_ids is not None else torch.zeros(len(next_lp), 0, dtype=torch.long)
            top_lp = s.topk_logprobs if s.topk_logprobs is not None else torch.zeros(len(next_lp), 0)
            out.append(RowScores(top_ids.long(), top_lp.float(), (s.ids, s.counts, s.logprobs), next_lp))
        return TeacherScores.of_rows(out)

    def hidden_rows(self, sequences: list[list[int]], options: ScoreOptions) -> TeacherScores:
        replies = self.client("hidden").fetch(sequences)
        heads = {head.version for _, head in replies}
        if len(heads) != 1:  # the server's weights changed between the requests of one call: one teacher per row set
            raise TeacherServerError(f"{self.url}: the teacher's weights changed while one call's rollouts were "
                                     f"scored (versions {sorted(heads)}); rerun the command (it resumes)")
        head = replies[0][1]
        ids, mask = right_padded(sequences, self.device)
        states = torch.zeros((*ids.shape, head.weight.shape[-1]), dtype=replies[0][0].dtype, device=self.device)
        for row, (hidden, _) in enumerate(replies):
            states[row, : len(hidden)] = hidden.to(self.device)
        weight = head.weight.to(self.device)
        bias = None if head.bias is None else head.bias.to(self.device)
        chunks = hidden_chunks(states.reshape(-1, states.shape[-1]), weight, bias, head.softcap)
        return rows_of_chunks(chunks, ids, mask, options, sequences)

    def client(self, kind: str, top_k: int = 1, options: ScoreOptions | None = None):
        key = (kind, top_k, options)
        if key not in self.clients:
            common = dict(**self.options, model=self.name)
            if kind == "hidden":
                self.clients[key] = HiddenClient(self.url, dtype="auto", **self.options)
            elif kind == "samples":
                self.clients[key] = TeacherClient(
                    self.url, "liger", top_k=options.top_k, vocab_size=self.store_vocab, samples=options.samples,
                    sample_seed=options.seed, sample_temperature=options.temperature, **common,
                )  # fmt: skip
            else:
                protocol = self.model.get("owned_by")
                protocol = "sglang" if protocol == "sglang" else "vllm"
                self.clients[key] = TopKTokenClient(self.url, protocol, top_k=top_k, vocab_size=self.store_vocab,
                                                    **common)  # fmt: skip
        return self.clients[key]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
