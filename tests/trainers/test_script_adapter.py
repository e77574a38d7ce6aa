"""script: SPECs: every fit runs in a directory of its own, so a script that resumes from whatever
checkpoint it finds at its path (torchrun's restart pattern) never resumes another fit's."""

from __future__ import annotations

import textwrap

import pytest

from ddp_conformance.adapter import NotProvided, RankContext
from ddp_conformance.config import RunConfig
from ddp_conformance.trainers.script_adapter import ScriptAdapter

# resumes when its checkpoint exists, as pytorch/examples' multigpu_torchrun.py does: exit 3 says it
# found one from before it started
RESUMES_IF_FOUND = """
    import sys
    from pathlib import Path

    snapshot = Path(sys.argv[1]) / "snapshot.pt"
    if snapshot.exists():
        sys.exit(3)
    snapshot.write_text("step 1")
"""


def test_each_fit_gets_a_directory_no_other_fit_used(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RESUMES_IF_FOUND))
    ctx = RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu", workdir=tmp_path / "work")
    for _ in range(3):  # a check builds a fresh adapter for each fit (probe, uninterrupted, ...)
        adapter = ScriptAdapter("script:train.py {checkpoint_dir}", tmp_path)
        adapter.setup(RunConfig(), ctx)
        adapter.fit(1)
    assert len(list((tmp_path / "work" / "script-fits").iterdir())) == 3


def test_without_a_resume_line_a_checkpointing_fit_is_not_provided(tmp_path):
    """resume_fidelity's fit to the checkpoint step skips naming the missing resume line, rather than
    failing because a script with nothing to resume from wrote no checkpoint."""
    script = tmp_path / "train.py"
    script.write_text("")
    ctx = RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu", workdir=tmp_path / "work")
    adapter = ScriptAdapter("script:train.py --steps {steps}", tmp_path)
    adapter.setup(RunConfig(), ctx)
    adapter.fit(2)  # a plain fit runs
    with pytest.raises(NotProvided, match="has no resume command line"):
        adapter.fit(2, checkpoint_dir=tmp_path / "ckpt", checkpoint_at=2)


# resumes from the path it is given and saves back to it, as aws-samples' cpu-ddp/ddp.py does
SAVES_WHERE_IT_RESUMED = """
    import sys
    from pathlib import Path

    snapshot = Path(sys.argv[1])
    print(snapshot.read_text(), file=open(Path(sys.argv[2]), "a"))
    snapshot.write_text("overwritten by a resume")
"""


def test_every_resume_reads_the_checkpoint_as_the_fit_wrote_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SAVES_WHERE_IT_RESUMED))
    (tmp_path / "ckpt").mkdir()
    checkpoint = tmp_path / "ckpt" / "snapshot.pt"
    checkpoint.write_text("as written at step 2")
    ctx = RankContext(rank=0, local_rank=0, world_size=1, backend="gloo", device="cpu", workdir=tmp_path / "work")
    adapter = ScriptAdapter(f"script:train.py --steps {{steps}} | train.py {{checkpoint}} {tmp_path / 'seen.txt'}",
                            tmp_path)
    adapter.setup(RunConfig(), ctx)
    for _ in range(2):  # resume_fidelity resumes one checkpoint twice (as is, then with the RNG restored)
        adapter.resume(checkpoint, 4)
    assert (tmp_path / "seen.txt").read_text().splitlines() == ["as written at step 2"] * 2
    assert checkpoint.read_text() == "as written at step 2"
