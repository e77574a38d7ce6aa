"""bucket_cap_mb_invariance's choice of caps: each one buckets the gradients differently from the
configured cap and from the others, and a small model is split too."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ddp_conformance.checks.bucket_cap_mb_invariance import DEFAULT_CAP_MB, FEW_BUCKETS, GUIDE_CAPS_MB, caps_to_compare


def test_a_large_model_is_compared_at_the_guides_caps() -> None:
    assert caps_to_compare(500.0, None) == [1.0, 100.0]  # DDP's default is 25 MB
    assert caps_to_compare(500.0, 50.0) == [1.0, 25.0, 100.0]


def test_caps_above_the_gradient_size_give_one_bucket_and_are_compared_once() -> None:
    assert caps_to_compare(55.8, 25.0) == [1.0, 55.8]


def test_a_small_model_is_split_into_buckets_too() -> None:
    assert caps_to_compare(0.05, None) == [0.0125]  # every guide cap holds it in one bucket, as the default does


@given(size=st.floats(min_value=1e-4, max_value=1e4),
       configured=st.one_of(st.none(), st.sampled_from([1.0, 25.0, 50.0])))
def test_every_cap_splits_differently_from_the_configured_one(size: float, configured: float | None) -> None:
    caps = caps_to_compare(size, configured)
    assert caps == sorted(set(caps)) and all(0 < cap <= size for cap in caps)
    assert min(configured or DEFAULT_CAP_MB, size) not in caps
    if size <= FEW_BUCKETS * GUIDE_CAPS_MB[0]:  # at least one cap makes FEW_BUCKETS buckets
        assert any(cap <= size / FEW_BUCKETS for cap in caps)
