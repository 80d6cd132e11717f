"""The shared training loop: config, parallelization, checkpoints, the Trainer and its callbacks.

    from dtrain.train import Trainer, TrainConfig, Callback

``Trainer`` (and torch with it) is imported on first use: the typed config is read by every entry
point's command-line check, which must not wait for torch.
"""

from dtrain.train.callbacks import Callback
from dtrain.train.config import STRATEGIES, TrainConfig

__all__ = ["Callback", "STRATEGIES", "TrainConfig", "Trainer"]


def __getattr__(name: str):
    if name == "Trainer":
        from dtrain.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
