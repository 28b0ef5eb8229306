"""`keel bench`: training throughput, peak memory, FLOP/s and MFU of several schemes side by side (docs/bench.md).

    keel bench [--schemes keel,preln] [--compile off,on] [--threads 1,2] [--loss-chunk 0,128] [--members 1,5]
               [--app [--loader-workers 0,1]] [--json FILE]

Rows, in tokens/s: `step`, the LightningModule's own training step on a fixed random batch (step.py); `app`, a short
real `keel pretrain` run; `loader`, the training loader alone. Every variant is warmed up (compile happens there),
its peak memory taken on one more step, then timed in interleaved rounds (variants.py). Figures are medians over
rounds; a ratio is the median of per-round ratios to a reference row (variants.reference). cli.py: the command line;
report.py: the table and the JSON.
"""
