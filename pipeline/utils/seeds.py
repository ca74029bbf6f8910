"""Random streams derived from fixed keys, so that a piece of training draws the same numbers however it was reached.

A fold resumed from its epoch-k checkpoint must train epochs k+1.. exactly as an uninterrupted run would. Rather than
carry every generator's state through the checkpoint (the main process's, each loader worker's, the sampler's), each
draw is made from a stream keyed by what it belongs to: (seed, fold, epoch) for an epoch's order of crops and their
augmentations, (seed, fold, epoch, batch) for dropout and other in-model randomness. Nothing then depends on how many
epochs ran in this process, on the number of loader workers, or on whether they persist between epochs.
"""

from __future__ import annotations

import numpy as np


def derived_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys (numpy's SeedSequence: distinct keys give independent streams)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))
