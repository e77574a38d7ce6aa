"""The runner: everything that starts, feeds, watches and judges rank processes.

It knows nothing of checks or trainers; the conformance layer (the package root's `adapter`,
`checks/`, `trainers/`, `suite/`) runs on top of it as ordinary distributed tests. See
docs/architecture.md for the path of one test through these modules.
"""
