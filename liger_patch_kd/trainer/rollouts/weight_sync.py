"""The student's weights to the rollout engine every `kd_sync_steps` optimizer steps.

A PEFT student sends its adapter: saved (PEFT's save_pretrained) into a directory the trainer owns, then loaded by
vLLM's runtime adapter route POST /v1/load_lora_adapter {"lora_name", "lora_path"} (vLLM needs --enable-lora,
--max-lora-rank >= the adapter's rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `liger-kd serve` takes it as is);
later requests name that adapter as their `model`, and the previous adapter is unloaded and its directory deleted.
A full-weight student goes by `transport` (kd_sync_transport): "disk" writes its state dict as one safetensors file,
loaded by POST /update_weights_from_disk {"model_path"} (SGLang's route, which `liger-kd serve` speaks; the engine
must read the directory: the same machine, or a shared filesystem through kd_sync_dir); "broadcast" / "vllm-nccl"
send it over vLLM's weight-transfer routes, by torch.distributed or by vLLM's NCCL communicator
(weight_sender.py). Every directory made is deleted after its load or at close; nothing else
is touched.

After each load the engine's `weights_id` is noted (`liger-kd serve` reports it in its update replies, /health and
each completion reply: a random id per server start and its weight version), so rollouts answered by other weights
(the engine restarted with its checkpoint's, or another process updated it) are told from the student's
(engine.EngineRollouts checks each reply). It comes from the reply to this run's own update: a GET /health after it
could already name another process's update landed in between. Only loads whose reply carries none (a LoRA
adapter's plain-text reply, vLLM's) fall back to /health. An engine that reports none anywhere (vLLM) cannot be
checked this way.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ...teacher.client.transport import HttpEndpoint, TeacherServerError

logger = logging.get_logger(__name__)


class EngineWeightsLost(RuntimeError):
    """The engine answered with other weights than those of this run's last push: it restarted, or another process
    updated its weights."""


def served_weights(http: HttpEndpoint) -> int | None:
    """The engine's weights_id from GET /health; None from an engine that reports none (vLLM's /health is empty)."""
    try:
        raw, _ = http.send("GET", "/health", None, "application/json")
    except TeacherServerError:  # an engine without /health (a 404): no check; a dead one fails its completions
        return None
    return weights_id_in(raw)


def weights_id_in(raw: bytes) -> int | None:
    """The weights_id a JSON reply names; None when it names none (vLLM's replies, a plain-text one)."""
    try:
        said = json.loads(raw).get("weights_id")
    except (ValueError, AttributeError, RecursionError, UnicodeDecodeError):  # not a JSON object: reports nothing
        return None
    return said if isinstance(said, int) and not isinstance(said, bool) else None


def peft_of(model: nn.Module) -> nn.Module | None:
    """The PeftModel inside DDP / torch.compile wrappers, or None for a full-weight model (peft imported only when
    installed: a model cannot be a PeftModel without it)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    for _ in range(8):
        if isinstance(model, PeftModel):
            return model
        wrapped = (getattr(model, a, None) for a in ("module", "_orig_mod"))
        inner = next((m for m in wrapped if isinstance(m, nn.Module)), None)
        if inner is None:
            return None
        model = inner
    return None


def unique_tensors(state: dict[str, torch.Tensor], device: torch.device | None = torch.device("cpu")) -> dict:
    """The state dict with each storage once (tied embeddings share one; safetensors refuses shared tensors), as
    contiguous copies on `device` (None: where they are), a CPU model's too: the file may be written, or the
    broadcast sent, after the optimizer has moved on."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().to(device or tensor.device, copy=True).contiguous()
    return out


class WeightSync:
    """Pushes the student to the engine at `http` when `due(step)`: every `every` optimizer steps, and before the
    first rollout. `synced_step` is the step whose starting weights the engine holds (once the staged loads have
    run); `model_name` the name the completions must ask for (the adapter's for a PEFT student, None: the engine's
    own model)."""

    def __init__(self, http: HttpEndpoint, every: int, sync_dir: str | None = None, sender: Any = None) -> None:
        self.http, self.every, self.sync_dir = http, every, sync_dir
        self.sender = sender  # a weight_sender.BroadcastSender for full weights (kd_sync_transport), or None: disk
        self.synced_step: int | None = None
        self.model_name: str | None = None
        self.loaded_name: str | None = None  # the adapter the engine last loaded (model_name once loads have run)
        self._on_engine: list[str] = []  # the adapters this run loaded and has not unloaded: unloaded at close
        self.pushes = 0
        self.engine_weights: int | None = None  # the engine's weights_id after the last load (None: unknown)
        self._root: Path | None = None
        self._kept: Path | None = None  # the loaded adapter's directory (vLLM may read it again)
        self._run = uuid.uuid4().hex[:8]  # adapter names unique to this run

    def due(self, step: int) -> bool:
        return self.synced_step is None or step - self.synced_step >= self.every

    def push(self, model: nn.Module, step: int) -> None:
        """The weights `model` holds now, written and loaded by the engine before this returns."""
        self.stage(model, step)()

    def stage(self, model: nn.Module, step: int) -> Callable[[], None]:
        """Take the weights `model` holds now (the weights step `step` starts with: a PEFT adapter saved into a
        directory of ours, full weights copied to the CPU) and return the load: the file written (full weights) and the
        requests that make the engine take them and drop the previous ones. push runs it at once; asynchronous
        rollouts (asynchronous.py) send it from their worker, after the generation requests queued before
        it, so every request is answered by the weights it was counted against. From here on `synced_step` is
        `step` and `model_name` names the new weights."""
        peft = peft_of(model)
        if peft is None and self.sender is not None:  # broadcast: a copy where the weights are, sent by the load
            tensors = self.sender.snapshot(model)

            def load() -> int | None:
                return self.sender.send(tensors, step)
        elif peft is not None:
            target = Path(tempfile.mkdtemp(prefix=f"step{step}-", dir=self._directory()))
            adapter = peft.active_adapter
            peft.save_pretrained(str(target), selected_adapters=[adapter])
            path = target if adapter == "default" else target / adapter  # PEFT nests adapters not named default
            name = f"liger-kd-{self._run}-step{step}"
            previous, kept = self.model_name, self._kept
            self.model_name, self._kept = name, target

            def load() -> None:
                self.http.post_json("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
                self.loaded_name = name
                self._on_engine.append(name)
                if previous is not None and previous in self._on_engine:  # not when the engine lost it (restart)
                    self._unload(previous)
                self._remove(kept)  # vLLM may read a loaded adapter's directory again: kept until the next one
                # the reply is vLLM's plain text, with no weights_id: None, so /health is read (an adapter changes
                # no weights_id; its name guards the rollouts: an engine without it answers 404, EngineRollouts)
        else:
            from safetensors.torch import save_file

            target = Path(tempfile.mkdtemp(prefix=f"step{step}-", dir=self._directory()))
            tensors = unique_tensors(model.state_dict())  # a CPU copy now; the file is written by the load

            def load() -> int | None:
                try:
                    save_file(tensors, str(target / "model.safetensors"))
                    raw, _ = self.http.post_json("/update_weights_from_disk", {"model_path": str(target)})
                    return weights_id_in(raw)  # this update's: /health could name another update landed since
                finally:
                    self._remove(target)  # loaded (or refused): the engine holds the weights, not the file

        def load_and_note() -> None:
            said = load()
            # what the replies to this push's rollouts must name: the update's own reply's; /health only for replies
            # that carry none (vLLM's, an adapter's plain text), where a concurrent update cannot be told apart
            self.engine_weights = said if said is not None else served_weights(self.http)

        self.synced_step = step
        self.pushes += 1
        return load_and_note

    def engine_lost(self) -> None:
        """The engine no longer holds what this run loaded (it restarted): the next push loads afresh, unloading
        nothing (an adapter the engine lacks cannot be unloaded: a 400 that would stop the run)."""
        self._on_engine.clear()
        self.synced_step, self.model_name, self.loaded_name, self.engine_weights = None, None, None, None

    def forget_staged(self) -> None:
        """After asynchronous loads were cancelled or failed: push again before the next rollouts, and name the
        adapter the engine really holds."""
        self.synced_step, self.model_name = None, self.loaded_name

    def close(self) -> None:
        """The end of a run (or its failure): the adapter this run loaded is unloaded from the engine (else it
        stays there, and a full-weight run against that engine is refused: its layers rename the model's tensors),
        the broadcast group shut down, every directory made deleted; the next rollouts push afresh."""
        try:
            while self._on_engine:
                self._unload(self._on_engine[-1], at_close=True)
            self.loaded_name = None
            if self.sender is not None:
                self.sender.close()
        finally:
            if self._root is not None:
                self._finalizer()
                self._root = self._kept = None
            self.synced_step, self.model_name, self.engine_weights = None, None, None

    def _unload(self, name: str, at_close: bool = False) -> None:
        """Unload adapter `name` (one this run loaded) from the engine. A failure raises, the name kept for close to
        try again; at close it is a warning (a failed run's cleanup must not hide the run's own error)."""
        try:
            self.http.post_json("/v1/unload_lora_adapter", {"lora_name": name})
        except (TeacherServerError, OSError) as e:
            if not at_close:
                raise
            logger.warning(f"could not unload the LoRA adapter {name!r} this run loaded on {self.http.url} ({e}); "
                           f"unload it there (POST /v1/unload_lora_adapter) or restart the engine")  # fmt: skip
        self._on_engine.remove(name)

    def _directory(self) -> Path:
        if self._root is None:
            # absolute: the engine resolves the paths it is sent against its own working directory
            self._root = Path(tempfile.mkdtemp(prefix="liger-kd-sync-", dir=self.sync_dir)).resolve()
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._root), True)
        return self._root

    def _remove(self, path: Path | None) -> None:
        if path is not None and self._root is not None and path.parent == self._root:  # only what we made
            shutil.rmtree(path, ignore_errors=True)
