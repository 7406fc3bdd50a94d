"""Training under DeepSpeed: the loop, evaluation, balancing, logging."""
