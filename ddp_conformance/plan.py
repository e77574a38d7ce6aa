"""Both processes: what the conformance suite trains, told before it trains: each check's fits, their optimizer
steps as a function of the trainer's epoch, and the fits checks share (run once per trainer, read by each).

Torch-free, like `selection`: a pytest plugin of its own, it prints the plan once the suite's tests are
collected, before the first fit (`pytest_collection_finish`): a summary, each check's fits under -v, nothing
under -q. The checks plan their long fit with `plan_steps` (`checks/support/shared_fit.py`), and
every fit a check runs is recorded under its figures' "fits" (`checks/support/progress.guarded_fit`):
tests/test_plan.py holds what the checks ran to what `CHECK_FITS` declares.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace

import pytest

from .options import settings_of
from .selection import CHECK_IDS

#: whole epochs of the training loader sampler_disjointness judges (epochs 0, 1 and 2)
WHOLE_EPOCHS = 3
#: the longest epoch, in optimizer steps, the shared fit trains whole (three of them and a step). A real
#: epoch is hundreds to thousands of steps: past this, what the suite trains stops following the epoch,
#: and the checks judge the first steps of it (`plan_steps`), saying what that leaves unjudged
LONG_EPOCH_STEPS = 24
#: optimizer steps of the dropout-free fit several checks share, and of each check's own short fits
STEADY_STEPS = 3
#: the steps a resume trains past its checkpoint where it need not reach an epoch end (`plan_steps`): every way a
#: resume loses state parts it from the uninterrupted run in the first step, and a position restored once but not
#: at the next epoch (where the resume crosses one) in the second
RESUMED_STEPS = 2


def plan_steps(epoch: int, cadence: int | str | None) -> tuple[int, int]:
    """(k, n): resume_fidelity's checkpoint step and final step. n is one step past sampler_disjointness's
    three whole epochs (3E + 1), so one fit serves both. The checkpoint lies past the first epoch, so a
    resume that restores the position but not the epoch shows, and the resumed part crosses an epoch
    boundary. Without a declared cadence k = 3E - 1, one batch before the third epoch's end: the resume
    trains that epoch's last batch and the next epoch's first, RESUMED_STEPS whatever the epoch's length
    (a resume that restores anything wrongly parts from the uninterrupted run in its first step; one that
    restores the position once but not at the next epoch, in its second). A trainer that checkpoints only
    at epoch ends (`checkpoint_every = "epoch"`) gets k = 2E, one that checkpoints every N steps the
    first multiple of N inside the second epoch or after it, and n at least k + E.

    An epoch longer than LONG_EPOCH_STEPS (`whole_epochs` False) is not trained whole: k is the first
    step the trainer can checkpoint at past LONG_EPOCH_STEPS (mid-way through the first epoch, without a
    cadence) and n = k + RESUMED_STEPS, so that the steps do not grow with the epoch; a trainer that
    checkpoints only at epoch ends still needs the first one (k = E). Within an epoch no epoch end is left to
    cross, so a longer resume would judge nothing more: the first step shows what the checkpoint lost."""
    if not whole_epochs(epoch):
        return _plan_within_an_epoch(epoch, cadence)
    last = WHOLE_EPOCHS * epoch + 1
    if cadence == "epoch":
        k = 2 * epoch
    elif isinstance(cadence, int) and cadence > 0:
        k = cadence * math.ceil((epoch + 1) / cadence)
    else:
        return last - RESUMED_STEPS, last
    return k, max(k + epoch + (epoch // 2 if cadence == "epoch" else 0), last)


def whole_epochs(epoch: int) -> bool:
    """Whether the shared fit trains whole epochs of `epoch` steps (`plan_steps`)."""
    return epoch <= LONG_EPOCH_STEPS


def _plan_within_an_epoch(epoch: int, cadence: int | str | None) -> tuple[int, int]:
    if cadence == "epoch":
        k = epoch
    elif isinstance(cadence, int) and cadence > 0:
        k = cadence * math.ceil((LONG_EPOCH_STEPS + 1) / cadence)
    else:
        k = LONG_EPOCH_STEPS + 1
    return k, k + RESUMED_STEPS


def longest_planned_fit(cadence: int | str | None = None) -> int | None:
    """The most steps n reaches over every epoch length, for a trainer with this checkpoint cadence; None where
    it grows with the epoch (a trainer that checkpoints only at epoch ends)."""
    if cadence == "epoch":
        return None
    return max(plan_steps(epoch, cadence)[1] for epoch in range(1, LONG_EPOCH_STEPS + 2))


@dataclass(frozen=True)
class PlannedFit:
    """One fit a check runs: its label (as its progress line and its figures name it; `*` stands for a
    variant's part, as in "bucket-cap-*"), its optimizer steps (a number, or "k", "n", "n-k" of
    `plan_steps`), whether checks share it, and when the check runs it ("" for always)."""

    label: str
    steps: int | str
    shared: bool = False
    when: str = ""
    most: int = 1  # how many fits of this label the check may run (its variants)
    needed: bool = True  # False: past --ddp-max-steps the check goes without it, saying so, instead of skipping

    def count(self, epoch: int, cadence: int | str | None) -> int:
        """Optimizer steps this fit trains for an epoch of `epoch` steps."""
        if isinstance(self.steps, int):
            return self.steps
        k, n = plan_steps(epoch, cadence)
        return {"k": k, "n": n, "n-k": n - k}[self.steps]

    def matches(self, label: str) -> bool:
        return fnmatch.fnmatchcase(label, self.label)

    def describe(self) -> str:
        steps = f"{self.steps} step" + ("" if self.steps == 1 else "s")
        shared = ", shared" if self.shared else ""
        times = f", up to {self.most} of them" if self.most > 1 else ""
        when = f" ({self.when})" if self.when else ""
        return f"{self.label} {steps}{shared}{times}{when}"


PROBE = PlannedFit("probe", 1, shared=True)
STEADY = PlannedFit("steady", STEADY_STEPS, shared=True)
UNINTERRUPTED = PlannedFit("uninterrupted", "n", shared=True)
#: `checks/support/reproducible.py`: the steady fit again, where a changed setting's fit parts from it
REPEAT = PlannedFit("steady-repeat", STEADY_STEPS, when="where the fits compared part")

#: every fit each check may run, shared ones included
CHECK_FITS: dict[str, tuple[PlannedFit, ...]] = {
    "rank_participation": (replace(STEADY, when="a config without dropout"),
                           PlannedFit("fit", STEADY_STEPS, when="a config with dropout"),
                           PROBE, replace(UNINTERRUPTED, when="watched for hangs through an epoch end",
                                          needed=False)),
    "sampler_disjointness": (PROBE, UNINTERRUPTED),
    "data_consistency": (PlannedFit("data", 1, when="a trainer that builds no dataset outside its fit"),),
    "gradient_equivalence": (STEADY, PlannedFit("script_step", 1, when="a script")),
    "resume_fidelity": (PROBE, UNINTERRUPTED,
                        PlannedFit("until-checkpoint", "k", when="a trainer that may checkpoint again after k"),
                        PlannedFit("resumed", "n-k"),
                        PlannedFit("resumed-same-rng", "n-k", when="where the resume parts: again from the RNG the "
                                                                    "checkpoint left")),
    "bucket_view_memory": (PROBE, PlannedFit("fit-setting", STEADY_STEPS, when="a trainer without make_model"),
                           PlannedFit("memory-*", STEADY_STEPS, most=7,
                                      when="a trainer without make_model, with gradients large enough to measure")),
    "sync_batchnorm": (PROBE,),
    "mixed_precision": (STEADY, PlannedFit("mixed", 1, when="a config that claims a mixed precision"),
                        PlannedFit("fp32", 1, when="a config that claims a mixed precision"), REPEAT),
    "initial_sync": (PROBE,),
    "bucket_cap_mb_invariance": (STEADY, PlannedFit("bucket-cap-*", STEADY_STEPS, most=3), REPEAT),
    "static_graph": (STEADY, PlannedFit("static-graph-flipped", STEADY_STEPS,
                                        when="static_graph set, or --ddp-advise"), REPEAT),
    "uneven_inputs": (PROBE, PlannedFit("uneven", STEADY_STEPS, when="a fit inside DDP's join")),
    "accumulation_equivalence": (STEADY, PlannedFit("accumulation_window", 1, when="a script")),
    "elastic_resume": (PROBE, PlannedFit("elastic-checkpoint", "k", when="a trainer that may checkpoint again "
                                                                        "after k"),
                       PlannedFit("elastic-uninterrupted", "n")),
    "nonfinite_loss": (PlannedFit("nonfinite", STEADY_STEPS),),
    "compiled_model": (STEADY, PlannedFit("eager", STEADY_STEPS, when="a model with dropout, or compiled by the "
                                                                      "trainer"),
                       PlannedFit("compiled", STEADY_STEPS), REPEAT,
                       PlannedFit("eager-repeat", STEADY_STEPS, when="where the fits compared part")),
}


def planned(check: str, label: str) -> PlannedFit | None:
    """The fit of `check` a run's fit labelled `label` is, or None where the check declares none such."""
    return next((fit for fit in CHECK_FITS[check] if fit.matches(label)), None)


