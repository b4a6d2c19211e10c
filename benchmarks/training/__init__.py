"""Whole training steps: one GPU against the alternatives, long context, several GPUs, several teachers."""
