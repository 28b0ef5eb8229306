"""What other libraries print that a Keel user can do nothing about, kept off the console: each entry matched by
its text (and, for a warning, its category), never a whole logger or every warning, and each with the reason it is
noise here. keel.training.train installs them in every process of a run; tests/test_console.py runs `keel pretrain`
and `keel data` and fails on any of them (and on the other noise fixed where it is printed)."""

from __future__ import annotations

import logging
import re
import warnings

# (start of the warning's message, its category or a base class of it, why it is noise here)
WARNINGS = [
    (
        "`isinstance(treespec, LeafSpec)` is deprecated",
        FutureWarning,
        "torch deprecating LeafSpec, said from inside Lightning's own _pytree helper: a Lightning release fixes it",
    ),
    (
        "Your `IterableDataset` has `__len__` defined",
        UserWarning,
        "litdata's StreamingDataset deals its chunks out among the loader workers itself, so its length holds",
    ),
    (
        "It is recommended to use `self.log('val/",
        UserWarning,  # Lightning's PossibleUserWarning
        "val/loss and val/ppl come from torchmetrics sums whose compute() has already reduced them over the ranks",
    ),
    (
        "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided",
        UserWarning,
        "a resume with a callback turned off (e.g. eval.enabled=false): keel's resume line lists it among the changed "
        "settings, and the callback's saved state is left unused",
    ),
]

# logger -> (text in the record's message, why it is noise here)
LOG_RECORDS = {
    "lightning.pytorch.utilities.rank_zero": [  # Lightning's rank_zero_info lines
        (
            "GPU available: ",
            "the start-up summary's hardware line says what the run uses (Lightning still warns "
            "when a GPU is there and not used)",
        ),
        ("TPU available: ", "as GPU available"),
        ("💡 Tip: ", "an advertisement for Lightning's cloud logger"),
        ("`Trainer(limit_val_batches=1)` was configured", "Lightning's words for the trainer.val_batches=1 asked for"),
        ("distributed_backend=", "a banner of the backend and world size the summary already gave"),
        ("`Trainer.fit` stopped: ", "keel's own last line says where the run ended (keel.summary.run_result)"),
        ("Restoring states from the checkpoint path at ", "the start-up summary's start line names the checkpoint"),
        ("Restored all states from the checkpoint at ", "as Restoring states"),
    ],
    "lightning.fabric.utilities.distributed": [
        ("Initializing distributed: ", "one line per process; the summary gives the world size"),
    ],
    "torch.utils.cpp_extension": [  # said as torch.compile starts, where a CUDA toolkit is installed
        ("No CUDA runtime is found", "a CPU run's compile does not use the CUDA toolkit it found"),
    ],
}


class DropMessages(logging.Filter):
    """A logger's filter that drops the records whose message contains one of `texts`."""

    def __init__(self, *texts: str) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


_LOG_FILTERS = {name: DropMessages(*(text for text, _ in records)) for name, records in LOG_RECORDS.items()}


def quiet_libraries() -> None:
    """Install the filters above in this process (again: no-op)."""
    for message, category, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name, drop in _LOG_FILTERS.items():
        logging.getLogger(name).addFilter(drop)  # a filter already there is not added twice
