# Every test module imports the harness first: it fixes the thread counts the suite runs with.
from tests import harness  # noqa: F401
