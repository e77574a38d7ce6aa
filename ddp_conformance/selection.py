"""Both processes: which checks a session runs: every check's id, the default set, and `--ddp-checks`.

Apart from `ddp_conformance.checks` so that the plugin validates the option at configure time without
importing the checks' package (its SPEC parsing brings asyncio into every pytest start).
"""

from __future__ import annotations

#: every check, in the order the suite runs them and the report shows them
CHECK_IDS: tuple[str, ...] = (
    "rank_participation",
    "sampler_disjointness",
    "data_consistency",
    "gradient_equivalence",
    "resume_fidelity",
    "bucket_view_memory",
    "sync_batchnorm",
    "mixed_precision",
    "initial_sync",
    "bucket_cap_mb_invariance",
    "static_graph",
    "uneven_inputs",
    "accumulation_equivalence",
    "elastic_resume",
    "nonfinite_loss",
    "compiled_model",
)

#: checks a session runs only when `--ddp-checks` names them, and why they are not in the default set
OPT_IN: dict[str, str] = {
    # DDP itself promises nothing here: an unguarded loop steps on a NaN on every rank at once, as the guides'
    # own loops and stock Lightning do, so in the default set it would fail nearly every trainer
    "nonfinite_loss": "judges a guard against a non-finite loss, which most trainers (stock Lightning's loop "
                      "included) do not have",
    # compiling costs seconds a trainer with a cold inductor cache on a CPU, up to half the demo transformer's whole
    # default suite (benchmarks/RESULTS.md, "The opt-in compiled_model check")
    "compiled_model": "compiles the model, which costs up to half again the default suite's time on a CPU",
}

#: the least timeout a check's test gets, whatever `--ddp-timeout` says: the time its scenario needs before a hang
#: can be told from it. compiled_model's first fit in a fresh environment compiles cold, which on a loaded CPU runs
#: past the 20 s the project's nested sessions give a test to catch hangs fast (benchmarks/RESULTS.md, "Figures the
#: code's design rests on"). elastic_resume waits up to 45 s for each of its two resized groups
#: before it calls one hung (`elastic_resume.GROUP_SECONDS`), and the verdict must come before the harness's timeout
LEAST_TIMEOUT: dict[str, float] = {"compiled_model": 120.0, "elastic_resume": 120.0}

DEFAULT_CHECKS: tuple[str, ...] = tuple(check for check in CHECK_IDS if check not in OPT_IN)
#: the words `--ddp-checks` takes besides check ids
GROUPS: dict[str, tuple[str, ...]] = {"default": DEFAULT_CHECKS, "all": CHECK_IDS}


def parse_checks(raw: str) -> tuple[str, ...]:
    """`--ddp-checks`' value: check ids and group words (`default`, `all`), comma-separated, as the checks in
    suite order. Raises ValueError naming the word it does not know."""
    chosen: set[str] = set()
    words = [word.strip() for word in raw.split(",") if word.strip()]
    if not words:
        raise ValueError(f"expected check ids or {', '.join(GROUPS)}, comma-separated, got {raw!r}")
    for word in words:
        if word in GROUPS:
            chosen.update(GROUPS[word])
        elif word in CHECK_IDS:
            chosen.add(word)
        else:
            raise ValueError(f"unknown check {word!r}; expected {', '.join(GROUPS)} or one of {', '.join(CHECK_IDS)}")
    return tuple(check for check in CHECK_IDS if check in chosen)
