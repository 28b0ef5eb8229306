"""`keel gpu-check [--device cuda|cpu] [--out DIR] [--sections ...] [data overrides]`: one command, a few minutes, to
know whether Keel's GPU path works on this machine and how fast it is (docs/bench.md, "GPU acceptance").

One module per section (bench, pretrain, paper: depth and paper, callbacks, multi, fsdp: fsdp and checkpoint,
precision), each a function (device, sizes, out[, data]) -> its JSON, with "ok"; common.py holds the sizes per device
type and the threshold rows; cli.py runs them, report.py prints the table. `--device cpu` runs the same checks at
tiny sizes (tests/test_gpu_check.py: the script cannot rot before a GPU is available). Writes DIR/gpu_check.json;
exit status 1 when any check failed. A threshold is printed with its figure, its bound and where the bound comes
from; one that only a GPU can measure is "skipped: cpu" on CPU.
"""
