"""The example repo's adapter (examples/ci_gate), shown in docs/adapter.md, is the file the project runs,
and it gives the checks what they ask for."""

from __future__ import annotations

import re

import pytest

from ddp_conformance.adapter import RankContext

from .support import CONFIGS, ROOT, differences, run_config

EXAMPLE = ROOT / "examples" / "ci_gate"
SPEC = "examples/ci_gate/conformance_adapter.py:MyTrainer"


@pytest.mark.parametrize("doc", ["docs/adapter.md"])
def test_the_docs_show_the_example_files_verbatim(doc):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    for name in ("train.py", "conformance_adapter.py"):
        assert (EXAMPLE / name).read_text() in blocks, f"{doc} no longer shows {name} verbatim"


@pytest.mark.ddp(world_size=2)
def test_minimal_adapter_passes_what_the_checks_ask(ddp, tmp_path):
    import torch

    from ddp_conformance.trainers import resolve_spec

    ctx = RankContext.from_fixture(ddp, tmp_path)
    config = run_config(ctx, CONFIGS / "basic.yaml")
    factory = resolve_spec(SPEC, ROOT)

    def fresh():
        adapter = factory()
        adapter.setup(config, ctx)
        return adapter

    adapter = fresh()
    dataset = adapter.make_dataset()
    shards = [[i for b in adapter.make_loader(dataset, rank=r, world_size=2, epoch=0)
               for i in adapter.batch_indices(b)] for r in range(2)]
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) + len(shards[1]) == len(dataset)

    wrapped = adapter.wrap(adapter.make_model())
    assert wrapped.gradient_as_bucket_view  # the config's kwargs reach DDP
    adapter.train_step(wrapped, adapter.collate([dataset[i] for i in shards[ctx.rank][:4]]))
    assert all(p.grad is not None and p.grad._is_view() for p in wrapped.parameters())

    from ddp_conformance.checks.support.observe import FitRecorder, ObservedState

    def observed(call):  # as a check runs a fit: the adapter returns nothing, the hooks see it all
        with FitRecorder() as recorder:
            result = call()
        return ObservedState.of(result, recorder.record), recorder.record

    full, record = observed(lambda: fresh().fit(12))
    assert record.micro_batches == record.optimizer_steps == 12 and record.nonzero_grad_steps == 12
    observed(lambda: fresh().fit(5, checkpoint_dir=tmp_path, checkpoint_at=5))
    torch.manual_seed(123 + ctx.rank)
    resumed, _ = observed(lambda: fresh().resume(tmp_path / "step5.pt", 12))
    assert differences(full, resumed) == []
    initial = fresh().make_model().state_dict()
    assert any(not torch.equal(initial[k], full.params[k]) for k in initial)
