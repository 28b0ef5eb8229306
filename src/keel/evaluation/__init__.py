"""Downstream evaluation: the lm-eval adapter, offline task suites, in-loop and after training."""
