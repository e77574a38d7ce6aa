"""A fit that cannot change the model is named by what was observed."""

from __future__ import annotations


def test_training_that_changes_nothing_is_named_by_what_was_observed():
    from ddp_conformance.checks.support.vacuity import vacuity_verdict

    def rank(grad_steps=4, nonzero=4, losses=(0.9, 0.7, 0.8, 0.6), changed=True):
        return {"grad_steps": grad_steps, "nonzero_grad_steps": nonzero, "losses": list(losses),
                "params_changed": changed}

    assert vacuity_verdict([rank(), rank()], "fit(4)") == ""
    assert vacuity_verdict([None, None], "fit(4)") == ""  # nothing observed: no claim
    zero = vacuity_verdict([rank(nonzero=0, losses=[0.0] * 4), rank(nonzero=0, losses=[0.0] * 4)], "fit(4)")
    assert zero.startswith("training does not change the model: every gradient is exactly zero at each of the 8 "
                           "optimizer steps of fit(4) on 2 ranks; every loss was exactly 0")
    # one rank with one nonzero gradient is training: no claim about "every gradient"
    assert "every gradient" not in vacuity_verdict([rank(nonzero=0), rank(nonzero=1)], "fit(4)")
    # gradients never seen (set to None before after_step): the parameters decide
    frozen = vacuity_verdict([rank(grad_steps=0, nonzero=0, changed=False)] * 2, "fit(4)")
    assert frozen.startswith("training does not change the model: the parameters after fit(4) are bitwise the "
                             "initial ones on 2 ranks")
    assert vacuity_verdict([rank(changed=None), rank(changed=False)], "fit(4)") == ""
    constant = vacuity_verdict([rank(losses=[2.5] * 4), rank(losses=[1.5] * 4)], "fit(4)")
    assert constant.startswith("the loss never changes: on each of 2 ranks, every micro-batch loss of fit(4) is one "
                               "constant (1.5, 2.5)")
    assert vacuity_verdict([rank(losses=[2.5])], "fit(1)") == ""  # one loss is no sequence
