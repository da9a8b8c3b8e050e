"""dflash_train: a threaded DFlash (block-diffusion speculative decoding) drafter trainer.

One Python thread per drafter replica, fed by target-model threads, with ``torch.compile``: it runs
unmodified on torchfix, with no locks or warm-up passes around compilation.

``python -m dflash_train --help`` for the command line; from Python::

    from dflash_train.config import TrainConfig
    from dflash_train.train import train

    result = train(TrainConfig(steps=20))

Importing this package does not import torch: ``__main__`` must be able to set ``TORCHFIX_DISABLE``
before torchfix and torch are imported.
"""
