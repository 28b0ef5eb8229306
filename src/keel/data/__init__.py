"""Corpus -> tokenizer -> tokenized litdata shards (`keel data`), and the loaders that stream them into training.

`keel data` builds under `data.dir` (local or an object store): tokenizer.json, train/ and val/ shards, the held-out
documents (val_docs.jsonl) and manifest.json, written last. Documents are held out by a hash of their id and
data.seed, written in a seeded random order, and training permutes each chunk in full (docs/data.md).

    sources/  one module per `data.source`       tokenizer.py   training and loading tokenizers
    shards.py  data.dir's files and checks       preparation.py, spooling.py, shard_writing.py   the build
    loading.py  open_dataset, token_loader, KeelDataModule

Nothing is imported here: import from the module that owns the thing.
"""
