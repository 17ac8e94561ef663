"""ModelStep: one batch through the model. The forward, then the grammar masks, sampling and logprobs
(`TokenEmitter`) for the tasks at the end of their tokens; the scheduler records and publishes the outcome."""

from __future__ import annotations

import torch

from serve_app.engine.emitting import Emitted, TokenEmitter
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.scheduler import Batch, Scheduler
from serve_app.model.runner import ForwardBatch, ModelRunner
from serve_app.wire.outputs import CoreOutput


class ModelStep:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, grammars: GrammarCompiler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.emitter = TokenEmitter(grammars, scheduler.max_model_len)

    def run(self, batch: Batch) -> None:
        """One forward over `batch`, then sampling for the tasks at the end of their tokens (a task with
        proposals samples a row for each, and one more); an `embed` task at the end of its prompt gets its
        embedding instead."""
        sample_rows, sampled, first_rows, row = [], [], [], 0
        for entry, task in zip(batch.entries, batch.tasks):
            row += entry.num_new
            if entry.end >= task.num_tokens:
                first_rows.append(len(sample_rows))
                sample_rows.extend(range(row - 1 - len(task.drafts), row))
                sampled.append(task)
        token_ids = [
            token for entry, task in zip(batch.entries, batch.tasks) for token in task.tokens[entry.start : entry.end] + task.drafts
        ]
        slots = [task.adapter_slot for task in batch.tasks]
        cache = self.scheduler.cache
        forward = ForwardBatch(batch.entries, token_ids, sample_rows, slots)
        if any(task.output.embed for task in sampled):
            with self.runner.head_inputs() as hidden:
                logits = self.runner.forward(forward, cache.view(batch.entries))
        else:
            hidden, logits = [], self.runner.forward(forward, cache.view(batch.entries))
        self.scheduler.computed(batch)
        if not sampled:
            return
        generating = [i for i, task in enumerate(sampled) if not task.output.embed]
        emitted = self.emitter.emit(logits, [sampled[i] for i in generating], [first_rows[i] for i in generating])
        outcomes = dict(zip(generating, emitted))
        for i, task in enumerate(sampled):
            if task.output.embed:
                outcomes[i] = _embedded(hidden[0][0, first_rows[i]])
        self.scheduler.postprocess(sampled, [outcomes[i] for i in range(len(sampled))])


def _embedded(state: torch.Tensor) -> Emitted:
    """An embed task's outcome: its last prompt token's final hidden state, L2-normalized (vLLM's pooling of a decoder
    model: last token, normalized)."""
    vector = torch.nn.functional.normalize(state.float(), dim=-1)
    return Emitted(CoreOutput((), (), "stop", embedding=tuple(vector.tolist())), 0)
