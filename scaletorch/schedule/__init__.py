"""Pipeline schedules as plain data, no torch: stage placement, per-rank orders, simulators."""
