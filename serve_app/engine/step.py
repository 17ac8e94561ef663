"""ModelStep: one batch through the model. The forward, then the grammar masks, sampling and logprobs
(`TokenEmitter`) for the tasks at the end of their tokens; the scheduler records and publishes the outcome."""

from __future__ import annotations

from serve_app.engine.emitting import TokenEmitter
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.scheduler import Batch, Scheduler
from serve_app.model.runner import ForwardBatch, ModelRunner


class ModelStep:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, grammars: GrammarCompiler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.emitter = TokenEmitter(grammars, runner.tokenizer.decode, scheduler.max_model_len)

    def run(self, batch: Batch) -> None:
        """One forward over `batch`, then sampling for the tasks at the end of their tokens (a task with
        proposals samples a row for each, and one more)."""
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
        logits = self.runner.forward(ForwardBatch(batch.entries, token_ids, sample_rows, slots), cache.view(batch.entries))
        self.scheduler.computed(batch)
        if sampled:
            self.scheduler.postprocess(sampled, self.emitter.emit(logits, sampled, first_rows))
