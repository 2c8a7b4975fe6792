"""The trainer on top of the engine: data, optimizer, LoRA, checkpoints, progress.

`oomb.train(config, callbacks=[...])` runs it: this package is callable, so that `oomb.train` names
both the trainer's modules (oomb.train.trainer, oomb.train.config, ...) and the function that runs
them, and `import oomb` stays light (the trainer is imported at the call).
"""
import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, config, callbacks=(), kernels=None) -> list[float]:
        """Train as `oomb train` does with `config` (an oomb.TrainConfig); returns the loss of
        every step. callbacks: oomb.Callback objects, called at the end of each logged step, after
        each evaluation and each checkpoint (oomb.train.callbacks); a hook returning True stops
        the run after that step, which then ends as a normal run does (checkpoint, export).
        kernels: the engine's oomb.KernelOptions."""
        from .trainer import train

        return train(config, kernels, callbacks)


sys.modules[__name__].__class__ = _CallablePackage
