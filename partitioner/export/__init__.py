"""Plans for the engines users already run: torch.distributed.pipelining schedules, torchtitan configs, and back."""

from partitioner.export.from_torch import from_torch_schedule, read_torch_actions
from partitioner.export.split_points import SplitPoints, split_points
from partitioner.export.torch_schedule import TorchSchedule, to_torch_schedule
from partitioner.export.torch_stages import CarryStage, TorchStages, pipeline_stages, schedule_runtime
from partitioner.export.torchtitan import to_torchtitan, write_torchtitan

__all__ = [
    "CarryStage", "SplitPoints", "TorchSchedule", "TorchStages", "from_torch_schedule", "pipeline_stages",
    "read_torch_actions", "schedule_runtime", "split_points", "to_torch_schedule", "to_torchtitan",
    "write_torchtitan",
]
