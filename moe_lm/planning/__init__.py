"""Planning a training layout on paper (`moe-lm estimate`): memory per GPU (memory.py) and what expert
parallelism sends within and across nodes (comm_plan.py)."""
