"""What a trainer's RPCs to the servers move: tensor bytes each way, distributed backward's
gradients included, and messages (``PsClient.traffic``; a trainer's ``/status`` and metrics)."""
from __future__ import annotations

import threading
from typing import Any

import torch


def tensor_bytes(value: Any) -> tuple[int, int]:
    """The bytes of the tensors in ``value`` (in tuples, lists and dicts), and of those among them
    that carry gradients back the other way at distributed backward."""
    if isinstance(value, torch.Tensor):
        size = value.numel() * value.element_size()
        return size, size if value.requires_grad else 0
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    total = grads = 0
    for item in items:
        t, g = tensor_bytes(item)
        total, grads = total + t, grads + g
    return total, grads


class Traffic:
    """The tensor bytes this trainer's RPCs moved to and from the servers, distributed backward's
    gradients included (each as large as the tensor it is the gradient of): payloads, counted as
    they are handed to RPC, not wire bytes. And the messages: each call, and each gradient message
    distributed backward sends (one per answer that carried tensors needing gradients)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.messages = 0

    def add(self, sent: int, received: int, messages: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
            self.messages += messages

    def call(self, args: tuple, future: torch.futures.Future, in_step: bool) -> None:
        """``in_step``: issued in a step's autograd context, where what needs gradients gets them."""
        sent, grads_back = tensor_bytes(args)
        self.add(sent, grads_back if in_step else 0, 1)

        def answered(f: torch.futures.Future) -> None:
            try:
                received, grads_sent = tensor_bytes(f.value())
            except Exception:  # noqa: BLE001 - a failed call moved no answer; its caller hears of it
                return
            if not in_step:
                grads_sent = 0
            self.add(grads_sent, received, 1 if grads_sent else 0)
        future.add_done_callback(answered)

    @property
    def total(self) -> int:
        with self._lock:
            return self.sent + self.received

    @property
    def calls(self) -> int:
        with self._lock:
            return self.messages
