"""Teachers outside the process: served (its wire formats), stored (its encodings), FP8."""
