"""A CPU host for speculators 0.9's own ``speculators train``, loaded only by tests/train/test_interop.py.

speculators' trainer cannot run without an accelerator: it moves the model and batches to
``get_local_rank()`` (the integer GPU index 0) and its step timer calls ``torch.accelerator.synchronize()``
(tests/train/test_draft.py pins both). This file changes exactly those two things, and only when no
accelerator exists; the CLI, its argument resolution, its data loader (the files under test), model,
loss, optimizer and checkpointer run unchanged. On a GPU it does nothing.
"""

import torch

if torch.accelerator.current_accelerator() is None:
    import speculators.train.distributed as _distributed

    torch.accelerator.synchronize = lambda *args, **kwargs: None
    _distributed.get_local_rank = lambda: torch.device("cpu")
