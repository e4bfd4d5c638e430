"""trainvitals: PyTorch Lightning callbacks that read a training run's vital signs.

The callbacks are imported on first use (PEP 562), so that ``trainvitals report`` and the torch-only math of
each feature folder do not pay for importing Lightning.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ActivationMonitor": "trainvitals.activations.monitor",
    "BandSchedule": "trainvitals.schedule.callback",
    "BatchVarianceProbe": "trainvitals.noise.probe",
    "GradNormEarlyStopping": "trainvitals.noise.stopper",
    "GradNormMonitor": "trainvitals.norms.monitor",
    "GraphIntegrityCallback": "trainvitals.integrity.callback",
    "LRScalingAdvisor": "trainvitals.lr_scaling.advisor",
    "MemoryTopologyProfiler": "trainvitals.memory.profiler",
    "TrainingGuard": "trainvitals.guard.callback",
    "TrainvitalsDashboard": "trainvitals.tensorboard.dashboard",
    "UpdateMonitor": "trainvitals.updates.monitor",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainvitals' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
