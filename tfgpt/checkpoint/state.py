"""What one rank holds of a run's state, each part named as the checkpoint names it.

A part (`Entry`) is a variable of this rank and the region of a global
tensor it holds: the key is the variable's path in the whole model, with
the model's own name left out and a layer it holds named by its attribute
(`backbone/`), so that the key does not depend on the names Keras gives
models in a process (a second GPT is `gpt_1`, a backbone
`bert_backbone`); `/momentum` or `/velocity` after it for the optimizer's
moments, `optimizer/...` for the optimizer's own counters,
`step` and `data_cursor` for the run's. The region follows from the
layout: a tensor slice (`tfgpt.parallel.tensor_parallel` split rules),
a ZeRO shard's rows (`tfgpt.parallel.zero`), the blocks of a pipeline
stage. Of the ranks that hold one region alike, one writes it: the first
data replica, the first tensor slice for what is not split, the stage that
trains a variable (the first stage for a tied token table).
"""

import dataclasses

import keras

from tfgpt.parallel.tensor_parallel import WHOLE, split_rules, split_seed_states
from tfgpt.parallel.unallocated import allocated
from tfgpt.parallel.zero import replicated_optimizer_variables, slot_variables


@dataclasses.dataclass
class Entry:
    """One variable of this rank, as a region of a global tensor.

    Args:
        key: str. The global tensor's name.
        variable: the Keras or tf.Variable holding this rank's region.
        shape: tuple. The global tensor's shape.
        split: `(axis, groups)` of a tensor-parallel variable, or None.
        tensor: `(T, index)`: which tensor slice it holds, or None (whole).
        rows: `(start, stop, rows)`: rows of the slice (a ZeRO shard), or None.
        writes: bool. Whether this rank writes it.
        per_rank: bool. A per-rank object (a dropout generator's state): saved
            with this rank's coordinates, not resliced.
        seed_offset: a per-rank object of a split region read from another
            layout gets this tensor slice's offset (`TensorSlice.offset_seed`).
    """

    key: str
    variable: object
    shape: tuple
    split: tuple = None
    tensor: tuple = None
    rows: tuple = None
    writes: bool = True
    per_rank: bool = False
    seed_offset: object = None

    def record(self, rank, coordinates):
        """What the index says of this rank's copy."""
        region = ({"rank": rank, "coordinates": list(coordinates)} if self.per_rank else
                  {"split": self.split and list(self.split), "tensor": self.tensor and
                   list(self.tensor), "rows": self.rows and list(self.rows)})
        return dict(region, key=self.key, shape=list(self.shape), dtype=dtype_name(self.variable))


def dtype_name(variable):
    dtype = variable.dtype
    return dtype if isinstance(dtype, str) else dtype.name


def key_names(root):
    """`{first path component: what the key says instead}` for the model `root`."""
    names = {root.name: ""}
    for attribute, value in vars(root).items():
        if isinstance(value, keras.layers.Layer) and not attribute.startswith("_"):
            names.setdefault(value.name, attribute + "/")
    return names


def relative_key(variable, names):
    """The key of `variable` in the model whose `key_names` are `names`."""
    first, _, rest = variable.path.partition("/")
    return names.get(first, first + "/") + rest if rest else variable.path


def seed_keys(root):
    """`[(key, state)]` of the dropouts' random states in `root`, each named by
    the attributes that lead to its layer (`rng/blocks/0/attention/dropout`:
    Keras numbers seed generators across a process, and a dropout layer
    has no path of its own)."""
    paths = {}

    def visit(layer, prefix):  # depth first, attribute by attribute, lists item by item
        for attribute, value in vars(layer).items():
            items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for index, child in ([] if attribute.startswith("_") else items):
                name = prefix + attribute + ("" if index is None else f"/{index}")
                if isinstance(child, keras.layers.Layer) and id(child) not in paths:
                    paths[id(child)] = name
                    visit(child, name + "/")

    visit(root, "")
    layers = [layer for layer in root.sublayers()
              if getattr(layer, "seed_generator", None) is not None]
    return [("rng/" + paths.get(id(layer), f"#{index}"), layer.seed_generator.state)
            for index, layer in enumerate(layers)]


