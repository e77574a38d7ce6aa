"""The conformance suite, collected with no test file of the user's:

    python -m pytest --pyargs ddp_conformance.suite --ddp-trainer SPEC --ddp-world-size N

One test per trainer (`--ddp-trainer`, repeatable; default both references) per check `--ddp-checks`
selects (default: `ddp_conformance.selection.DEFAULT_CHECKS`), id `test_conformance[<trainer>-<check>]`.
"""
