"""One HTTP endpoint spoken to with retries (standard library only): what the teacher client and the rollout
engine's client share.

Faults are never silent: a connection error or a 5xx is retried with exponential backoff, each wait at most
`max_backoff` (MAX_BACKOFF_S), up to `retries` times (so at most retries x max_backoff seconds of waiting), then
TeacherServerError names the URL and the last error; a server that sends nothing for `timeout` seconds raises
TeacherTimeoutError naming the URL and the timeout (not retried: a slow server stays slow); a 4xx (the request is
wrong: retrying cannot help) raises TeacherServerError at once with the server's message and a hint by status.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

# The longest wait between two tries. Without a cap the waits double forever: kd_teacher_retries=12 slept 34 minutes
# against a server answering 500. 10 s leaves the default (5 retries from 0.5 s: 0.5 ... 8 s) as it was, notices a
# restarted server within 10 s of it answering, and makes kd_teacher_retries a plain budget: N retries wait at
# most N x 10 s (e.g. 30 ride out a 5-minute restart).
MAX_BACKOFF_S = 10.0


class TeacherServerError(RuntimeError):
    """The server could not be reached or refused the request; the message names the URL. `status` is the HTTP
    status of a refusal (None: no reply, or a 5xx retried out), so a caller can tell "no such model" (a LoRA
    adapter a restarted engine no longer holds) from other failures without parsing the message."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TeacherTimeoutError(TeacherServerError, TimeoutError):
    """The server sent nothing for `timeout` seconds."""


class HttpEndpoint:
    """`url` (no trailing slash) with its timeout, retries, backoff (the first wait, doubling per retry up to
    `max_backoff`: retry_delay) and API key (`Authorization: Bearer <key>`).
    `what` names the server in errors ("the teacher server"), `timeout_option` the argument that sets the timeout,
    `needed` what training cannot go on without, `hints` maps a 4xx status to advice appended to the error."""

    def __init__(
        self, url: str, *, timeout: float, retries: int, backoff: float = 0.5, api_key: str | None = None,
        what: str = "the teacher server", timeout_option: str = "kd_teacher_timeout", needed: str = "teacher data",
        hints: dict[int, str] | None = None, max_backoff: float = MAX_BACKOFF_S,
    ) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff, self.api_key = timeout, retries, backoff, api_key
        self.max_backoff = max_backoff
        self.what, self.timeout_option, self.needed, self.hints = what, timeout_option, needed, hints or {}
        self.retried = 0  # requests sent again after a connection error or a 5xx, for logs and tests

    def headers(self, accept: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": accept}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def post_json(self, path: str, body: Any) -> tuple[bytes, str]:
        return self.send("POST", path, json.dumps(body).encode(), "application/json")

    def send(self, method: str, path: str, data: bytes | None, accept: str) -> tuple[bytes, str]:
        """One HTTP exchange with retries on connection errors and 5xx; the reply's bytes and content type."""
        url = self.url + path
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(retry_delay(attempt, self.backoff, self.max_backoff))
            request = urllib.request.Request(url, data=data, method=method, headers=self.headers(accept))
            try:
                with open_url(request, timeout=self.timeout) as reply:
                    return reply.read(), reply.headers.get("Content-Type", "")
            except urllib.error.HTTPError as e:
                detail = e.read()[:500].decode(errors="replace")
                if e.code < 500:  # the request is wrong (or unauthorised): sending it again cannot help
                    hint = self.hints.get(e.code, "")
                    raise TeacherServerError(f"{url} refused the request: HTTP {e.code}: {detail}{hint}", e.code) from e
                last = TeacherServerError(f"HTTP {e.code}: {detail}")
            except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as e:
                if _is_timeout(e):
                    raise TeacherTimeoutError(
                        f"{self.what} at {url} sent nothing for {self.timeout:g} s ({self.timeout_option}); it is "
                        f"overloaded or stuck"
                    ) from e
                last = e
        raise TeacherServerError(
            f"{self.what} at {url} failed {self.retries + 1} times (retries={self.retries}, last error: "
            f"{last!r}); training stops rather than train without {self.needed}"
        ) from last


def retry_delay(attempt: int, backoff: float, cap: float = MAX_BACKOFF_S) -> float:
    """Seconds to wait before retry `attempt` (1: the first): `backoff` doubled per retry, at most `cap`; every retry
    loop of the package waits by this (through HttpEndpoint.send), so `retries` x `cap` bounds the total wait."""
    return min(cap, backoff * 2.0 ** min(attempt - 1, 64))  # the exponent capped too: 2.0 ** 1100 overflows


class _KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, except that `Authorization` never follows one to another origin (scheme, host, port):
    urllib copies every header to wherever a server redirects, so the API key would reach any host a server (or
    whoever answers on its address) names. The same origin keeps it, as `requests` and browsers do."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(new.full_url) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # not a port: no origin of ours
        port = -1
    return scheme, (parts.hostname or "").lower(), port


_OPENER = urllib.request.build_opener(_KeyStaysHome)


def open_url(request: urllib.request.Request, timeout: float):
    """urllib.request.urlopen for requests that may carry the API key: redirects drop it across origins."""
    return _OPENER.open(request, timeout=timeout)


def nobody_listens(error: BaseException | None) -> bool:
    """Whether `error` says that nothing can answer at the address now: the host refused the connection (it is up
    and no process listens on the port) or its name does not resolve. A server that is still starting may bind
    later, so callers retry this a bounded number of times, not for a whole timeout."""
    reason = getattr(error, "reason", error)
    return isinstance(reason, (ConnectionRefusedError, socket.gaierror))


def why(error: BaseException | None) -> str:
    """A connection error in a few words: urllib's URLError by its reason ("[Errno 111] Connection refused")."""
    return str(getattr(error, "reason", error))


def _is_timeout(error: BaseException) -> bool:
    reason = getattr(error, "reason", None)
    return isinstance(error, TimeoutError) or isinstance(reason, TimeoutError)
