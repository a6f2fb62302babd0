"""Pieces every rung shares: one home per concept (softmax, masking, TMA, the pipeline ring, ...)."""
