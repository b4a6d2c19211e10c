"""Several served teachers: `kd_teacher_url={"math": url1, "code": url2}`, each row routed to one of them.

Each sequence of a batch is asked of its own row's teacher (the `teacher` column, collated into the one-hot
`teacher_mixture`), all servers in flight at once, `depth` batches ahead like one served teacher
(teacher/serve/prefetch.py); the batch then carries each row's own teacher's top-k, and trains as offline data
does (its `teacher_mixture` kept for the per-teacher figures of logging steps). A row weighted over several
served teachers is refused: a mixture needs every teacher's full distribution, and the top-k of each (with
unknown tails) does not give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...teacher.serve import TeacherClient, TeacherPrefetcher
from ...teacher.serve.prefetch import STUDENT_KEYS, keys_of, sequence_tokens
from .routed_offline import RoutedRowsTeacher
from .served import check_teacher_server
from .several import MIXTURE_KEY


class RoutedTeacherClients:
    """One TeacherClient per named server; `top_k` and `wait_until_ready` as one client's."""

    def __init__(self, urls: dict[str, str], args: Any, vocab_size: int) -> None:
        self.names = list(urls)
        self.clients = [
            TeacherClient(
                urls[name],
                args.kd_teacher_protocol,
                top_k=args.kd_teacher_top_k,
                vocab_size=vocab_size,
                timeout=args.kd_teacher_timeout,
                retries=args.kd_teacher_retries,
                api_key=args.kd_teacher_api_key,
            )  # fmt: skip
            for name in self.names
        ]
        self.top_k = args.kd_teacher_top_k

    def wait_until_ready(self) -> None:
        for client in self.clients:
            client.wait_until_ready()


class _Merged:
    """The replies of several servers, put back in the batch's sequence order."""

    def __init__(self, parts: list[tuple[list[int], Any]], count: int) -> None:
        self.parts, self.count = parts, count

    def result(self) -> list:
        out = [None] * self.count
        for order, pending in self.parts:
            for i, topk in zip(order, pending.result()):
                out[i] = topk
        return out


PRIVILEGED_ROWS_REFUSED = (
    "rows with the teacher's own prompt (teacher_input_ids) and several served teachers (kd_teacher_url={name: url}) "
    "are not supported yet: serve one teacher (kd_teacher_url=url), or run the teachers in process"
)


def check_rows_for_several_served(args: Any, first_row: Any) -> None:
    """Refused when KDTrainer is built, before any server is asked (the prefetcher refuses such batches too)."""
    if isinstance(args.kd_teacher_url, Mapping) and isinstance(first_row, Mapping) and "teacher_input_ids" in first_row:
        raise ValueError(PRIVILEGED_ROWS_REFUSED)


class RoutedTeacherPrefetcher(TeacherPrefetcher):
    """TeacherPrefetcher asking each sequence's own teacher (routed by the batch's one-hot `teacher_mixture`)."""

    def submit(self, batch, segments):
        if self.keys is None and keys_of(batch, None) != STUDENT_KEYS:  # privileged rows (their own teacher prompt)
            raise ValueError(PRIVILEGED_ROWS_REFUSED)
        weights = batch[MIXTURE_KEY]
        routes = []
        for row, positions in segments:
            w = weights[row] if weights.dim() == 2 else weights[row, positions[0]]
            if int((w > 0).sum()) != 1:
                raise ValueError(
                    f"a row weighs several served teachers ({w.tolist()} over {self.client.names}); served teachers "
                    f"route rows (a 'teacher' column, one teacher per row): a mixture needs every teacher's full "
                    f"distribution, which top-k replies do not hold"
                )
            routes.append(int(w.argmax()))
        tokens = sequence_tokens(batch, segments, self.keys or STUDENT_KEYS)
        parts = []
        for j, client in enumerate(self.client.clients):
            order = [i for i, r in enumerate(routes) if r == j]
            if order:
                parts.append((order, client.submit([tokens[i] for i in order])))
        return _Merged(parts, len(segments))


def routed_served_dataloader(
    dataloader: Any, args: Any, *, vocab_size: int, depth: int = 4, tokenizer: Any = None
) -> TeacherPrefetcher:
    """The training DataLoader wrapped to ask each row's own server (args.kd_teacher_url, a dict), each checked
    first (served.check_teacher_server)."""
    if getattr(dataloader, "device", None) is not None:
        dataloader.device = None  # accelerate's DataLoaderShard would move batches in our background thread
    clients = RoutedTeacherClients(dict(args.kd_teacher_url), args, vocab_size)
    for client in clients.clients:
        check_teacher_server(client, args, vocab_size=vocab_size, tokenizer=tokenizer)
    return RoutedTeacherPrefetcher(dataloader, clients, depth=depth)


class ServedTeachers(RoutedRowsTeacher):
    """Several served teachers (kd_teacher_url={name: url}): each row's top-k asked of its own row's server ahead
    of the step, then trained as routed rows."""

    def __init__(self, teachers, args: Any, fused: bool) -> None:
        super().__init__(teachers, fused)
        self.args = args

    def dataloader(self, dataloader, student_vocab_size):
        return routed_served_dataloader(dataloader, self.args, vocab_size=student_vocab_size())
