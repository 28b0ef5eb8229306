"""Keel's checkpoints. A single-file checkpoint is Lightning's dict: `state_dict` (keys `model.<param>`),
`optimizer_states`, `lr_schedulers`, `loops`, callback and data-module state, and Keel's payload under `keel`
(keel.checkpoint.payload: the run's config, tokenizer, last held-out loss and the shards' identity). A sharded
(FSDP) checkpoint is a directory written by torch.distributed.checkpoint: one `__<rank>_0.distcp` file per rank
holding its shards of the weights and optimizer state, `.metadata` (the global shapes and where each shard lies) and
Lightning's `meta.pt` (everything else, from rank 0, the payload included). A directory `keel export` wrote reads
back as a checkpoint of weights and payload only.

    payload       the payload type, and the one reader every consumer uses
    layout        where checkpoints lie (last.ckpt, a sharded checkpoint's files, staging names)
    safe          reading files without running code they carry (torch_load, refuse_payloads)
    read          read_checkpoint, the weights checked against the config, load_model
    exported      a directory `keel export` wrote, read back as a checkpoint (its parameter names, its payload)
    write         atomic writes (AtomicCheckpointIO, commit_dir, link_checkpoint)
    sharded       the FSDP strategy's sharded save and load, in the background too (AsyncShardedWriter)
    resume        which checkpoint `resume` names and every check that it can continue under a config
    consolidate   `keel consolidate SHARDED_DIR OUT.ckpt`
"""
