"""The adapter for `trainer.py`'s Trainer class: it checkpoints only at epoch ends, and says so.

    python -m pytest --pyargs ddp_conformance.suite        # pytest.ini names this adapter
"""

from pathlib import Path

from trainer import Trainer, make_dataset, make_loader, make_model

from ddp_conformance import TrainerAdapter


class EpochTrainer(TrainerAdapter):
    checkpoint_every = "epoch"  # snapshots are written at epoch ends only

    def make_dataset(self, size=None):
        return make_dataset(size or 64)

    def make_model(self):
        return make_model()

    def fit(self, steps, *, checkpoint_dir=None, checkpoint_at=None, observer=None, snapshot=None):
        loader = make_loader(make_dataset())
        snapshot = snapshot or Path(checkpoint_dir or self.ctx.workdir / f"fit-{self.ctx.rank}") / "snapshot.pt"
        epochs, every = -(-steps // len(loader)), (checkpoint_at or 0) // len(loader)
        Trainer(make_model(), loader, str(snapshot)).train(epochs, save_every=every)

    def resume(self, checkpoint, steps, *, observer=None):
        self.fit(steps, snapshot=checkpoint)
