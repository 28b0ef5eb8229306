"""Lightning callbacks for Keel training: each owns one job and its metrics (tags: docs/tensorboard.md). The
configurable ones take their options from keel.config.callbacks; registry.py builds them by name."""
