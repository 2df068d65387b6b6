"""The aten ops a block of code dispatches (test support): what the tests of CUDA graphs and static steps count."""

from torch.utils._python_dispatch import TorchDispatchMode


class Dispatched(TorchDispatchMode):
    """The names of the aten ops dispatched under it, in order (`ops`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
