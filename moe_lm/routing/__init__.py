"""What the routers chose and the statistics of it, shared by training (moe_lm/train) and analysis (moe_lm/analysis)."""
