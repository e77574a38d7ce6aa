"""The rank side of the runner: what runs inside a rank process (and the fork server ranks come from)."""
