"""Shared test builders (tests/builders/metrics.py): imported by the test modules that use them."""

from __future__ import annotations

from unittest import mock
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode
import torch

from torchllm.train import Trainer


class SyncRecorder(TorchDispatchMode):
    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.events.append("sync")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_syncs(model: torch.nn.Module, events: list[str]):
    """Appends 'sync' to `events` per host sync and 'forward' at each model forward."""
    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def counting_tolist(self):
        events.append("sync")
        return tolist(self)

    def counting_tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            events.append("sync")  # a blocking host-to-device copy on CUDA
        return tensor(data, *args, **kwargs)

    hook = model.register_forward_pre_hook(lambda *_: events.append("forward"))
    try:
        with mock.patch.object(torch.Tensor, "tolist", counting_tolist), \
                mock.patch.object(torch, "tensor", counting_tensor), SyncRecorder(events):
            yield
    finally:
        hook.remove()


def step_events(trainer: Trainer) -> list[str]:
    """The events of one (non-logging) train_step from its train_batch on (data loading
    before it works on host tensors, not yet moved to the device). Logging steps add their
    extra statistics' syncs, every metrics.log_freq steps."""
    events: list[str] = []
    forward_backward = trainer.module.train_batch

    with contextlib.ExitStack() as stack:
        def recorded(micro_batches):
            stack.enter_context(record_syncs(trainer.model, events))
            return forward_backward(micro_batches)

        stack.enter_context(mock.patch.object(trainer.module, "train_batch", recorded))
        stack.enter_context(mock.patch.object(trainer.metrics, "is_log_step", lambda step: False))
        trainer.train_state.step += 1
        trainer.train_step()
    return events


def assert_one_sync_after_the_forwards(events: list[str], forwards: int) -> None:
    assert events.count("forward") == forwards, events
    assert events.count("sync") == 1, events
    assert events.index("sync") > max(i for i, e in enumerate(events) if e == "forward")
