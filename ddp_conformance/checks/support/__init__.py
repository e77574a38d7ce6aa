"""Both processes: what several checks use: the check context, the fit recorder, progress, comparisons and measurements.
A check imports from here; nothing here imports a check."""
