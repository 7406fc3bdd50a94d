"""A run's checkpoints: the on-disk format and its reader (`format`, which never imports DeepSpeed: generation,
export and analytics open runs with it), and saving and resuming the training state through DeepSpeed's engine
(`save_resume`). Layout, hashes and the weights-only loading: docs/checkpoints.md."""
