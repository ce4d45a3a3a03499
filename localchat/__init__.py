"""localchat: chat with long documents on a local model, inside a fixed KV-cache budget."""

import os

__version__ = "0.1.0"

# OpenMP's threads sleep while they wait for a parallel region's others, rather than spin: with other work on the
# cores a spinning thread takes the slice the preempted one needs (on the 2-core test CPU with three busy processes
# beside it, decode fell from 48 to 0.4 tokens/s; with this, 14.1), for about 3 % on a quiet machine
# (bench/results/cpu-defaults-avx2/omp-wait.txt). Set before torch loads OpenMP; the user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
