"""Distributed plumbing: start-up, the process-group manager, collectives and their ledger."""

from scaletorch.dist import comm, flight_recorder, functional
from scaletorch.dist.init import (DistributedEnv, destroy_distributed, init_distributed,
                                  meet_before_first_step, pick_device_and_backend, restart_count)
from scaletorch.dist.ledger import CommLedger, get_ledger, name_group
from scaletorch.dist.pg_manager import (ProcessGroupManager, RankGrid, destroy_pg_manager,
                                        get_pg_manager, init_pg_manager,
                                        init_pg_manager_from_config)

__all__ = [
    "comm", "flight_recorder", "functional", "DistributedEnv", "init_distributed",
    "destroy_distributed", "meet_before_first_step", "pick_device_and_backend", "restart_count",
    "CommLedger", "get_ledger", "name_group", "ProcessGroupManager", "RankGrid", "init_pg_manager",
    "init_pg_manager_from_config", "get_pg_manager", "destroy_pg_manager"
]
