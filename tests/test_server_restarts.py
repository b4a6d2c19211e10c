"""A server that keeps failing is never waited on without bound: a persistent 5xx is retried with each wait capped
(transport.retry_delay). The real app (`running`: build_app under uvicorn in a thread)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from liger_patch_kd.teacher.serve import TeacherServerError  # noqa: E402
from liger_patch_kd.teacher.serve import transport as T  # noqa: E402
from liger_patch_kd.teacher.serve.hidden_client import HiddenClient  # noqa: E402

from .test_generation_server import running  # noqa: E402
from .tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("clean_patches")
SEQ = [4, 8, 15, 16, 23, 42]


def _model(seed):
    model = tiny_model("llama", seed=seed).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # teachers of different seeds then differ by nats, not hundredths
    return model


def test_a_persistent_5xx_waits_at_most_retries_times_the_cap(monkeypatch):
    """A server answering 500 to every request (its forward fails): kd_teacher_retries=12 waited 0.5 x (2^12 - 1) s
    (34 minutes) before the cap; now each wait is at most MAX_BACKOFF_S, the same for every client (one retry loop,
    transport.HttpEndpoint.send)."""
    waits = []
    monkeypatch.setattr(T, "time", SimpleNamespace(sleep=waits.append))  # transport's waits recorded, not slept
    model = _model(3)
    with running(model) as (url, _):
        with torch.no_grad():
            model.model.norm.weight = torch.nn.Parameter(torch.ones(3))  # every forward raises: a 500
        client = HiddenClient(url, dtype="fp32", timeout=30, retries=12)
        try:
            with pytest.raises(TeacherServerError, match="failed 13 times"):
                client.fetch([SEQ])
        finally:
            client.close()
    assert len(waits) == 12 and max(waits) == T.MAX_BACKOFF_S and sum(waits) <= 12 * T.MAX_BACKOFF_S
    assert waits[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]  # the default retries wait as they always did
    assert T.retry_delay(10_000, 0.5) == T.MAX_BACKOFF_S  # no float overflow however many retries
