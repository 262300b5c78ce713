"""Where the host reads a tensor's values: on CUDA each read waits until the GPU has run
everything queued before it (a sync), so the host can no longer queue the next step's kernels
while the GPU runs this one's. The training loop reads once per log step (docs/design.md §1);
``HostReads`` counts the reads in a block of code on any device, a CPU included, so a test
can hold the loop to that and bench/host_overhead.py can report them per step."""

from __future__ import annotations

import sys
from typing import Any

from torch.overrides import TorchFunctionMode

# Tensor methods that hand values to Python or to host memory (`.to("cpu")` and `copy_` into a
# host tensor are not counted: on a CPU they cannot be told from the loop's own moves).
READS = frozenset({"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy",
                   "cpu"})
# The data readers build each batch from host tensors, then the loop moves it to the device:
# their reads are of host memory on every device.
HOST_DATA_MODULES = frozenset({"training.text", "training.hdf5"})


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``: ``reads.names`` lists each read's method, in order
    (the data readers' reads left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS and not _in_data_reader():
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _in_data_reader() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") in HOST_DATA_MODULES:
            return True
        frame = frame.f_back
    return False
