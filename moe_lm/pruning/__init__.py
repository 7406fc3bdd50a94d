"""Expert pruning (`moe-lm prune`): score each MoE layer's routed experts on calibration documents (criteria.py),
keep the best of each group (plan.py), and write the model with only those (pruned.py, run.py). Removing an expert
means its router score is masked before selection, group scores included (masked.py): the pruned model's logits are
the unpruned model's under that mask. docs/pruning.md."""
