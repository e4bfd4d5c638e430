"""trainvitals: PyTorch Lightning callbacks that read a training run's vital signs."""

from trainvitals.callbacks.grad_norm_early_stopping import GradNormEarlyStopping
from trainvitals.callbacks.grad_norm_monitor import GradNormMonitor

__all__ = ["GradNormEarlyStopping", "GradNormMonitor"]
__version__ = "0.1.0"
