"""A CUDA stream for each model of a cell, so that one model's work does not wait behind another's on the device.

The base, the helper and the PRM each launch their work on their own stream (`ModelStream.on`, or the `on_stream`
decorator of a method of an object with a `stream`): the helper's forward and the base's next sampling run beside
the base's forward, not after it. The waits between streams are the ones where one stream reads what another wrote:
- a model's stream waits for the default stream when a cell's runner or scorer is made (`follow`): the weights,
  caches and tables were made there;
- the default stream waits for every model stream when a cell ends (`join_all`), before the cell's caches are freed
  to the caching allocator, which hands a freed block out again on the stream that allocated it;
- uploads and downloads go on the model's stream (`transfer`): a download's event is recorded there.
Nothing else crosses: the controller passes tokens and scores between models through the host.

Streams are made once per device and role and kept (as `graphs.capture_stream`): PyTorch keeps a cuBLAS workspace
per (handle, stream) for the life of the process. Off CUDA, or with `KVRESCUE_STREAMS=0` in the environment, every
model works on the current stream.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

_STREAMS: dict[tuple[type, int, str], torch.cuda.Stream] = {}
Method = TypeVar("Method", bound=Callable[..., Any])


def enabled() -> bool:
    """Whether models get streams of their own on CUDA (`KVRESCUE_STREAMS=0`: one stream)."""
    return os.environ.get("KVRESCUE_STREAMS", "1") != "0"


class ModelStream:
    """The stream one model's work goes on: `stream`, or the current stream where it is None."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream

    @classmethod
    def of(cls, device: torch.device, role: str) -> ModelStream:
        """The stream of `role` ("base", "helper", "prm") on `device`, made on first use and kept. Its user calls
        `follow` once its tensors are made."""
        if device.type != "cuda" or not enabled():
            return cls()
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (torch.cuda.Stream, index, role)  # keyed by the class too, so that a fake CUDA's never serves CUDA
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device=index)
        return cls(_STREAMS[key])

    def follow(self) -> None:
        """The stream waits for the default stream's work queued so far (the tensors made there)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))

    @contextmanager
    def on(self) -> Iterator[None]:
        """Work launched in the block goes on this stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield


def on_stream(method: Method) -> Method:
    """A method of an object with a `stream` (`ModelStream`) that launches its work on that stream."""
    @functools.wraps(method)
    def on_own_stream(self, *args: Any, **kwargs: Any) -> Any:
        with self.stream.on():
            return method(self, *args, **kwargs)
    return on_own_stream  # type: ignore[return-value]


def join_all() -> None:
    """Each device's default stream waits for every model stream there: what was made on the default stream and
    used on a model stream may then be freed."""
    for (kind, _, _), stream in _STREAMS.items():
        if kind is torch.cuda.Stream:
            torch.cuda.default_stream(stream.device).wait_stream(stream)
