"""data_consistency compares the ranks' dataset items by content at fixed indices."""

from __future__ import annotations


def test_dataset_items_are_compared_by_content_at_fixed_indices():
    import numpy as np
    import torch

    from ddp_conformance.checks.data_consistency import _read, sample_indices
    from ddp_conformance.checks.support.model_state import item_digest

    assert sample_indices(64) == sample_indices(64) and {0, 63} <= set(sample_indices(64))
    assert len(sample_indices(64)) >= 16 and sample_indices(3) == [0, 1, 2] and sample_indices(0) == []
    item = (5, torch.arange(4.0), {"label": np.int64(2), "name": "x"})
    same = (5, torch.arange(4.0).clone(), {"name": "x", "label": np.int64(2)})
    assert item_digest(item) == item_digest(same)
    assert item_digest(item) != item_digest((5, torch.arange(4.0) + 1e-7, item[2]))
    assert item_digest(torch.ones(2, dtype=torch.bfloat16)) != item_digest(torch.ones(2, dtype=torch.float16))
    assert item_digest(torch.zeros(2, 3)) != item_digest(torch.zeros(3, 2))
    # an item that is random on every read (augmentation) is left out, a fixed one is compared
    data = [torch.ones(3), None]
    data_reads = type("Augmented", (), {"__getitem__": lambda self, i: data[0] if i == 0 else torch.rand(3)})()
    found = _read(data_reads, [0, 1])
    assert found[0] == item_digest(torch.ones(3)) and found[1] is None