def most_steps(check: str, cadence: int | str | None = None) -> int | None:
    """The most optimizer steps one fit `check` needs trains, over every epoch length; None where that grows with
    the epoch."""
    longest = longest_planned_fit(cadence)
    counts = [fit.steps if isinstance(fit.steps, int) else longest for fit in CHECK_FITS[check] if fit.needed]
    return None if None in counts else max(counts)  # type: ignore[type-var]


def header_lines(checks: tuple[str, ...], trainers: int, world_size: int, max_steps: int | None,
                 verbose: bool) -> list[str]:
    """The plan as pytest's header shows it: a summary; with `verbose`, each check's fits."""
    shared = sorted({fit.label for check in checks for fit in CHECK_FITS[check] if fit.shared},
                    key=["probe", "steady", "uninterrupted"].index)
    longest = longest_planned_fit()
    lines = [f"ddp-conformance plan: {len(checks)} checks x {trainers} trainer(s) at world size {world_size}; "
             f"fits checks share run once per trainer ({', '.join(shared) or 'none'}); the longest fit trains "
             f"at most {longest} optimizer steps whatever the epoch's length (at most the epoch and "
             f"{RESUMED_STEPS} more for a trainer that checkpoints only at epoch ends)"]
    if max_steps is not None:
        over = [check for check in checks if (most_steps(check) or math.inf) > max_steps]
        lines.append(f"  --ddp-max-steps {max_steps}: " + (f"{', '.join(over)} skip where a fit needs more"
                                                              if over else "every fit of the plan fits"))
    if not verbose:
        return [*lines, "  (-v lists each check's fits)"] if checks else lines
    lines.append(f"  E: the epoch in optimizer steps (the probe measures it); k, n: the checkpoint and last step of "
                 f"the long fit: k = 3E - 1 and n = 3E + 1 up to E = {LONG_EPOCH_STEPS}, past it "
                 f"k = {LONG_EPOCH_STEPS + 1} and n = k + {RESUMED_STEPS} (a checkpoint cadence moves k)")
    width = max(map(len, checks), default=0)
    lines += [f"  {check:<{width}}  " + "; ".join(fit.describe() for fit in CHECK_FITS[check]) for check in checks]
    return lines


def pytest_collection_finish(session: pytest.Session) -> None:
    """The plan of the collected conformance tests, on the terminal before the first of them runs."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if config.option.collectonly or hasattr(config, "workerinput") or reporter is None:
        return  # an xdist worker's terminal is not the user's
    cases = [item.callspec.params for item in session.items
             if item.name.startswith("test_conformance[") and hasattr(item, "callspec")]
    verbosity = config.get_verbosity()
    if not cases or verbosity < 0:
        return
    settings = settings_of(config)
    chosen = {case["check"] for case in cases}
    checks = tuple(check for check in CHECK_IDS if check in chosen)
    lines = header_lines(checks, len({case["trainer"] for case in cases}), settings.world_size, settings.max_steps,
                         verbose=verbosity > 0)
    reporter.ensure_newline()
    for line in lines:
        reporter.write_line(line)
