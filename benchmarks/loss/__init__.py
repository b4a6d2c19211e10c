"""The fused losses alone: speed against their floor and the alternatives, where the time goes, probes."""
