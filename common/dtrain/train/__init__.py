"""The shared training loop: config, parallelization, checkpoints, the Trainer and its callbacks.

    from dtrain.train import Trainer, TrainConfig, Callback
"""
from dtrain.train.callbacks import Callback
from dtrain.train.config import STRATEGIES, TrainConfig
from dtrain.train.trainer import Trainer

__all__ = ["Callback", "STRATEGIES", "TrainConfig", "Trainer"]
