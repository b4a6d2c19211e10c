"""On-policy distillation: rollouts, the Trainer's generated steps, an engine's rollouts."""
