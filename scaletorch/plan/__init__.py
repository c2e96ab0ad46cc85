"""The layout planner: memory, traffic, bubble, FLOPs and step time of a layout, as formulas.

Pure Python, no process group (only the zero-bubble schedules' bubble and activations run
chapter 04's schedule code, which imports torch): ``model`` describes the network, ``layout``
the parallel layout, ``cluster`` the hardware; ``memory``, ``comm``, ``pipeline``, ``flops``
and ``time`` predict. tests/test_plan.py checks them against this repository's ledgers and against
published tables; doc/09_planning.md derives them.
"""
