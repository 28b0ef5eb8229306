"""Corpus -> tokenizer -> tokenized litdata shards, and the loaders that stream them into training.

    keel data [--config FILE] [--force] [key=value ...]

builds, under `data.dir` (a local path or an object-store URL litdata supports):

    tokenizer.json      the tokenizer the shards were encoded with (a BPE trained here, a given file, or a hub one)
    train/, val/        litdata token shards (TokensLoader layout): each document's ids followed by the EOS id
    val_docs.jsonl      the held-out documents' raw text, one {"id": ..., "text": ...} per line
    manifest.json       what was built from what; written last, so its presence marks a complete build

A document is held out for validation by a hash of its id and `data.seed`, so the split depends neither on the
reading order nor on how many documents there are. Documents are written in a seeded random order, so each chunk
is a uniform sample of the corpus, and training permutes each chunk's sequences in full: a batch is a random sample
of the training set, not a stretch of it. Training opens the shards through `open_dataset`, which checks them
against the config (and every chunk against its size and hash), and `KeelDataModule`.

    sources/        what a corpus is read from: one module per `data.source`, registered in sources/__init__.py
    tokenizer.py    training, loading and the EOS id of tokenizers
    shards.py       data.dir: its files, local or on an object store, and their checks
    preparation.py  `keel data`: the build (lock, staging, tokenizer, manifest) and its move into place
    spooling.py     its one pass over the source: the split, the spooled documents, their spans
    shard_writing.py  its worker processes encoding the spans into shards
    loading.py      training: open_dataset, token_loader, KeelDataModule

Nothing is imported here: `keel.config` imports `keel.data.sources` for the names of the sources, and the other
modules import `keel.config`. Import from the module that owns the thing.
"""
