"""A rank's handle (parent/process.py), tested without processes."""

from __future__ import annotations

from pathlib import Path


def test_a_huge_rank_log_is_read_by_its_head_and_tail(tmp_path: Path) -> None:
    from ddp_conformance.runner.parent.process import OUTPUT_KEEP_BYTES, OUTPUT_READ_BYTES, RankProcess

    log = tmp_path / "rank0.log"
    log.write_bytes(b"old\n" + b"h" * OUTPUT_KEEP_BYTES + b"x" * OUTPUT_READ_BYTES + b"t" * OUTPUT_KEEP_BYTES)
    proc = RankProcess(0, None, log, tmp_path / "stack", None)  # type: ignore[arg-type]
    text = proc.output_since(4)
    assert text == "h" * OUTPUT_KEEP_BYTES + f"\n... {OUTPUT_READ_BYTES} bytes cut ...\n" + "t" * OUTPUT_KEEP_BYTES
    assert proc.output_since(log.stat().st_size - 3) == "ttt"
