"""The runner: everything that starts, feeds, watches and judges rank processes.

It knows nothing of checks or trainers and imports nothing above it; the conformance layer (the
package root's `adapter`, `checks/`, `trainers/`, `suite/`) runs on top of it as ordinary
distributed tests. A file's place says which process it runs in, as in pytest-xdist:

- `parent/`: the pytest process, which builds tasks, owns the rank pools and judges their answers;
- `rank/`: a rank process (and the fork server ranks are forked from), which runs one task at a time;
- `wire.py`: the types both sides share, the only module they both import besides `frames.py`;
- `controller.py`: the seam between pytest's hooks and a mode, with the mode's inputs;
- `launched.py`: the mode where torchrun started pytest once per rank, so pytest is itself a rank.

See docs/architecture.md for the path of one test through these modules.
"""
