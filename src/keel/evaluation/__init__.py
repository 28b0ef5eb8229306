"""Downstream evaluation: the lm-eval adapter, offline task suites, in-loop and after training.

Importing this package registers the lm-eval model `keel`, so that
`lm_eval.simple_evaluate(model="keel", model_args="checkpoint=PATH", task_manager=task_manager(...))` works.
"""

from keel.evaluation.lm import KeelEvalLM
from keel.evaluation.suite import TASKS_DIR, load_tasks, run_tasks, task_manager

__all__ = ["KeelEvalLM", "TASKS_DIR", "load_tasks", "run_tasks", "task_manager"]
