"""Data position: resume at the exact next sample, with any number of DataLoader workers.

* `ResumableSampler` — the order is a pure function of (seed, epoch, position), computed by a
  keyed bijection (O(1) time and memory at any position); rank r of W takes the contiguous
  slice ``[r*B/W, (r+1)*B/W)`` of each global batch; the cursor is global.
* `ResumableLoader` — wraps a DataLoader; its state counts samples consumed by completed
  updates (not prefetched ones), refuses saves mid accumulation window, and never draws
  from the global torch RNG.
* `seeded` — per-sample randomness seeded from (seed, epoch, position), isolated from the
  training loop's RNG streams: batches are identical with 0, 2 or 4 workers.
* `Packer` — variable-length documents into fixed-length rows, resumable mid-document.

Typical use::

    sampler = ResumableSampler(len(ds), batch_size=32, seed=0)
    loader = ResumableLoader(seeded(ds, seed=0), sampler, num_workers=2, accumulation=4)
    while loader.epoch < epochs:
        for batch in loader:
            (loss_fn(model(batch)) / loader.window_size).backward()
            if loader.at_boundary:
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
                ckpt.step_done(...)          # saves loader.state_dict() when due
"""

from __future__ import annotations

from .loader import ResumableLoader
from .packing import Packer
from .sampler import ResumableSampler, SampleKey
from .seeding import SeededDataset, seeded

__all__ = ["Packer", "ResumableLoader", "ResumableSampler", "SampleKey", "SeededDataset", "seeded"]
