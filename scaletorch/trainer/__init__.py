"""Config, training loop, checkpoints and the parity check shared by every script."""

from scaletorch.trainer.config import Config, load_config, parse_args, validate, validate_layout
from scaletorch.trainer.parity import (check_against_reference, max_weight_diff, report_norm_parity,
                                       report_parity, report_weight_parity, run_reference)
from scaletorch.trainer.plain_loop import plain_training
from scaletorch.trainer.trainer import Trainer, TrainResult, build_optimizer, start_run

__all__ = [
    "Config", "load_config", "parse_args", "validate", "validate_layout", "Trainer", "TrainResult",
    "build_optimizer", "start_run", "run_reference", "report_parity", "report_weight_parity",
    "report_norm_parity", "max_weight_diff", "check_against_reference", "plain_training"
]
