"""`python -m keel.gpu_check OVERRIDES`: `keel pretrain` with the host-sync guard, as the fsdp and checkpoint
sections run it (keel.gpu_check.fsdp.guarded_pretrain)."""

import sys

from keel.gpu_check.fsdp import guarded_pretrain

if __name__ == "__main__":  # not when imported (tests/test_imports.py imports every module)
    sys.exit(guarded_pretrain(sys.argv[1:]))
