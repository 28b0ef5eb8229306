"""Lightning callbacks for Keel training: each owns one job and its metrics (tags: docs/tensorboard.md). A
configurable one is its module here and its torch-free options in options/, which name it; keel.config finds the
options, keel.training builds each enabled callback from them. This package's own import stays torch-free."""
