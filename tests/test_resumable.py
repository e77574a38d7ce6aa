"""The public resume pieces on their own: `ResumableDataLoader` (torch only) and
`ddp_conformance.lightning.RNGStateCallback`. A Lightning resume is bitwise with both, and not
without either (in one process here; tests/trainers/test_references.py does it on 2 and 4 ranks)."""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddp_conformance.resumable
from ddp_conformance.resumable import ResumableDataLoader

DATA = TensorDataset(torch.arange(20), torch.randn(20, 4, generator=torch.Generator().manual_seed(0)))


def indices(batches) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


def test_a_mid_epoch_state_continues_with_the_next_batch_and_keeps_the_epoch_length():
    torch.manual_seed(1)
    loader = ResumableDataLoader(DATA, batch_size=3, shuffle=True)
    iterator = iter(loader)
    consumed = indices(next(iterator) for _ in range(3))
    rest = indices(iterator)
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 7)

    torch.manual_seed(1)
    again = ResumableDataLoader(DATA, batch_size=3, shuffle=True)
    iterator = iter(again)
    assert indices(next(iterator) for _ in range(3)) == consumed
    saved = again.state_dict()
    torch.manual_seed(99)  # a restarted process: another seed, the same checkpoint
    resumed = ResumableDataLoader(DATA, batch_size=3, shuffle=True)
    resumed.load_state_dict(saved)
    assert indices(resumed) == rest, "the resumed epoch reads the same shuffle from the next batch on"
    assert len(resumed) == 7


def test_a_finished_epoch_resumes_into_the_next_one_with_the_same_draws():
    torch.manual_seed(2)
    loader = ResumableDataLoader(DATA, batch_size=4, shuffle=True)
    first, second = indices(loader), indices(loader)
    assert first != second

    torch.manual_seed(2)
    before = ResumableDataLoader(DATA, batch_size=4, shuffle=True)
    assert indices(before) == first
    saved = before.state_dict()
    torch.manual_seed(7)
    after = ResumableDataLoader(DATA, batch_size=4, shuffle=True)
    after.load_state_dict(saved)
    assert indices(after) == second


def test_iterating_never_draws_from_the_global_rng():
    loader = ResumableDataLoader(DATA, batch_size=4, shuffle=True)
    before = torch.get_rng_state()
    list(loader)
    list(loader)
    assert torch.equal(before, torch.get_rng_state())


def test_a_given_generator_is_kept():
    generator = torch.Generator().manual_seed(5)
    assert ResumableDataLoader(DATA, batch_size=4, generator=generator).generator is generator


def test_the_lightning_module_is_import_light_and_exports_the_two_pieces():
    out = subprocess.run([sys.executable, "-c", "import sys, ddp_conformance; print('lightning' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    tree = ast.parse(Path(ddp_conformance.resumable.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.startswith(("lightning", "pytorch_lightning")) for name in imported), imported
    from ddp_conformance import lightning

    assert lightning.__all__ == ["RNGStateCallback", "ResumableDataLoader"]
    assert issubclass(lightning.ResumableDataLoader, ResumableDataLoader)


class Stream(torch.utils.data.IterableDataset):
    """Ten samples streamed in order, with no length (so Lightning cannot know where an epoch ends)."""

    def __iter__(self):
        return iter(range(10))


def test_over_an_unsized_stream_a_plain_loop_resumes_at_the_next_batch_and_a_finished_epoch_at_the_next_one():
    loader = ResumableDataLoader(Stream(), batch_size=2)
    batches = iter(loader)
    trained = [next(batches).tolist() for _ in range(2)]
    resumed = ResumableDataLoader(Stream(), batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert trained == [[0, 1], [2, 3]] and next(iter(resumed)).tolist() == [4, 5]
    assert len(list(loader)) == 5  # an epoch read to its end (Lightning's fetcher reads one past the last)
    finished = ResumableDataLoader(Stream(), batch_size=2)
    finished.load_state_dict(loader.state_dict())
    assert len(list(finished)) == 5  # the next epoch, whole: not its first five batches skipped


def test_under_lightning_the_batch_its_fit_loop_fetched_ahead_is_left_out_of_the_position():
    """Lightning's own fetcher, as its fit loop drives it: it reads an unsized loader one batch ahead
    (a guard on that private rule: a Lightning that stops doing so fails here), and the saved position
    counts the batches handed to training, so the resume trains the one fetched ahead."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from ddp_conformance.lightning import ResumableDataLoader as LightningLoader

    for dataset, ahead in ((Stream(), 1), (list(range(10)), 0)):
        loader = LightningLoader(dataset, batch_size=2)
        fetcher = _PrefetchDataFetcher()
        fetcher.setup(CombinedLoader(loader))
        iter(fetcher)
        trained = [next(fetcher)[0].tolist() for _ in range(2)]
        assert loader._position == 2 + ahead, "Lightning's fetcher reads ahead as ResumableDataLoader.read_ahead says"
        resumed = LightningLoader(dataset, batch_size=2)
        resumed.load_state_dict(loader.state_dict())
        assert trained == [[0, 1], [2, 3]] and next(iter(resumed)).tolist() == [4, 5]


# --- the RNG callback in a Lightning fit and resume (one process, Lightning's single-device path) ------


def _lightning_run(tmp_path, steps: int, *, rng_callback: bool, resumable: bool, save_at: int | None = None,
                   resume_from=None):
    import lightning.pytorch as pl

    from ddp_conformance.lightning import RNGStateCallback
    from ddp_conformance.trainers.lightning_ref import FIT_TAKES_WEIGHTS_ONLY

    class Dropout(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            _, x = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            cls = ResumableDataLoader if resumable else DataLoader
            return cls(DATA, batch_size=2, shuffle=True)

    pl.seed_everything(0, verbose=False)
    module = Dropout()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[RNGStateCallback()] if rng_callback else [])
    if resume_from is not None:
        torch.manual_seed(1234)  # the restarted process's RNG is not the checkpoint's
        np.random.seed(1234)
        random.seed(1234)
    trainer.fit(module, ckpt_path=resume_from, **({"weights_only": True} if FIT_TAKES_WEIGHTS_ONLY else {}))
    if save_at is not None:
        trainer.save_checkpoint(tmp_path / "mid.ckpt")
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(("rng_callback", "resumable", "bitwise"),
                         [(True, True, True), (False, True, False), (True, False, False)],
                         ids=["both-pieces", "no-rng-callback", "plain-dataloader"])
def test_a_lightning_resume_is_bitwise_with_both_pieces_and_only_then(tmp_path, rng_callback, resumable, bitwise):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = _lightning_run(tmp_path, 7, rng_callback=rng_callback, resumable=resumable)
        _lightning_run(tmp_path, 3, rng_callback=rng_callback, resumable=resumable, save_at=3)  # mid-epoch: 10/epoch
        resumed = _lightning_run(tmp_path, 7, rng_callback=rng_callback, resumable=resumable,
                                 resume_from=tmp_path / "mid.ckpt")
    same = all(torch.equal(full[k], resumed[k]) for k in full)
    assert same is bitwise
