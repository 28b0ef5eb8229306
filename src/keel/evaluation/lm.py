"""lm-eval adapter for KeelLM, registered as lm-eval model `keel`:

    lm_eval.simple_evaluate(model="keel", model_args="checkpoint=runs/default/checkpoints/last.ckpt", ...)
    KeelEvalLM(model=module.model, tokenizer_json=module.tokenizer_json)   # in memory, for in-loop evaluation

Requests are tokenized exactly as lm-eval's HF model does (TemplateLM: context and continuation encoded
together, trailing context whitespace moved to the continuation, EOS as the prefix of an empty context),
left-truncated to the model's seq_len. With distributed=True (in-loop evaluation on several processes) it reports the
process group's rank and world size, so that lm-eval's evaluate() gives each rank its share of the documents and
gathers the metrics on rank 0, and its ranks run their forwards in lockstep: as many on every rank, which a sharded
(FSDP) model needs, its forward gathering each block's parameters from every rank. A rank with fewer batches to score
runs idle forwards for the others' extra ones; generation steps every rank until every rank's request is done.
Otherwise (one process) it reports rank 0 of 1 and evaluates every request it is given.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer
from tqdm import tqdm

from keel.checkpoint.read import load_model
from keel.data.tokenizer import eos_id_of
from keel.decoding import stream
from keel.errors import ConfigError
from keel.model import KeelLM

log = logging.getLogger(__name__)


def _device(requested: str | None) -> torch.device:
    # A cuda device asked for where there is no GPU (`keel eval` itself passes --device cpu there, not lm-eval's
    # cuda:0): evaluated on the CPU, said.
    if requested and (not requested.startswith("cuda") or torch.cuda.is_available()):
        return torch.device(requested)
    if requested:
        log.warning("device %s is not available; evaluating on the CPU", requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@register_model("keel")
class KeelEvalLM(TemplateLM):
    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        model: KeelLM | None = None,
        tokenizer_json: str | None = None,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        device: str | None = None,
        max_gen_toks: int = 256,
        distributed: bool = False,
        share_documents: bool = True,
    ) -> None:
        """Either `checkpoint` (a single-file keel checkpoint, loaded onto `device`) or an in-memory `model`
        and `tokenizer_json` (evaluated where the model is). batch_size 'auto' = max_batch_size or 64.
        distributed: evaluate with every rank of the initialized process group, in lockstep, each rank a share of
        the documents; share_documents=False: each rank every document (still in lockstep), for fewer documents
        than ranks, which lm-eval cannot share (a rank without a document fails in it)."""
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise ConfigError("keel model: give either checkpoint=PATH or an in-memory model, not both")
        if checkpoint is not None:
            model, _, tokenizer_json = load_model(checkpoint, _device(device))
        if not tokenizer_json:
            raise ConfigError("keel model: no tokenizer (the checkpoint has no tokenizer_json)")
        self.model = model
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self._eot_token_id = eos_id_of(self.tokenizer)
        self._device = next(model.parameters()).device
        self._batch_size = int(batch_size) if str(batch_size).isdigit() else (max_batch_size or 64)
        self._max_gen_toks = int(max_gen_toks)
        self._lockstep = distributed and dist.is_initialized() and dist.get_world_size() > 1
        if self._lockstep and share_documents:
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # ------------------------------------------------------------------ lm-eval's collectives (world_size > 1 only)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return torch.stack(gathered)

    def gather_object(self, obj, dst: int = 0) -> list | None:
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    # ------------------------------------------------------------------ lockstep (distributed only)
    def _most(self, count: int) -> int:
        """The largest `count` of any rank: this rank's own unless in lockstep."""
        if not self._lockstep:
            return count
        most = torch.tensor(count, device=self._device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def _anyone(self, busy: bool) -> bool:
        """Whether any rank is still busy: this rank alone unless in lockstep."""
        return self._most(int(busy)) > 0

    def _idle_forward(self) -> None:
        """A forward whose output is not used, run where another rank runs one that this rank has no work for."""
        self.model(torch.full((1, 1), self.eot_token_id, dtype=torch.long, device=self._device))

    # ------------------------------------------------------------------ TemplateLM interface
    @property
    def eot_token_id(self) -> int:
        return self._eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.seq_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Training shards are encoded without special tokens (EOS only separates documents).
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict:
        """Recorded by lm-eval in the results' `config`."""
        return {"model_num_parameters": self.model.num_params(), "model_config": asdict(self.model.cfg)}

    @contextlib.contextmanager
    def _inference(self):
        # bf16 autocast on GPU (as in training); eager even if training compiled the blocks (compile_blocks
        # uses dynamic=False, and evaluation batches have a new shape almost every time: endless recompiles).
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self._device.type == "cuda")
        with torch.no_grad(), autocast, torch.compiler.set_stance("force_eager"):
            yield

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding yields the continuation) per request. A
        continuation longer than seq_len (where lm-eval's HF model gives up) is scored in seq_len-token
        pieces, each conditioned on the seq_len tokens before it."""
        pieces, owners = [], []
        for index, (_, context, continuation) in enumerate(requests):
            for start in range(0, len(continuation), self.max_length):
                pieces.append((context + continuation[:start], continuation[start : start + self.max_length]))
                owners.append(index)
        results = [(0.0, True)] * len(requests)
        for owner, (logprob, greedy) in zip(owners, self._score(pieces, disable_tqdm)):
            results[owner] = (results[owner][0] + logprob, results[owner][1] and greedy)
        for (request, _, _), answer in zip(requests, results):
            if request is not None:  # rolling windows have no request of their own
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def _score(self, pieces: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Batched (context, continuation <= seq_len) scoring: longest first (lm-eval's Collator), inputs
        left-truncated to seq_len and right-padded (causal attention never looks at the padding)."""
        collator = Collator(pieces, sort_fn=lambda piece: (-len(piece[0]) - len(piece[1]), tuple(piece[0] + piece[1])))
        chunks = list(collator.get_batched(n=self.batch_size))
        batches = self._most(len(chunks))  # before any forward: every rank's collectives in one order
        results = []
        progress = tqdm(total=len(pieces), desc="Running loglikelihood requests", disable=disable_tqdm)
        for chunk in chunks:
            windows = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in chunk]
            batch = torch.full((len(windows), max(map(len, windows))), self.eot_token_id, dtype=torch.long)
            for row, window in enumerate(windows):
                batch[row, : len(window)] = torch.tensor(window)
            with self._inference():
                logits = self.model(batch.to(self._device))
            for (_, continuation), window, row_logits in zip(chunk, windows, logits):
                # Logits at position t predict token t + 1: the continuation's are the last len(continuation).
                logprobs = row_logits[len(window) - len(continuation) : len(window)].float().log_softmax(-1)
                target = torch.tensor(continuation, device=logprobs.device)
                results.append(
                    (float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all()))
                )
            progress.update(len(chunk))
        progress.close()
        with self._inference():
            for _ in range(batches - len(chunks)):
                self._idle_forward()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in non-overlapping windows of seq_len tokens, EOS before the first."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if do_sample) continuation through keel.decoding.stream's KV cache, one request at a
        time (the model takes no padding mask), cut at the first stop sequence of the decoded text. In lockstep,
        every rank decodes as many requests, one step at a time, until every rank's request is done."""
        rounds = self._most(len(requests))
        results = []
        for index in tqdm(range(rounds), desc="Running generate_until requests", disable=disable_tqdm):
            if index >= len(requests):  # none left here: idle forwards while another rank decodes
                self._decode(None, 0, {})
                continue
            context, gen_kwargs = requests[index].args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            # A short-context model keeps at least half its window for the prompt.
            max_new = min(kwargs["max_gen_toks"], self.max_length // 2)
            tokens = self._decode(self.tok_encode(context) or [self.prefix_token_id], max_new, kwargs)
            text = postprocess_generated_text(self.tok_decode(tokens), kwargs["until"], None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    def _decode(self, ids: list[int] | None, max_new: int, kwargs: dict) -> list[int]:
        """Up to max_new tokens after ids, the last one EOS if decoding stopped there. One step, one forward; in
        lockstep, steps continue (idle forwards on a rank whose request is done, or that has none: ids None) until
        no rank is decoding, agreed on before each step."""
        steps = None
        if ids is not None and max_new > 0:
            steps = stream(
                self.model,
                torch.tensor([ids], device=self._device),
                max_new,
                temperature=kwargs.get("temperature", 1.0) if kwargs["do_sample"] else 0.0,
                top_k=kwargs.get("top_k"),
            )
        tokens = []
        with self._inference():
            while self._anyone(steps is not None):
                if steps is None:
                    self._idle_forward()
                    continue
                tokens.append(int(next(steps)[0]))
                if tokens[-1] == self.eot_token_id or len(tokens) == max_new:
                    steps = None
        return tokens
