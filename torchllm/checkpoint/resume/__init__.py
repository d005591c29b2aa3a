"""This run's checkpoints, in the order a run meets them: the Checkpointer (checkpointer.py) that
composes them; writing a step (saver.py, with the local mirror for object storage: mirror.py);
which step resumes (loading.py) and restoring it into the states (restore.py: open, fit -- the
checks features register, fit.py -- read, apply; keeping or taking hyperparameters: hparams.py);
which steps are kept (retention.py); and how ranks agree on every one of those decisions
(agree.py). Everything here reads a step through checkpoint/step.py."""
