"""This run's checkpoints, in the order a run meets them: the Checkpointer (checkpointer.py) that
composes them; writing a step (saver.py, with the local mirror for object storage: mirror.py);
which step loads (loading.py) and loading it into the states (restore.py, keeping or taking
hyperparameters: hparams.py); which steps are kept (retention.py); and how ranks agree on every
one of those decisions (agree.py). Everything here reads a step through checkpoint/step.py."""
