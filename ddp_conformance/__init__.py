"""Both processes: ddp-conformance: checks that PyTorch DDP training is correct, on real process groups, under pytest.

Importing this package must stay cheap: the plugin is loaded into every pytest session of a user's
repo, so torch and lightning are imported only when a distributed test or the suite actually runs.
"""

__version__ = "0.1.0"
