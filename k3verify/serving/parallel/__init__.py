"""Tensor and expert parallel serving over torch.distributed (gloo on CPU, NCCL on GPU)."""

from k3verify.serving.parallel.comm import Comm, init_world, leave_world
from k3verify.serving.parallel.layout import LayoutError, ParallelLayout, check_layout, local_config, split_range
from k3verify.serving.parallel.model import ParallelServingModel

__all__ = ["Comm", "LayoutError", "ParallelLayout", "ParallelServingModel", "check_layout", "init_world",
           "leave_world", "local_config", "split_range"]
