"""nanoGPT's shape declared elastic: batches drawn with torch.randint over a token array, no DataLoader
(fixtures/mutants/script_reseeds_like_nanogpt.py): there are no sample indices to follow the global batches by."""

from pathlib import Path

from ddp_conformance.trainers.script_adapter import ScriptAdapter

SCRIPT = Path(__file__).resolve().parents[3] / "fixtures" / "mutants" / "script_reseeds_like_nanogpt.py"


class Trainer(ScriptAdapter):
    elastic = True

    def __init__(self) -> None:
        super().__init__(f"script:{SCRIPT} --out_dir={{checkpoint_dir}} --max_iters={{steps}} "
                         f"--eval_interval={{checkpoint_at:-100000}} | {SCRIPT} --out_dir={{checkpoint_dir}} "
                         "--max_iters={steps} --eval_interval=100000 --init_from=resume", SCRIPT.parent)