def model_entries(model, prefix=""):
    """The whole `model`'s weights (no dropout states), for one process to load."""
    names = key_names(model)
    seeds = {id(state) for _, state in seed_keys(model)}
    return [Entry(prefix + relative_key(v, names), v, tuple(v.shape)) for v in model.variables
            if id(v) not in seeds]


def run_entries(model, optimizer, coordinates, sharding, *, tensor_slice=WHOLE, stage=None,
                counters=()):
    """Every part of a run's state that this rank holds, with who writes it.

    Args:
        model: the whole model (of this tensor slice).
        optimizer: built on what `sharding` updates.
        coordinates: `(data index, pipeline stage, tensor index)` of this rank.
        sharding: `ZeroSharding` or `Unsharded` (`tfgpt.parallel.zero`) of
            what this rank trains.
        tensor_slice: `TensorSlice` of the model (`WHOLE`: not split).
        stage: `PipelineStage`, or None.
        counters: `[(key, variable)]` of what the chief writes alone (the step).
    """
    data_index, _, tensor_index = coordinates
    chief = tuple(coordinates) == (0, 0, 0)
    rules = split_rules(model)
    trained = sharding.variables

    def region(variable):
        rule = rules.get(id(variable))
        if rule is None:
            return tuple(variable.shape), None, None
        shape = list(variable.shape)
        shape[rule[0]] *= tensor_slice.size
        return tuple(shape), tuple(rule), (tensor_slice.size, tensor_slice.index)

    def stage_writes(variable):  # the stage that writes it (the tied table: the first stage)
        return stage is None or not (stage.tied and variable is stage.table
                                     and not stage.holds_first)

    entries, names = [], key_names(model)
    slots = slot_variables(optimizer)
    for index, variable in enumerate(trained):
        shape, split, tensor = region(variable)
        holder, rows, writes = sharding.held(index, data_index)
        writes = writes and stage_writes(variable) and (split is not None or tensor_index == 0)
        key = relative_key(variable, names)
        entries.append(Entry(key, holder, shape, split, tensor, rows, writes))
        entries += [Entry(f"{key}/{name}", moments[index], shape, split, tensor, rows, writes)
                    for name, moments in slots.items() if moments]
    inner = getattr(optimizer, "inner_optimizer", None)
    inside = {id(v) for v in inner.variables} if inner is not None else set()
    for variable in replicated_optimizer_variables(optimizer):
        path = ("inner/" if id(variable) in inside else "") + variable.name
        entries.append(Entry(f"optimizer/{path}", variable, tuple(variable.shape), writes=chief))
    entries += [Entry(key, variable, tuple(variable.shape), writes=chief)
                for key, variable in counters]

    # The rest of what this rank holds (a pipeline rank: its stage alone):
    # the dropout states, one per rank, and what is not trained.
    split_seeds = {id(state) for state in split_seed_states(model)}
    held = None if stage is None else {id(v) for v in stage.held_variables}
    seeds = [(key, state) for key, state in seed_keys(model) if allocated(state)]
    for key, state in seeds:
        entries.append(Entry(key, state, tuple(state.shape), per_rank=True,
                             writes=held is None or id(state) in held,
                             seed_offset=tensor_slice if id(state) in split_seeds else None))
    covered = {id(v) for v in trained} | {id(state) for _, state in seeds}
    for variable in model.variables:
        if id(variable) in covered or not allocated(variable):
            continue
        # A weight not trained, a statistic or an adapter run's frozen base (the
        # first replica's first slice of the stage that holds it writes it), or,
        # in a pipelined model allocated whole, another stage's weights (read).
        shape, split, tensor = region(variable)
        entries.append(Entry(relative_key(variable, names), variable, shape, split, tensor,
                             writes=not variable.trainable and data_index == 0
                             and tensor_index == 0 and (held is None or id(variable) in held)
                             and stage_writes(variable)))
    return entries
