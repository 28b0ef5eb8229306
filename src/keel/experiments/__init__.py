"""The paper's experiments as commands: max tolerable LR, sweeps, layer redundancy."""
