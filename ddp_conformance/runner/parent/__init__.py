"""The parent side of the runner: the pytest process that starts, feeds, watches and judges rank pools."""
