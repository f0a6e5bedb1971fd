"""One rank's part of a GPT in a pipeline: its chunks of contiguous blocks.

Virtual stage 0 starts with the token and position embeddings; the last
ends with the final norm, the projection to the vocabulary and the loss.
With tied embeddings (`tie_embeddings`, the default) the first and the
last stage both hold the token table, one copy each: the first looks
tokens up in it, the last projects onto it. The two copies start equal
and stay equal because each applies the sum of both gradients
(`tfgpt.parallel.pipeline_executor`), as one shared table would get.

Every rank builds the whole model from the run's seed, so each stage's
weights start as a one-process run's do. A model built unallocated
(`tfgpt.parallel.unallocated`, as the trainer builds it) gets memory
for this rank's stage alone: its blocks, the embeddings on the first
stage, the final norm, the head and the token table on the last; the
other stages' variables keep their shapes and no values. Only the
stage's variables get gradients and optimizer slots either way.

A model frozen with low-rank adapters (`tfgpt.models.adapters`) trains
each stage's adapters alone: its base weights, the token table included,
are held and read but neither differentiated nor updated.
"""

import numpy as np

from tfgpt.layers.segments import segment_positions
from tfgpt.parallel.pipeline_partition import partition_blocks
from tfgpt.parallel.unallocated import allocate
from tfgpt.training.train_step import cross_entropy


def block_flops_per_token(model, sequence_length):
    """Forward FLOPs per token of one block: its matmuls and attention's two products."""
    block = model.blocks[0]
    parameters = sum(int(np.prod(v.shape)) for v in block.trainable_variables)
    return 2 * parameters + 4 * sequence_length * model.hidden_dim


class PipelineStage:
    """The chunks of `model` that `rank` runs under `schedule`; allocates their variables.

    Args:
        model: a built `tfgpt.models.gpt.GPT`, allocated or not
            (`tfgpt.parallel.unallocated`).
        schedule: `tfgpt.parallel.pipeline_schedule.PipelineSchedule`.
        rank: int. This rank's place in the pipeline (0 to stages - 1).
        partition: str. `uniform` or `balanced`
            (`tfgpt.parallel.pipeline_partition`).
        sequence_length: int. For the `balanced` costs (attention's share).

    Attributes:
        ranges: per virtual stage, its `(start, end)` block range.
        chunks: this rank's virtual stages, in chunk order.
        trainable_variables: this rank's Keras variables, in model order.
        held_variables: every variable this rank holds up to date (its
            trainable ones and its layers' dropout states), allocated.
        tied: bool. Whether the first and last stage share the token table.
        trains_table: bool. Whether the shared table is trained (not under
            adapters): then both stages add each other's gradient of it.
    """

    def __init__(self, model, schedule, rank, partition="uniform", sequence_length=None):
        self.model = model
        self.schedule = schedule
        self.rank = rank
        self.last = schedule.num_virtual_stages - 1
        length = sequence_length or model.max_sequence_length
        head = 2 * model.vocabulary_size * model.hidden_dim
        self.ranges = partition_blocks(
            model.num_layers, schedule.num_virtual_stages, partition,
            block_cost=block_flops_per_token(model, length), first_cost=0.0, last_cost=head,
        )
        self.chunks = [schedule.virtual_stage(rank, chunk)
                       for chunk in range(schedule.virtual_stages)]
        self.tied = model.lm_head is None
        self.table = model.embeddings.token_embedding.embeddings
        self.trains_table = self.tied and self.table.trainable
        seen, variables = set(), []
        for stage in self.chunks:
            for variable in self.chunk_variables(stage):
                if id(variable) not in seen:
                    seen.add(id(variable))
                    variables.append(variable)
        order = {id(v): index for index, v in enumerate(self.model.trainable_variables)}
        self.trainable_variables = sorted(variables, key=lambda v: order[id(v)])
        self.held_variables = [v for chunk in self.chunks for v in self.owned_variables(chunk)]
        if self.tied and self.holds_last and not self.holds_first:
            self.held_variables.append(self.table)
        allocate(self.held_variables)

    @property
    def holds_first(self):
        return 0 in self.chunks

    @property
    def holds_last(self):
        return self.last in self.chunks

    def layers(self, stage):
        """The layers of virtual stage `stage`, in the order they run."""
        start, end = self.ranges[stage]
        layers = [self.model.embeddings] if stage == 0 else []
        layers += self.model.blocks[start:end]
        if stage == self.last:
            layers += [layer for layer in (self.model.final_norm, self.model.lm_head) if layer]
        return layers

    def chunk_variables(self, stage):
        """Trainable Keras variables of virtual stage `stage` (the last stage's
        include the tied token table it projects onto, unless it is frozen)."""
        variables = [v for layer in self.layers(stage) for v in layer.trainable_variables]
        if stage == self.last and self.trains_table and stage != 0:
            variables.append(self.table)
        return variables

    def forward(self, stage, inputs, targets=None, weights=None, segment_ids=None,
                training=True):
        """Runs virtual stage `stage`: hidden states (B, T, C) out, or the
        float32 mean loss on the last stage (with `targets`), weighted by
        `weights` (B, T) when given (`cross_entropy`).

        `inputs` are token ids (B, T) on stage 0, hidden states after.
        `segment_ids` (B, T), of packed rows, confine each example's
        attention to itself and start its positions at 0, on every stage
        (as `GPT.call` does).
        """
        start, end = self.ranges[stage]
        packed = {}
        if segment_ids is not None:
            packed = {"segment_ids": segment_ids,
                      "positions": segment_positions(segment_ids)}  # (B, T)
        x = inputs
        if stage == 0:
            x = self.model.embed(inputs, positions=packed.get("positions"),
                                 training=training)  # (B, T, C)
        for block in self.model.blocks[start:end]:
            x = block(x, training=training, **packed)
        if stage != self.last:
            return x
        if self.model.final_norm is not None:
            x = self.model.final_norm(x)
        # Under tensor parallelism the logits are this slice's part of the vocabulary.
        return cross_entropy(targets, self.model.logits(x), weights,
                             tensor_slice=self.model.tensor_slice)

    def owned_variables(self, stage):
        """Every variable (trainable or not: dropout's random state too) of
        virtual stage `stage`'s layers, the tied table with stage 0."""
        return [v for layer in self.layers(stage) for v in layer.variables]

    def describe(self):
        """One line: which blocks each virtual stage holds."""
        parts = []
        for stage, (start, end) in enumerate(self.ranges):
            extra = (["embeddings"] if stage == 0 else []) + (
                ["head"] if stage == self.last else [])
            parts.append(f"stage {stage} (pipeline rank {self.schedule.rank_of(stage)}): blocks "
                         f"{start}-{end - 1}" + (f" + {', '.join(extra)}" if extra else ""))
        return "; ".join(parts)
