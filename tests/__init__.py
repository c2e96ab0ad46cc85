import os

# Idle OpenMP threads sleep instead of spinning. Ranks with two intra-op threads each (CI's
# `--bit-exact --threads 2`) are 16 threads on two cores in an 8-rank world; spinning, they took
# 323 s of wall time for what takes 84 s this way (tests.test_resume.InWorldResume). The policy
# is read when torch loads OpenMP, so it is set before any test imports torch; every rank and
# launched script inherits it. It changes who waits how, never which thread sums what.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Every test module imports the harness first: it fixes the thread counts the suite runs with.
from tests import harness  # noqa: E402,F401
